"""The rollout archive (consumer/archive.py): the trainer's commit copies each group it
trained to the trained log in its own script, and the archiver writes every trained
group, and every untrained prompt with its reason, to Parquet exactly once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollstream.shared.keys import ARCHIVE, TRAINER
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts, require

pa = require("pyarrow", "archive")

from rollstream.consumer.archive import Archiver

pytestmark = pytest.mark.integration


def _archive_settings(tmp_path: Path, **more: Any) -> dict[str, Any]:
    return {"archive": {"keep": 1000, "dir": str(tmp_path / "archive"), "flush_s": 0.05, **more}}


def _produce_and_train(
    producer: Any, trainer: Any, task: str, count: int, step: int, *, start: int = 0
) -> list[str]:
    """Feed, complete and commit ``count`` groups at train step ``step``; their group ids."""
    producer.feed(prompts(task, count, start))
    done = []
    for claim in producer.claim(task, count):
        group = group_for(claim.prompt, n=4, tokens=6, step=step - 1)
        group.producer = producer.consumer
        producer.complete(claim, group)
        done.append(claim.group_id)
    batch = trainer.read_batch(task, count)
    assert len(batch) == count
    assert trainer.commit(batch, step) == []
    return done


def _read(folder: Path) -> Any:
    import pyarrow.dataset as ds

    return ds.dataset(str(folder), format="parquet").to_table().to_pandas()


def test_commit_logs_trained_groups_and_leaves_them_to_the_archiver(
    real_buffer: BufferFactory, tmp_path: Path
) -> None:
    producer = real_buffer("p1", **_archive_settings(tmp_path))
    trainer = real_buffer("trainer", **_archive_settings(tmp_path))
    ids = _produce_and_train(producer, trainer, "math", 3, step=5)
    client = trainer.client
    groups = trainer.keys.groups("math")
    log = client.xrange(trainer.keys.trained("math"))
    in_stream = [e[0] for e in client.xrange(groups)]
    assert [e[1][b"source_id"] for e in log] == in_stream  # acked, kept for the archiver
    assert [e[1][b"group_id"].decode() for e in client.xrange(groups)] == ids
    assert client.xpending(groups, TRAINER)["pending"] == 0
    assert all(e[1][b"train_step"] == b"5" and e[1][b"trained_by"] == b"trainer" for e in log)
    assert int(client.hget(trainer.keys.progress, "math:consumed")) == 3


def test_no_log_without_an_archive(real_buffer: BufferFactory, tmp_path: Path) -> None:
    producer = real_buffer("p1")
    trainer = real_buffer("trainer")
    _produce_and_train(producer, trainer, "math", 2, step=1)
    assert trainer.client.exists(trainer.keys.trained("math")) == 0
    assert trainer.client.xlen(trainer.keys.groups("math")) == 0  # deleted at the commit, as ever


def test_log_is_capped_and_the_trainer_warns(
    real_buffer: BufferFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _archive_settings(tmp_path, keep=5)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    for step in range(1, 4):
        _produce_and_train(producer, trainer, "math", 4, step=step, start=10 * step)
    # no archiver: the log keeps the newest 5, and only their groups stay in Redis
    client = trainer.client
    log = client.xrange(trainer.keys.trained("math"))
    assert len(log) == 5
    assert [e[1][b"source_id"] for e in log] == [e[0] for e in client.xrange(trainer.keys.groups("math"))]
    assert "3 trained groups were deleted unarchived" in caplog.text and "archive.keep 5" in caplog.text


def test_archive_writes_every_trained_group_once_with_its_lineage(
    real_buffer: BufferFactory, tmp_path: Path
) -> None:
    settings = _archive_settings(tmp_path)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    ids = _produce_and_train(producer, trainer, "math", 3, step=2)
    ids += _produce_and_train(producer, trainer, "code", 2, step=3, start=10)
    archiver = Archiver(trainer.client, trainer.settings)
    archiver.ensure()
    archiver.step(0)
    archiver.flush()
    root = tmp_path / "archive"
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet"))
    run = trainer.settings.run
    assert [f.rsplit("/", 1)[0] for f in files] == [
        f"trained/{run}/code/step-00000003",
        f"trained/{run}/math/step-00000002",
    ]
    df = _read(root / "trained")
    assert sorted(set(df["group_id"])) == sorted(ids)
    assert len(df) == 3 * 4 + 2 * 4  # one row per sample
    row = df[(df["group_id"] == "math:u0") & (df["sample_index"] == 1)].iloc[0]
    assert row["run"] == run and row["task"] == "math" and row["uid"] == "u0"
    assert row["prompt"] == "What is 0 + 1?" and list(row["prompt_ids"]) == [1, 2, 3]
    assert list(row["response_ids"]) == list(range(1, 7))
    assert list(row["logprobs"]) == [-0.5] * 6 and list(row["versions"]) == [1] * 6
    assert row["reward"] == 1.0 and row["reward_details"] == '{"score":1.0}'
    assert row["model_step"] == 1 and row["train_step"] == 2 and row["staleness"] == 0
    assert row["fate"] == "trained" and row["producer"] == "p1" and row["finish_reason"] == "stop"
    assert row["prompt_meta"] == '{"answer":"1"}'
    assert row["created_at"] <= row["trained_at"] <= row["archived_at"]
    # archived: the log entries and the groups are deleted
    for task in ("math", "code"):
        assert trainer.client.xlen(trainer.keys.trained(task)) == 0
        assert trainer.client.xpending(trainer.keys.trained(task), ARCHIVE)["pending"] == 0
        assert trainer.client.xlen(trainer.keys.groups(task)) == 0
