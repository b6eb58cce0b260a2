"""The run's control plane: its state hash (model_step, train_step, each producer's
status) and its events stream (weight syncs and control events).

    rs:{run}:state    model_step, train_step, paused, ray_address,
                      producer:{id} -> status JSON {model_step, inflight, ts}, which the
                      producer's heartbeat (shared/liveness.py Heartbeat) renews
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
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from rollstream.shared import rewind
from rollstream.shared.codec import FORMAT_VERSION, check_format
from rollstream.shared.errors import CorruptValueError, RollstreamError, RunLost
from rollstream.shared.keys import (
    MODEL_STEP,
    PAUSED,
    PRODUCER_BEAT,
    RAY_ADDRESS,
    STOPPED,
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
# ARGV: field, step, the run id this process knows ('' none), the last step this process
# recorded ('' none). -1: another run; -2 - current: the state is behind that last step
# (Redis lost a commit: shared/rewind.py); 0: recorded (or a later step already was).
_ADVANCE = """
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'run_id') ~= ARGV[3] then return -1 end
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') or 0
if ARGV[4] ~= '' and current < tonumber(ARGV[4]) then return -2 - current end
if tonumber(ARGV[2]) > current then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 0
"""
# The run id a process found at its start, per client (cli/process.py remembers it): a
# step recorded on that client is refused once the state no longer holds that run, so
# that a trainer committing as Redis comes back empty writes nothing into the new state.
_KNOWN_RUNS: weakref.WeakKeyDictionary[redis.Redis, dict[str, str]] = weakref.WeakKeyDictionary()


def remember_run(client: redis.Redis, run: str, run_id: str) -> None:
    """Steps recorded through ``client`` for ``run`` from now on require its ``run_id``."""
    _KNOWN_RUNS.setdefault(client, {})[run] = run_id


# KEYS: state hash, events stream. ARGV: new model_step, "1" to allow a rollback, events cap,
# then the event's field, value, ... The run's model_step is set and the weight-sync event
# appended together, only when the step does not move backwards (or a rollback is asked):
# {'ok', event id}, {'behind', current step}, or {'corrupt', the stored value}.
_WEIGHT_SYNC = """
local raw = redis.call('HGET', KEYS[1], 'model_step')
if raw and ARGV[2] ~= '1' then
    if not string.match(raw, '^%d+$') or string.len(raw) > 15 then return {'corrupt', raw} end
    if tonumber(ARGV[1]) < tonumber(raw) then return {'behind', raw} end
end
redis.call('HSET', KEYS[1], 'model_step', ARGV[1])
return {'ok', redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))}
"""
# KEYS: state hash. ARGV: field, model_step, inflight. A producer's status, stamped with
# the Redis server's clock: every reader compares it with that same clock, so a producer
# whose own clock is off is not taken for dead.
_STATUS = """
local clock = redis.call('TIME')
local ts = string.format('%d.%06d', tonumber(clock[1]), tonumber(clock[2]))
redis.call('HSET', KEYS[1], ARGV[1],
    '{"model_step":' .. ARGV[2] .. ',"inflight":' .. ARGV[3] .. ',"ts":' .. ts .. '}')
return 0
"""
REPAIR_MODEL_STEP = "rollstream steps --model-step N --yes"
log = logging.getLogger(__name__)


class StepBackwards(RollstreamError):
    """A weight sync to a model step below the run's: refused unless a rollback is asked."""


@dataclass(slots=True, frozen=True)
class Event:
    id: str
    type: str
    model_step: int
    uri: str
    ts: float


@dataclass(slots=True, frozen=True)
class ProducerStatus:
    """What a producer last published in the run's state: the model step its engines are
    on, its groups in flight, and when (``ts``, the Redis server's clock). Its heartbeat
    renews it; one older than the readers' bound is a dead producer's."""

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
        """The run's model step; CorruptValueError, naming the repair, if the state holds
        something else there."""
        return self._model_step(self.client.hget(self.keys.state, MODEL_STEP))

    def _model_step(self, raw: Any) -> int:
        try:
            return stored_step(raw, self.keys.state, MODEL_STEP)
        except CorruptValueError as exc:
            raise CorruptValueError(
                exc.key, exc.field, exc.value,
                f"a step number; repair it with `{REPAIR_MODEL_STEP}` (N: the step of the weights the "
                "trainer last published)",
            ) from None  # fmt: skip

    def train_step(self) -> int:
        """The last committed train step; CorruptValueError if the state holds something else."""
        return stored_step(self.client.hget(self.keys.state, TRAIN_STEP), self.keys.state, TRAIN_STEP)

    def advance_train_step(self, step: int, who: str = "this trainer", url: str = "Redis") -> None:
        """Record ``step`` as committed unless a later one already is; RunLost, writing
        nothing, when the run this process started in is no longer the state's, and
        RunRewound (the run marked) when the state is behind a step this process recorded
        before (Redis lost that commit: shared/rewind.py)."""
        known = _KNOWN_RUNS.get(self.client, {}).get(self.keys.run)
        previous = rewind.recorded_step(self.client, self.keys.run)
        args = (TRAIN_STEP, step, known or "", "" if previous is None else previous)
        answer = int(self.client.eval(_ADVANCE, 1, self.keys.state, *args))
        if answer == -1:
            raise RunLost(
                f"run {self.keys.run!r}: Redis no longer holds run id {known} ({self.keys.state} lost it): "
                f"train step {step} was not recorded"
            )
        if answer <= -2:
            assert previous is not None
            raise rewind.rewound(self.client, self.keys, url, who, -2 - answer, previous,
                                 f"train step {step} was not recorded")  # fmt: skip
        rewind.note_recorded(self.client, self.keys.run, step)

    def paused(self) -> bool:
        return self.client.hget(self.keys.state, PAUSED) == b"1"

    def stopped(self) -> float | None:
        """When the run's stop event was published (epoch seconds), None while it runs."""
        raw = self.client.hget(self.keys.state, STOPPED)
        return None if raw is None else stored_float(raw, self.keys.state, STOPPED, "epoch seconds")

    def ray_address(self) -> str:
        value = self.client.hget(self.keys.state, RAY_ADDRESS)
        return "" if value is None else text(value)

    def set_ray_address(self, address: str) -> None:
        self.client.hset(self.keys.state, RAY_ADDRESS, address)

    def clear_ray_address(self, address: str) -> None:
        """Forget the recorded address if it is still ``address`` (not a newer cluster's)."""
        if self.ray_address() == address:
            self.client.hdel(self.keys.state, RAY_ADDRESS)

    def publish(
        self, type_: str, model_step: int | None = None, uri: str = "", *, rollback: bool = False
    ) -> str:
        """Append an event; a weight sync also sets the run's model_step, and pause /
        resume the run's paused flag, in the same transaction. A weight sync to a step
        below the run's model_step raises StepBackwards and changes nothing: producers
        ignore it and later joiners would load older weights. A rollback is an operator's
        explicit act (``rollback=True``, ``rollstream steps --model-step N --yes``)."""
        fields: dict[str, str | int | float] = {
            "type": type_,
            "model_step": -1 if model_step is None else model_step,
            "uri": uri,
            "ts": time.time(),
            "format": FORMAT_VERSION,
        }
        if type_ == WEIGHT_SYNC:
            if model_step is None:
                raise ValueError("a weight_sync event needs its model_step")
            if not 0 <= model_step <= MAX_STEP:
                raise ValueError(f"model_step {model_step} is not a step number (0 ... {MAX_STEP})")
            flat: list[str | int | float] = [v for pair in fields.items() for v in pair]
            keys = (self.keys.state, self.keys.events)
            args: list[str | int | float] = [model_step, int(rollback), EVENTS_CAP, *flat]
            reply: Any = self.client.eval(_WEIGHT_SYNC, 2, *keys, *args)
            outcome, value = reply
            if outcome == b"corrupt":
                self._model_step(value)  # raises CorruptValueError naming the repair
            if outcome == b"behind":
                raise StepBackwards(
                    f"run {self.keys.run!r} is at model_step {text(value)}: a weight sync to step "
                    f"{model_step} would move it backwards (producers ignore it, engines that join "
                    "later would load older weights); nothing published. A rollback is an operator's "
                    f"act: `rollstream steps --model-step {model_step} --yes`, with every trainer stopped"
                )
            return text(value)
        pipe = self.client.pipeline(transaction=True)
        if type_ == PAUSE:
            pipe.hset(self.keys.state, PAUSED, "1")
        elif type_ == RESUME:  # and a stopped run goes on: an operator's act
            pipe.hdel(self.keys.state, PAUSED, STOPPED)
        elif type_ == STOP:  # kept in the state: the events stream is capped, and a process
            # that starts later reads only the events after the last one
            pipe.hset(self.keys.state, STOPPED, repr(fields["ts"]))
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

    def publish_status(self, producer: str, model_step: int, inflight: int) -> None:
        """Write a producer's status, its ``ts`` from the Redis server's clock (TIME)."""
        self.client.eval(_STATUS, 1, self.keys.state, producer_beat_field(producer), int(model_step),
                         int(inflight))  # fmt: skip

    def server_time(self) -> float:
        """The Redis server's clock (TIME): the one clock every process of the run shares."""
        seconds, micros = self.client.time()
        return seconds + micros / 1e6

    def forget(self, producer: str) -> None:
        self.client.hdel(self.keys.state, producer_beat_field(producer))

    def producers(self, max_age_s: float) -> list[ProducerStatus]:
        """Producers whose last status is younger than ``max_age_s``; older ones are
        removed from the state as dead. Ages are measured on the Redis server's clock,
        which stamps the statuses: a producer's own clock does not matter."""
        now = self.server_time()
        live, dead = [], []
        for name, raw in self.client.hgetall(self.keys.state).items():
            key = text(name)
            if not key.startswith(PRODUCER_BEAT):
                continue
            try:
                beat = orjson.loads(raw)
                status = ProducerStatus(
                    key[len(PRODUCER_BEAT) :],
                    int(beat["model_step"]),
                    int(beat["inflight"]),
                    float(beat["ts"]),
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                log.warning(
                    "removing an unreadable producer status %s of %s: %r", key, self.keys.state, raw[:100]
                )
                dead.append(key)
                continue
            if now - status.ts > max_age_s:
                dead.append(key)
            else:
                live.append(status)
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
