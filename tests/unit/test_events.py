from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from rollstream.shared import events as shared_events
from rollstream.shared.events import PAUSE, WEIGHT_SYNC, RunControl
from rollstream.shared.keys import Keys


class FrozenTime:
    """rollstream.shared.events' view of the time module: time.time() moves only when a test says."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_weight_sync_sets_the_model_step_and_followers_see_it(fake_client: redis.Redis) -> None:
    control = RunControl(fake_client, Keys("exp"))
    assert control.model_step() == 0
    start = control.last_event_id()
    control.publish(WEIGHT_SYNC, 3, uri="/ckpt/3")
    control.publish(PAUSE)
    events = control.events(start)
    assert [(e.type, e.model_step, e.uri) for e in events] == [(WEIGHT_SYNC, 3, "/ckpt/3"), (PAUSE, -1, "")]
    assert control.model_step() == 3
    assert control.events(events[-1].id) == []
    assert control.last_event_id() == events[-1].id


def test_heartbeats_list_live_producers_and_drop_dead_ones(
    fake_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FrozenTime(1_000_000.0)
    monkeypatch.setattr(shared_events, "time", clock)
    control = RunControl(fake_client, Keys("exp"))
    control.heartbeat("p1", 2, 5)
    control.heartbeat("p2", 1, 0)
    assert [(b.producer, b.model_step, b.inflight) for b in control.producers(60)] == [
        ("p1", 2, 5),
        ("p2", 1, 0),
    ]
    clock.now += 0.05
    control.heartbeat("p2", 2, 1)
    assert [b.producer for b in control.producers(0.04)] == ["p2"]
    assert fake_client.hexists(Keys("exp").state, "producer:p1") == 0
    control.forget("p2")
    assert control.producers(60) == []
