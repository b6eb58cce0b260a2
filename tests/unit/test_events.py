from __future__ import annotations

import orjson
import redis

from rollstream.shared.events import PAUSE, WEIGHT_SYNC, RunControl
from rollstream.shared.keys import Keys


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


def test_heartbeats_list_live_producers_and_drop_dead_ones(fake_client: redis.Redis) -> None:
    control = RunControl(fake_client, Keys("exp"))
    control.publish_status("p1", 2, 5)
    control.publish_status("p2", 1, 0)
    assert [(b.producer, b.model_step, b.inflight) for b in control.producers(60)] == [
        ("p1", 2, 5),
        ("p2", 1, 0),
    ]
    # p1's last beat 100 s ago on the server's clock, which stamps and ages heartbeats
    old = {"model_step": 2, "inflight": 5, "ts": control.server_time() - 100}
    fake_client.hset(Keys("exp").state, "producer:p1", orjson.dumps(old))
    control.publish_status("p2", 2, 1)
    assert [b.producer for b in control.producers(60)] == ["p2"]
    assert fake_client.hexists(Keys("exp").state, "producer:p1") == 0
    control.forget("p2")
    assert control.producers(60) == []
