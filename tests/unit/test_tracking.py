"""Per-step learning figures for trackers: the names verl and TRL users read, the
TensorBoard event file read back with TensorBoard's own reader, and a W&B offline run
read back from its .wandb file."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from rollstream.consumer.tracking import TensorBoardLogger, WandbLogger, open_loggers, step_figures
from rollstream.shared.errors import SettingsError
from tests.helpers import require, wait_for


def test_a_step_s_figures_under_verl_and_trl_names() -> None:
    figures = step_figures(
        step_s=0.5, wait_s=1.5, groups=4, scores=[0.0, 1.0, 0.0, 1.0], staleness={0: 3, 2: 1}, expired=1,
        policy={"loss": 0.25, "approx_kl": 0.01, "clip_fraction": 0.125, "ratio_max": 1.5, "new": 2.0},
    )  # fmt: skip
    assert figures == {
        "reward/mean": 0.5,
        "reward/std": 0.5,
        "actor/loss": 0.25,
        "actor/kl": 0.01,
        "actor/clip_fraction": 0.125,
        "actor/importance_ratio_max": 1.5,
        "actor/new": 2.0,  # a figure of a loss of one's own keeps its name, under actor/
        "rollout/staleness_mean": 0.5,
        "rollout/staleness_max": 2.0,
        "rollout/expired": 1.0,
        "rollout/groups": 4.0,
        "perf/seconds_per_step": 0.5,
        "perf/wait_seconds": 1.5,
        "perf/groups_per_second": 2.0,
    }


def test_a_step_without_scores_or_policy_has_no_reward_or_actor_figures() -> None:
    figures = step_figures(0.1, 0.0, 2, [], {}, 0, {"approx_kl": float("nan")})
    assert not [k for k in figures if k.startswith(("reward/", "actor/", "rollout/staleness"))]


def test_tensorboard_reads_back_what_was_logged(tmp_path: Path) -> None:
    require("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = open_loggers("tensorboard", tmp_path / "tb")
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": step / 10, "actor/kl": 0.01 * step})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward/mean", "actor/kl"}
    rewards = [(e.step, round(e.value, 6)) for e in events.Scalars("reward/mean")]
    assert rewards == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_an_unknown_tracker_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="unknown tracker 'tensorbord'; known: tensorboard, wandb"):
        open_loggers("tensorbord", tmp_path)
    assert open_loggers("", tmp_path).loggers == []


def test_without_the_extra_asking_for_tensorboard_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m.partition(".")[0] == "tensorboard"] + ["tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    with pytest.raises(SettingsError, match=r"pip install 'rollstream\[tensorboard\]'"):
        TensorBoardLogger(tmp_path)


def wandb_history(root: Path) -> list[dict[str, object]]:
    """The history rows of the one W&B run under ``root``/wandb, read from its .wandb file
    (LevelDB log records of wandb's protobuf Record), as W&B's own sync reads it. The run's
    service process may still be writing the file after ``finish`` returns: read it once
    it holds the run's exit record."""
    from wandb.proto import wandb_internal_pb2

    def records() -> list[Any]:
        paths = list((root / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(paths) <= 1, paths
        if not paths:
            return []
        out = []
        for chunk in _log_records(paths[0].read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
        return out

    done = wait_for(lambda: (r := records()) and r[-1].WhichOneof("record_type") == "exit" and r, timeout=30)
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        for record in done
        if record.WhichOneof("record_type") == "history"
    ]


def _log_records(data: bytes, block: int = 32768) -> list[bytes]:
    """The records of a LevelDB log after wandb's 7-byte header (":W&B", magic, version)."""
    assert data[:4] == b":W&B"
    pos, chunks, pending = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # a whole record
            chunks.append(chunk)
        elif kind in (2, 3):  # its first or a middle part
            pending += chunk
        elif kind == 4:  # its last part
            chunks.append(pending + chunk)
            pending = b""
        else:
            break
    return chunks


def test_wandb_offline_writes_a_run_that_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("wandb", "wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = open_loggers("wandb", tmp_path, name="exp1", config={"rollout": {"batch_size": 4}})
    for step in (1, 2):
        logger.log(step, {"reward/mean": step / 10, "actor/kl": 0.01})
    logger.close()
    rows = wandb_history(tmp_path)
    assert [(r["_step"], r["reward/mean"], r["actor/kl"]) for r in rows] == [(1, 0.1, 0.01), (2, 0.2, 0.01)]


def test_without_the_wandb_extra_asking_for_it_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m.partition(".")[0] == "wandb"] + ["wandb"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SettingsError, match=r"pip install 'rollstream\[wandb\]' \(WANDB_MODE=offline"):
        WandbLogger(tmp_path, "exp1")
