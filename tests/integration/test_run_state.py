"""The run's state on a real redis-server: model_step never moves backwards but by an
operator's explicit rollback, producer heartbeats are aged on the server's clock, and a
corrupt step names its repair."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from rollstream.cli.main import main
from rollstream.consumer.assembly import create_reader
from rollstream.consumer.weights import publish_weights, wait_for_producers
from rollstream.producer.assembly import build_producer
from rollstream.shared import events as shared_events
from rollstream.shared.embedded import EmbeddedRedis, free_port
from rollstream.shared.errors import CorruptValueError
from rollstream.shared.events import RunControl, StepBackwards
from rollstream.shared.keys import Keys
from rollstream.shared.settings import load_settings
from tests.helpers import prompts, rollstream

pytestmark = pytest.mark.integration


@pytest.fixture
def control(redis_server: EmbeddedRedis, run_name: str) -> RunControl:
    return RunControl(redis.Redis.from_url(redis_server.url), Keys(run_name))


def cli(server: EmbeddedRedis, run: str, *args: str) -> int:
    return main(["--redis-url", server.url, "--run", run, *args])


def test_a_weight_sync_never_moves_the_model_step_backwards(
    control: RunControl, redis_server: EmbeddedRedis, run_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    start = control.last_event_id()
    publish_weights(control, 5, "/ckpt/5")
    with pytest.raises(StepBackwards, match=r"model_step 5: a weight sync to step 3 .*--model-step 3 --yes"):
        publish_weights(control, 3, "/ckpt/3")
    assert control.model_step() == 5
    assert [e.model_step for e in control.events(start)] == [5]  # nothing published
    publish_weights(control, 5, "/ckpt/5")  # the same step again: harmless
    assert control.model_step() == 5
    # a rollback is an operator's explicit act
    assert cli(redis_server, run_name, "steps", "--model-step", "3") == 1
    assert control.model_step() == 5
    assert cli(redis_server, run_name, "steps", "--model-step", "3", "--yes") == 0
    assert control.model_step() == 3
    assert [(e.model_step, e.uri) for e in control.events(start)][-1] == (3, "")
    assert "model_step set 5 -> 3" in capsys.readouterr().out


def test_a_corrupt_model_step_names_its_repair(
    control: RunControl, redis_server: EmbeddedRedis, run_name: str
) -> None:
    control.client.hset(control.keys.state, "model_step", "three")
    with pytest.raises(CorruptValueError, match=r"model_step is 'three'.*`rollstream steps --model-step N"):
        control.model_step()
    with pytest.raises(CorruptValueError, match=r"rollstream steps --model-step N --yes"):
        publish_weights(control, 4)
    assert cli(redis_server, run_name, "steps", "--model-step", "4", "--yes") == 0
    assert control.model_step() == 4


class SkewedTime:
    """rollstream.shared.events' view of the time module, ``skew_s`` off the real clock."""

    def __init__(self, skew_s: float) -> None:
        self.skew_s = skew_s

    def time(self) -> float:
        return time.time() + self.skew_s

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_a_producer_whose_clock_is_off_is_not_taken_for_dead(
    control: RunControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as skewed:  # the producer's machine: its clock 10 s behind
        skewed.setattr(shared_events, "time", SkewedTime(-10.0))
        control.publish_status("behind", 2, 1)
    control.publish_status("right", 2, 0)
    # the trainer's machine, on the right time: both are alive, neither is deleted
    assert [(b.producer, b.model_step) for b in control.producers(5.0)] == [("behind", 2), ("right", 2)]
    assert control.client.hexists(control.keys.state, "producer:behind")
    assert wait_for_producers(control, 2, timeout_s=1.0, heartbeat_age_s=5.0) == ["behind", "right"]


def test_a_group_of_empty_responses_has_the_step_it_was_made_at(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": "math", "n": 2}],
        engines={"kind": "tests.plugins.engine:make", "count": 1, "options": {"tokens": 0}},
        rollout={"batch_size": 2, "max_staleness": 0},
        producer={"is_valid": "keep_all"},
    )
    client = redis.Redis.from_url(redis_server.url)
    producer = build_producer(client, settings, name="p1")
    publish_weights(producer.control, 3)  # the run is at step 3 when the producer starts
    producer.buffer.feed(prompts("math", 2))
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    assert producer.stats.outcomes == {"completed": 2}
    # the trainer's step 4 trains groups made on step 3: not stale (with -1 they would be,
    # at every step past the threshold, and be re-rolled for ever)
    batch = create_reader(settings, client=redis.Redis.from_url(redis_server.url)).get_batch(4, timeout_s=10)
    assert [g.model_step for g in batch.groups] == [3, 3]
    assert all(s.response_ids.size == 0 for g in batch.groups for s in g.samples)
    assert batch.expired == 0
    batch.commit()


def test_a_progress_counter_that_is_not_a_number_stops_the_producer_naming_the_key(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": "math", "n": 2}],
        engines={"kind": "tests.plugins.engine:make", "count": 1},
        rollout={"batch_size": 2},
        producer={"is_valid": "keep_all"},
    )
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    client.hset(keys.progress, "math:produced_tokens", "lots")  # one the settle adds to
    producer = build_producer(client, settings, name="p1")
    producer.buffer.feed(prompts("math", 4))
    # was: every group failed with a logged ResponseError, its claim left pending, for ever
    with pytest.raises(CorruptValueError, match=r"rs:\{t\w+\}:progress field math:produced_tokens is 'lots'"):
        asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))


@pytest.mark.parametrize("command", [("status",), ("check",), ("steps",)])
def test_a_redis_url_naming_a_database_the_server_lacks_is_a_settings_error(
    redis_server: EmbeddedRedis, run_name: str, capsys: pytest.CaptureFixture[str], command: tuple[str, ...]
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/99"
    assert cli_at(url, run_name, *command) == 2  # a setting to fix, not an outage to wait out (3)
    err = capsys.readouterr().err
    assert "invalid setting redis.url (ROLLSTREAM_REDIS__URL)" in err and "database 99" in err, err
    assert "not reachable" not in err


def cli_at(url: str, run: str, *args: str) -> int:
    return main(["--redis-url", url, "--run", run, *args])


def test_one_shot_commands_fail_at_once_on_an_unreachable_redis(tmp_path: Path, run_name: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    path = tmp_path / "p.jsonl"
    path.write_text('{"uid": "q1", "prompt": "1 + 1?"}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(ROLLSTREAM_REDIS__URL=url, ROLLSTREAM_RUN=run_name, ROLLSTREAM_PROCESS__WAIT_TIMEOUT_S="600")
    for command in (
        ["feed", str(path), "--task", "default"],
        ["status"],
        ["show", "prompts"],
        ["steps"],
        ["pause"],
        ["resume"],
        ["stop"],
    ):
        started = time.monotonic()
        done = subprocess.run(rollstream(*command), env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 3, (command, done.stderr[-2000:])  # not a wait of 600 s
        assert f"Redis is not reachable at {url}" in done.stderr, (command, done.stderr[-2000:])
        assert time.monotonic() - started < 30, command
    # waiting is asked for explicitly (a script starting it beside Redis), bounded as processes' waits
    env["ROLLSTREAM_PROCESS__WAIT_TIMEOUT_S"] = "1"
    done = subprocess.run(rollstream("feed", str(path), "--task", "default", "--wait"), env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 4 and "gave up waiting for Redis" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(("key", "command"), [("state", ("steps",)), ("progress", ("status",))])
def test_a_wrongtype_reply_names_the_key(
    control: RunControl,
    redis_server: EmbeddedRedis,
    run_name: str,
    capsys: pytest.CaptureFixture[str],
    key: str,
    command: tuple[str, ...],
) -> None:
    wrong = f"rs:{{{run_name}}}:{key}"
    control.client.set(wrong, "something else's")
    control.client.rpush(f"rs:{{{run_name}}}:dead", "another")  # a second one, a list
    assert cli(redis_server, run_name, *command) == 1
    err = capsys.readouterr().err
    assert "Redis refused a command: " in err and "WRONGTYPE" in err
    assert f"{wrong} holds a string, not a hash" in err, err
    assert f"rs:{{{run_name}}}:dead holds a list, not a stream" in err, err
