"""`rollstream train --log-to tensorboard,wandb` on a real redis-server: every step's
learning figures land in a TensorBoard event file, read back with TensorBoard's own
reader, and in a W&B run written offline (WANDB_MODE=offline), read back from its file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import group_for, prompts, require

pytestmark = pytest.mark.integration

require("tensorboard", "tensorboard")
require("wandb", "wandb")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.unit.test_tracking import wandb_history

STEPS, BATCH = 3, 2


def test_the_trainer_logs_each_step_to_tensorboard_and_wandb(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    # groups made at model step 0, enough for every step (staleness 0, 1, 2: none expires)
    settings = load_settings(
        run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 4}],
        rollout={"batch_size": BATCH, "max_staleness": 5},
    )  # fmt: skip
    buffer = open_buffer(redis.Redis.from_url(redis_server.url), settings, "p1")
    buffer.feed(prompts("math", STEPS * BATCH))
    for claim in buffer.claim("math", STEPS * BATCH):
        buffer.complete(claim, group_for(claim.prompt))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "PORT"))}
    env.update(
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_REDIS__URL=redis_server.url,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 4}]',
        ROLLSTREAM_ROLLOUT__BATCH_SIZE=str(BATCH),
        ROLLSTREAM_ROLLOUT__MAX_STALENESS="5",
        WANDB_MODE="offline",
    )
    logdir = tmp_path / "tracked"
    args = ["train", "--steps", str(STEPS), "--step-time", "0"]
    args += ["--log-to", "tensorboard,wandb", "--log-dir", str(logdir)]
    done = subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"reward/mean", "reward/std", "rollout/staleness_mean", "perf/seconds_per_step"} <= tags

    def values(tag: str) -> list[tuple[int, float]]:
        return [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]

    assert values("reward/mean") == [(1, 0.5), (2, 0.5), (3, 0.5)]  # scores 0, 1, 0, 1 in each group
    assert values("rollout/staleness_mean") == [(1, 0.0), (2, 1.0), (3, 2.0)]
    assert values("rollout/groups") == [(1, 2.0), (2, 2.0), (3, 2.0)]

    rows = wandb_history(logdir)  # the same figures, a row per step
    assert [(r["_step"], r["reward/mean"], r["rollout/staleness_mean"]) for r in rows] == [
        (1, 0.5, 0.0), (2, 0.5, 1.0), (3, 0.5, 2.0),
    ]  # fmt: skip
