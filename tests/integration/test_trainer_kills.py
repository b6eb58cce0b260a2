"""A trainer killed from outside again and again within one step (the OOM killer, a
preemption, an operator) is not a poison group: it redoes the step on the same groups
once it is let live, and nothing good is dead-lettered."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import TRAINER, Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import group_for, prompts, wait_for

pytestmark = pytest.mark.integration

BATCH = 4
KILLS = 4  # more than max_attempts 3: the fourth re-read used to dead-letter the batch


def test_a_trainer_killed_repeatedly_within_one_step_redoes_it_on_the_same_groups(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=redis_server.url, ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]', ROLLSTREAM_ROLLOUT__BATCH_SIZE=str(BATCH),
        ROLLSTREAM_BUFFER__MAX_ATTEMPTS="3",
    )  # fmt: skip
    settings = load_settings(
        run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}],
        rollout={"batch_size": BATCH}, buffer={"max_attempts": 3},
    )  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    producer = open_buffer(client, settings, "p")
    producer.feed(prompts("math", BATCH))
    made = []
    for claim in producer.claim("math", BATCH):
        producer.complete(claim, group_for(claim.prompt, n=2))
        made.append(claim.prompt.group_id)
    record = tmp_path / "trained.jsonl"
    train = [sys.executable, "-m", "rollstream.cli.main", "train", "--steps", "1", "--record", str(record)]

    def pending() -> int:
        return int(client.xpending(keys.groups("math"), TRAINER)["pending"])

    def read_since(started: float) -> bool:
        """The whole batch read (or re-read) by a trainer started at ``started``: each group
        delivered or touched since, its idle time shorter than the time since then."""
        pending = client.xpending_range(keys.groups("math"), TRAINER, "-", "+", 100)
        since_ms = (time.monotonic() - started) * 1000
        return len(pending) == BATCH and all(int(p["time_since_delivered"]) < since_ms for p in pending)

    for _ in range(KILLS):
        # Given a trainer in the middle of step 1 (a long step: the batch read, not committed)
        started = time.monotonic()
        with subprocess.Popen(
            [*train, "--step-time", "600"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ) as trainer:
            try:
                before = client.xlen(keys.dead)
                wait_for(lambda t=trainer, s=started: t.poll() is not None or read_since(s), 60)
                assert trainer.poll() is None, trainer.communicate()[1][-2000:]
                assert client.xlen(keys.dead) == before == 0
            finally:
                trainer.kill()  # When it is killed -9 before its commit
                trainer.communicate(timeout=30)
    # the kills were not deliveries: Redis counts each group delivered once
    counts = client.xpending_range(keys.groups("math"), TRAINER, "-", "+", 100)
    assert [int(p["times_delivered"]) for p in counts] == [1] * BATCH
    # Then the trainer let live trains step 1 on the very groups it was killed with
    done = subprocess.run([*train, "--step-time", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert client.xlen(keys.dead) == 0
    assert RunControl(client, keys).train_step() == 1
    lines = [orjson.loads(line) for line in record.read_bytes().splitlines()]
    [read] = [e for e in lines if e["event"] == "read"]
    assert read["step"] == 1 and sorted(g for g, _ in read["groups"]) == sorted(made)
    assert pending() == 0 and client.xlen(keys.groups("math")) == 0
    client.close()
