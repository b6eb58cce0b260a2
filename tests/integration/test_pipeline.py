"""The processes of a run together: engines on Ray, two `rollstream produce` processes
attached to them, and a trainer (this test) reading batches and publishing weights
for several steps. No prompt is lost and none is trained twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import ray
import redis

from rollstream.producer.fleet.pool import EnginePool
from rollstream.shared.buffer_types import Batch
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import WEIGHT_SYNC, RunControl
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import prompts, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]

STEPS, BATCH, FED = 5, 4, 40
THRESHOLD = 2  # (max_staleness 1 + 1) x sync every step


def test_feed_engines_two_producers_and_a_trainer_run_async_steps(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "ROLLSTREAM_REDIS__URL": redis_server.url,
        "ROLLSTREAM_RUN": run_name,
        "ROLLSTREAM_TASKS": '[{"name": "math", "n": 4}]',
        "ROLLSTREAM_ENGINES__COUNT": "2",
        "ROLLSTREAM_ENGINES__NUM_CPUS": "0",
        "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "20",
        "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "200",
        "ROLLSTREAM_ROLLOUT__BATCH_SIZE": str(BATCH),
        "ROLLSTREAM_ROLLOUT__MAX_STALENESS": "1",
        "ROLLSTREAM_PRODUCER__IS_VALID": "keep_all",
        "ROLLSTREAM_PRODUCER__HEARTBEAT_S": "0.2",
    }
    settings = load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": "math", "n": 4}],
        engines={"count": 2, "num_cpus": 0, "sim": {"time_compression": 20.0, "median_tokens": 200}},
    )
    client = redis.Redis.from_url(redis_server.url)
    trainer = open_buffer(client, settings, "trainer")
    control = RunControl(client, trainer.keys)
    trainer.feed(prompts("math", FED))
    EnginePool.start(settings.run, settings.engines)
    address = ray.get_runtime_context().gcs_address
    # output to files: a pipe nobody reads while the test trains would fill up and stall a producer
    logs = [(tmp_path / f"p{i}.out", tmp_path / f"p{i}.err") for i in range(2)]
    producers = []
    for out, err in logs:
        with out.open("w") as stdout, err.open("w") as stderr:
            command = [sys.executable, "-m", "rollstream.cli.main", "produce", "--address", address]
            producers.append(subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr))

    def running() -> bool:
        """True while both producers run; one that exited fails the test with its output,
        instead of showing up later as a missing batch or a missing heartbeat."""
        for proc, (_, err) in zip(producers, logs, strict=True):
            code = proc.poll()
            assert code is None, f"a producer exited with {code}: {err.read_text()[-2000:]}"
        return True

    trained: list[str] = []
    expired = 0
    try:
        for step in range(1, STEPS + 1):
            batch = Batch("math")
            deadline = time.monotonic() + 60
            while len(batch) < BATCH and time.monotonic() < deadline and running():
                for item in trainer.read_batch("math", BATCH - len(batch), block_ms=200).items:
                    # a partial rollout keeps its oldest tokens' step: expiry is the safety net
                    if step - item.group.model_step - 1 >= THRESHOLD:
                        assert trainer.expire(item) is not None
                        expired += 1
                    else:
                        batch.items.append(item)
            assert len(batch) == BATCH, f"step {step}: {len(batch)} groups"
            trained += [g.group_id for g in batch.groups]
            assert trainer.commit(batch) == []
            control.publish(WEIGHT_SYNC, step)
        # both are live: each has a heartbeat younger than 5 s
        wait_for(lambda: running() and len(control.producers(max_age_s=5)) == 2, timeout=60)
    finally:
        for proc in producers:
            proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in producers:
            try:
                codes.append(proc.wait(timeout=60))
            except subprocess.TimeoutExpired:  # a stop that hangs fails below, with its output
                proc.kill()
                codes.append(proc.wait())
        EnginePool.stop(settings.run, settings.engines.count)
    outs = [(out.read_text(), err.read_text()) for out, err in logs]
    assert codes == [0, 0], [err[-1500:] for _, err in outs]
    assert all("stopped:" in out for out, _ in outs)
    # every prompt: trained once, or produced and waiting, or back in a pool — none lost
    assert max(Counter(trained).values()) == 1
    waiting = [f[b"group_id"].decode() for _, f in client.xrange(trainer.keys.groups("math"))]
    pools = sum(client.xlen(trainer.keys.stream(k, "math")) for k in ("prompts", "aborted", "expired"))
    assert len(trained) == STEPS * BATCH
    assert len(set(trained) | set(waiting)) == len(trained) + len(waiting)
    assert len(trained) + len(waiting) + pools == FED  # expired prompts are back in their pool
    assert client.hget(trainer.keys.progress, "math:expired") == (str(expired).encode() if expired else None)
