"""The run's control plane: its state hash (model_step, train_step, producer
heartbeats) and its events stream (weight syncs and control events).

    rs:{run}:state    model_step, train_step, producer:{id} -> heartbeat JSON
    rs:{run}:events   type (weight_sync | pause | resume | stop), model_step, uri, ts

Every producer reads every event (plain XREAD, no consumer group). The stream
is capped: what a late producer needs is the current model_step, which the
state hash holds; the events only say when it changed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from shared.keys import MODEL_STEP, TRAIN_STEP, Keys
from shared.streams import text

EVENTS_CAP = 10_000
WEIGHT_SYNC = "weight_sync"
PAUSE = "pause"
RESUME = "resume"
STOP = "stop"
PRODUCER_PREFIX = "producer:"


@dataclass(slots=True, frozen=True)
class Event:
    id: str
    type: str
    model_step: int
    uri: str
    ts: float


@dataclass(slots=True, frozen=True)
class Heartbeat:
    producer: str
    model_step: int
    inflight: int
    ts: float


class RunControl:
    """Reads and writes the run's state and events."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def model_step(self) -> int:
        value = self.client.hget(self.keys.state, MODEL_STEP)
        return 0 if value is None else int(value)

    def train_step(self) -> int:
        value = self.client.hget(self.keys.state, TRAIN_STEP)
        return 0 if value is None else int(value)

    def set_train_step(self, step: int) -> None:
        self.client.hset(self.keys.state, TRAIN_STEP, step)

    def publish(self, type_: str, model_step: int | None = None, uri: str = "") -> str:
        """Append an event; a weight sync also sets the run's model_step, in one step."""
        pipe = self.client.pipeline(transaction=True)
        if type_ == WEIGHT_SYNC:
            if model_step is None:
                raise ValueError("a weight_sync event needs its model_step")
            pipe.hset(self.keys.state, MODEL_STEP, model_step)
        fields = {
            "type": type_,
            "model_step": -1 if model_step is None else model_step,
            "uri": uri,
            "ts": time.time(),
        }
        pipe.xadd(self.keys.events, fields, maxlen=EVENTS_CAP, approximate=True)  # type: ignore[arg-type]
        return text(pipe.execute()[-1])

    def last_event_id(self) -> str:
        """Where a new follower starts: after everything already there."""
        last = self.client.xrevrange(self.keys.events, count=1)
        return text(last[0][0]) if last else "0-0"

    def events(self, after: str, block_ms: int = 0, count: int = 100) -> list[Event]:
        reply: Any = self.client.xread({self.keys.events: after}, count=count, block=block_ms or None)
        out = []
        for _, items in reply or []:
            for entry_id, fields in items:
                out.append(
                    Event(
                        id=text(entry_id),
                        type=text(fields.get(b"type", b"")),
                        model_step=int(fields.get(b"model_step", -1)),
                        uri=text(fields.get(b"uri", b"")),
                        ts=float(fields.get(b"ts", 0)),
                    )
                )
        return out

    def heartbeat(self, producer: str, model_step: int, inflight: int) -> None:
        beat = {"model_step": model_step, "inflight": inflight, "ts": time.time()}
        self.client.hset(self.keys.state, PRODUCER_PREFIX + producer, orjson.dumps(beat))

    def forget(self, producer: str) -> None:
        self.client.hdel(self.keys.state, PRODUCER_PREFIX + producer)

    def producers(self, max_age_s: float) -> list[Heartbeat]:
        """Producers whose last heartbeat is younger than ``max_age_s``; older ones are
        removed from the state as dead."""
        now = time.time()
        live, dead = [], []
        for name, raw in self.client.hgetall(self.keys.state).items():
            key = text(name)
            if not key.startswith(PRODUCER_PREFIX):
                continue
            beat = orjson.loads(raw)
            if now - beat["ts"] > max_age_s:
                dead.append(key)
            else:
                live.append(
                    Heartbeat(key[len(PRODUCER_PREFIX) :], beat["model_step"], beat["inflight"], beat["ts"])
                )
        if dead:
            self.client.hdel(self.keys.state, *dead)
        return sorted(live, key=lambda b: b.producer)
