"""The run's state on a real redis-server: model_step never moves backwards but by an
operator's explicit rollback, producer heartbeats are aged on the server's clock, and a
corrupt step names its repair."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from rollstream.cli.main import main
from rollstream.consumer.weights import publish_weights, wait_for_producers
from rollstream.shared import events as shared_events
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import CorruptValueError
from rollstream.shared.events import RunControl, StepBackwards
from rollstream.shared.keys import Keys

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
        control.heartbeat("behind", 2, 1)
    control.heartbeat("right", 2, 0)
    # the trainer's machine, on the right time: both are alive, neither is deleted
    assert [(b.producer, b.model_step) for b in control.producers(5.0)] == [("behind", 2), ("right", 2)]
    assert control.client.hexists(control.keys.state, "producer:behind")
    assert wait_for_producers(control, 2, timeout_s=1.0, heartbeat_age_s=5.0) == ["behind", "right"]
