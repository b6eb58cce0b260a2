"""The run's control plane: its state hash (model_step, train_step, producer
heartbeats) and its events stream (weight syncs and control events).

    rs:{run}:state    model_step, train_step, paused, ray_address,
                      producer:{id} -> heartbeat JSON
    rs:{run}:events   type (weight_sync | pause | resume | stop), model_step, uri, ts

Every process reads every event (plain XREAD, no consumer group). The stream
is capped: what a late starter needs is the current model_step and whether the
run is paused, which the state hash holds; the events only say when it changed.
A process reads the id of the newest event *before* it reads the state, and
follows from that id, so nothing published in between is missed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from rollstream.shared.codec import FORMAT_VERSION, check_format
from rollstream.shared.errors import CorruptValueError
from rollstream.shared.keys import (
    MODEL_STEP,
    PAUSED,
    PRODUCER_BEAT,
    RAY_ADDRESS,
    TRAIN_STEP,
    Keys,
    producer_beat_field,
)
from rollstream.shared.records import MAX_STEP
from rollstream.shared.streams import stored_float, stored_int, stored_step, text

EVENTS_CAP = 10_000
WEIGHT_SYNC = "weight_sync"
PAUSE = "pause"
RESUME = "resume"
STOP = "stop"
# The events `rollstream pause | resume | stop` publish
CONTROL_EVENTS = (PAUSE, RESUME, STOP)
# HSET field to the new value only when it is larger: steps never move backwards
_ADVANCE = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') or 0
if tonumber(ARGV[2]) > current then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 0
"""
log = logging.getLogger(__name__)


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
        self._skip_to: dict[str, str] = {}  # events(): a cursor -> the malformed events after it

    def model_step(self) -> int:
        """The run's model step; CorruptValueError if the state holds something else there."""
        return stored_step(self.client.hget(self.keys.state, MODEL_STEP), self.keys.state, MODEL_STEP)

    def train_step(self) -> int:
        """The last committed train step; CorruptValueError if the state holds something else."""
        return stored_step(self.client.hget(self.keys.state, TRAIN_STEP), self.keys.state, TRAIN_STEP)

    def advance_train_step(self, step: int) -> None:
        """Record ``step`` as committed unless a later one already is."""
        self.client.eval(_ADVANCE, 1, self.keys.state, TRAIN_STEP, step)

    def paused(self) -> bool:
        return self.client.hget(self.keys.state, PAUSED) == b"1"

    def ray_address(self) -> str:
        value = self.client.hget(self.keys.state, RAY_ADDRESS)
        return "" if value is None else text(value)

    def set_ray_address(self, address: str) -> None:
        self.client.hset(self.keys.state, RAY_ADDRESS, address)

    def clear_ray_address(self, address: str) -> None:
        """Forget the recorded address if it is still ``address`` (not a newer cluster's)."""
        if self.ray_address() == address:
            self.client.hdel(self.keys.state, RAY_ADDRESS)

    def publish(self, type_: str, model_step: int | None = None, uri: str = "") -> str:
        """Append an event; a weight sync also sets the run's model_step, and pause /
        resume the run's paused flag, in the same transaction."""
        pipe = self.client.pipeline(transaction=True)
        if type_ == WEIGHT_SYNC:
            if model_step is None:
                raise ValueError("a weight_sync event needs its model_step")
            pipe.hset(self.keys.state, MODEL_STEP, model_step)
        elif type_ == PAUSE:
            pipe.hset(self.keys.state, PAUSED, "1")
        elif type_ == RESUME:
            pipe.hdel(self.keys.state, PAUSED)
        fields = {
            "type": type_,
            "model_step": -1 if model_step is None else model_step,
            "uri": uri,
            "ts": time.time(),
            "format": FORMAT_VERSION,
        }
        pipe.xadd(self.keys.events, fields, maxlen=EVENTS_CAP, approximate=True)  # type: ignore[arg-type]
        return text(pipe.execute()[-1])

    def last_event_id(self) -> str:
        """Where a new follower starts: after everything already there."""
        last = self.client.xrevrange(self.keys.events, count=1)
        return text(last[0][0]) if last else "0-0"

    def events(self, after: str, block_ms: int = 0, count: int = 100) -> list[Event]:
        """The events after ``after``. A malformed one is skipped with one warning naming
        its id and field: the stream has no consumer group to dead-letter it from, and
        one bad event must neither stop a follower nor stall it."""
        start = self._skip_to.get(after, after)
        reply: Any = self.client.xread({self.keys.events: start}, count=count, block=block_ms or None)
        out, last = [], start
        for _, items in reply or []:
            for entry_id, fields in items:
                check_format(fields.get(b"format"), f"event {text(entry_id)}")
                last = text(entry_id)
                event = self._event(last, fields)
                if event is not None:
                    out.append(event)
        if last != (out[-1].id if out else start):
            # Malformed events came last: the caller's cursor stops before them, so remember
            # where to go on from, or each call would read them (and warn) again.
            self._skip_to[out[-1].id if out else after] = last
            if len(self._skip_to) > 64:
                self._skip_to.pop(next(iter(self._skip_to)), None)
        return out

    def _event(self, entry_id: str, fields: dict[bytes, Any]) -> Event | None:
        key = self.keys.events
        try:
            texts = []
            for name in ("type", "uri"):
                value = fields.get(name.encode(), b"")
                try:
                    texts.append(text(value))
                except UnicodeDecodeError:
                    raise CorruptValueError(key, name, repr(value), "text") from None
            type_, uri = texts
            # -1: an event that is not a weight sync. Steps are bounded as in the state hash.
            step = fields.get(b"model_step", b"-1")
            model_step = stored_int(step, key, "model_step", "a step number", -1, MAX_STEP)
            if type_ == WEIGHT_SYNC and model_step < 0:
                raise CorruptValueError(key, "model_step", text(step), "the step a weight sync moves to")
            ts = stored_float(fields.get(b"ts"), key, "ts", "a time")
        except CorruptValueError as exc:
            log.warning("skipping malformed event %s: %s", entry_id, exc)
            return None
        return Event(id=entry_id, type=type_, model_step=model_step, uri=uri, ts=ts)

    def heartbeat(self, producer: str, model_step: int, inflight: int) -> None:
        beat = {"model_step": model_step, "inflight": inflight, "ts": time.time()}
        self.client.hset(self.keys.state, producer_beat_field(producer), orjson.dumps(beat))

    def forget(self, producer: str) -> None:
        self.client.hdel(self.keys.state, producer_beat_field(producer))

    def producers(self, max_age_s: float) -> list[Heartbeat]:
        """Producers whose last heartbeat is younger than ``max_age_s``; older ones are
        removed from the state as dead."""
        now = time.time()
        live, dead = [], []
        for name, raw in self.client.hgetall(self.keys.state).items():
            key = text(name)
            if not key.startswith(PRODUCER_BEAT):
                continue
            try:
                beat = orjson.loads(raw)
                heartbeat = Heartbeat(
                    key[len(PRODUCER_BEAT) :],
                    int(beat["model_step"]),
                    int(beat["inflight"]),
                    float(beat["ts"]),
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                log.warning("removing an unreadable heartbeat %s of %s: %r", key, self.keys.state, raw[:100])
                dead.append(key)
                continue
            if now - heartbeat.ts > max_age_s:
                dead.append(key)
            else:
                live.append(heartbeat)
        if dead:
            self.client.hdel(self.keys.state, *dead)
        return sorted(live, key=lambda b: b.producer)


class EventFollower:
    """Calls ``handle`` for each event of the run from a daemon thread, from the event
    after ``after`` on (take it with ``last_event_id`` before reading the state). A
    Redis outage is logged and waited out; an exception in ``handle`` is logged and
    ends the process's run through ``on_error``: a silent dead follower would leave a
    process that no longer syncs weights or stops."""

    def __init__(
        self,
        control: RunControl,
        after: str,
        handle: Callable[[Event], None],
        on_error: Callable[[BaseException], None],
        block_ms: int = 500,
    ) -> None:
        self.control = control
        self.after = after
        self.handle = handle
        self.on_error = on_error
        self.block_ms = block_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)

    def start(self) -> EventFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # a daemon thread: a read that is still retrying must not hold up a stopping process
            self._thread.join(timeout=self.block_ms / 1000 + 0.5)

    def _run(self) -> None:
        outage = False
        while not self._stop.is_set():
            try:
                events = self.control.events(self.after, self.block_ms)
            except redis.RedisError as exc:
                if not outage:
                    log.warning("cannot read the run's events, retrying: %s", exc)
                outage = True
                self._stop.wait(1.0)
                continue
            if outage:
                log.info("reading the run's events again")
                outage = False
            for event in events:
                self.after = event.id
                try:
                    self.handle(event)
                except Exception as exc:
                    log.exception("handling event %s (%s) failed", event.id, event.type)
                    self.on_error(exc)
                    return
