"""A trainer stopped or killed before its commit redoes that step number with the groups
it had read; a SIGTERM while it waits for a batch ends it with exit 0 and commits nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import redis

from rollstream.consumer.assembly import create_reader, create_trainer
from rollstream.consumer.trainer import StepLog
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import TRAINER, Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings
from tests.helpers import group_for, prompts, wait_for

pytestmark = pytest.mark.integration


def settings_for(server: EmbeddedRedis, run: str, **rollout: Any) -> Settings:
    return load_settings(
        run=run, redis={"url": server.url}, tasks=[{"name": "math", "n": 2}],
        rollout={"batch_size": 2, "max_staleness": 0, **rollout},
    )  # fmt: skip


def produce(buffer: ReplayBuffer, count: int, step: int, start: int) -> list[str]:
    buffer.feed(prompts("math", count, start=start))
    ids = []
    for claim in buffer.claim("math", count):
        buffer.complete(claim, group_for(claim.prompt, step=step))
        ids.append(claim.prompt.group_id)
    return ids


def test_a_trainer_that_died_before_its_commit_redoes_the_same_step(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    # max_staleness 0: a skipped step number would expire every later group for good
    settings = settings_for(redis_server, run_name)
    client = redis.Redis.from_url(redis_server.url)
    first = produce(open_buffer(client, settings, "p"), 2, step=0, start=0)
    # Given a trainer that read the batch of step 1 and died before its commit
    doomed = create_reader(settings, client=client, consumer="trainer")
    assert sorted(g.group_id for g in doomed.get_batch(1, timeout_s=5).groups) == sorted(first)
    control = RunControl(client, Keys(run_name))
    assert control.train_step() == 0  # nothing committed, nothing recorded
    # When the trainer restarts under the same consumer name
    steps: list[StepLog] = []
    log = create_trainer(settings, client=client, step_time_s=0, consumer="trainer").run(1, steps.append)
    # Then it trains step 1 again, on the same groups, at staleness 0, and commits it
    assert [s.step for s in log.steps] == [1]
    assert steps[0].groups == 2 and steps[0].expired == 0 and steps[0].staleness == {0: 2}
    assert control.train_step() == 1 and control.model_step() == 1
    assert client.xpending(Keys(run_name).groups("math"), TRAINER)["pending"] == 0
    # and the run goes on: groups made on the new weights are trained at step 2
    produce(open_buffer(client, settings, "p"), 2, step=1, start=2)
    log = create_trainer(settings, client=client, step_time_s=0, consumer="trainer").run(1)
    assert [(s.step, s.expired) for s in log.steps] == [(2, 0)]


def test_sigterm_while_waiting_for_a_batch_exits_0_and_commits_nothing(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(ROLLSTREAM_REDIS__URL=redis_server.url, ROLLSTREAM_RUN=run_name)
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    args = [sys.executable, "-m", "rollstream.cli.main", "train", "--steps", "3", "--step-time", "0"]
    with subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as trainer:
        # Given a trainer waiting for a batch that does not come (its heartbeat says it is up)
        wait_for(
            lambda: trainer.poll() is not None or any(client.scan_iter(match=keys.alive_pattern)), timeout=30
        )
        assert trainer.poll() is None, trainer.communicate()[1][-2000:]
        # When it gets SIGTERM, Then it exits 0 without a step
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=30)
    assert trainer.returncode == 0, err[-2000:]
    assert "0 steps done, stopped" in err
    assert RunControl(client, keys).train_step() == 0
    assert list(client.scan_iter(match=keys.alive_pattern)) == []


def test_steps_shows_a_stuck_run_and_repairs_it(redis_server: EmbeddedRedis, run_name: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(ROLLSTREAM_REDIS__URL=redis_server.url, ROLLSTREAM_RUN=run_name)
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    # Given the state an old trainer left: step numbers skipped past the staleness bound
    client.hset(keys.state, mapping={"model_step": 3, "train_step": 6})

    def steps(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rollstream.cli.main", "steps", *args], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    shown = steps()
    assert shown.returncode == 1 and "STUCK" in shown.stdout and "--train-step 3 --yes" in shown.stdout
    refused = steps("--train-step", "3")  # not without --yes
    assert refused.returncode == 1 and RunControl(client, keys).train_step() == 6
    repaired = steps("--train-step", "3", "--yes")
    assert repaired.returncode == 0, repaired.stderr
    assert RunControl(client, keys).train_step() == 3
    assert steps().returncode == 0


def test_a_trainer_that_died_between_commit_and_weight_sync_publishes_it_on_restart(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = settings_for(redis_server, run_name)  # max_staleness 0: a missed sync deadlocks the run
    client = redis.Redis.from_url(redis_server.url)
    control = RunControl(client, Keys(run_name))
    # Given step 1 committed, and its weight sync never published
    produce(open_buffer(client, settings, "p"), 2, step=0, start=0)
    create_reader(settings, client=client, consumer="trainer").get_batch(1, timeout_s=5).commit()
    assert (control.train_step(), control.model_step()) == (1, 0)
    # When the trainer restarts, Then it publishes step 1 before it waits for step 2
    produce(open_buffer(client, settings, "p"), 2, step=1, start=2)
    log = create_trainer(settings, client=client, step_time_s=0, consumer="trainer").run(1)
    assert [(s.step, s.expired) for s in log.steps] == [(2, 0)]
    events = [f[b"model_step"] for _, f in client.xrange(Keys(run_name).events)]
    assert events == [b"1", b"2"]
