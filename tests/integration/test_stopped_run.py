"""A process started against a run that has already stopped does not work on it: a
Deployment restarting what exited on the stop, or a feeder started late, read only the
events after the last one and never saw the stop (a restarted feeder fed 15 more prompts
into a finished run). The stop is kept in the run's state; a long-running process says
so and exits 0, so that a supervisor that restarts on failure leaves it down; a one-shot
feed is refused with exit 1."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
import redis

from rollstream.cli.process import running
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RESUME, STOP, RunControl
from rollstream.shared.keys import Keys
from tests.conftest import SettingsFactory
from tests.helpers import rollstream
from tests.integration.test_produce_processes import producer_env

pytestmark = pytest.mark.integration


def test_a_feeder_and_a_producer_started_after_the_stop_do_nothing_and_exit_0(
    redis_server: EmbeddedRedis, tmp_path: Path, run_name: str
) -> None:
    env = producer_env(redis_server.url, run_name)
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    prompts = tmp_path / "p.jsonl"
    lines = [f'{{"uid": "q{i}", "prompt": "{i} + 1?", "answer": "{i + 1}"}}\n' for i in range(5)]
    prompts.write_text("".join(lines))
    feed = rollstream("feed", str(prompts), "--task", "math")
    fed = subprocess.run(feed, env=env, capture_output=True, text=True)
    assert fed.returncode == 0, fed.stderr
    assert client.xlen(keys.prompts("math")) == 5
    RunControl(client, keys).publish(STOP)

    # a person's one-shot feed is refused (exit 1); the processes a supervisor runs say so and
    # exit 0: a restart on failure leaves them down
    for command, code in (
        (("feed", str(prompts), "--task", "math"), 1),
        (("feed", str(prompts), "--task", "math", "--until-stopped"), 0),
        (("produce", "--local-engines"), 0),
    ):
        done = subprocess.run(rollstream(*command), env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == code, done.stderr
        assert f"run {run_name!r} was stopped at" in done.stderr and "will not work on it" in done.stderr
    assert client.xlen(keys.prompts("math")) == 5  # nothing fed
    assert client.xlen(keys.groups("math")) == 0  # nothing claimed or produced


def test_the_readers_of_a_stopped_run_still_start(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory
) -> None:
    """The metrics and archive processes only read: a stopped run's figures and its last
    trained groups are still theirs to serve and write."""
    settings = make_settings(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    RunControl(client, Keys(settings.run)).publish(STOP)
    assert RunControl(client, Keys(settings.run)).stopped() is not None
    with running(settings, "trainer", threading.Event(), heartbeat=False, follow=False) as process:
        assert process is None
    with running(
        settings, "metrics", threading.Event(), heartbeat=False, follow=False, refuse_stopped=False
    ) as process:
        assert process is not None


def test_resume_lets_a_stopped_run_go_on(redis_server: EmbeddedRedis, make_settings: SettingsFactory) -> None:
    settings = make_settings(redis_server.url)
    control = RunControl(redis.Redis.from_url(redis_server.url), Keys(settings.run))
    control.publish(STOP)
    with running(settings, "producer", threading.Event(), heartbeat=False, follow=False) as process:
        assert process is None
    control.publish(RESUME)
    assert control.stopped() is None
    stop = threading.Event()
    with running(settings, "producer", stop, heartbeat=False, follow=False) as process:
        assert process is not None
        stop.set()
