"""What every long-running process of a run does around its own work.

A process manager (honcho, systemd, Kubernetes) starts every process of a run at
once and stops them with SIGTERM, so each one:

1. logs one start line: role, run, Redis URL (never the password), what matters;
2. waits for Redis with back-off, a warning every few seconds, up to
   process.wait_timeout_s;
3. agrees with the run's published settings, or refuses to start;
4. keeps a heartbeat key that expires by itself (``rollstream status``);
5. follows the run's events from the moment before it read any state: a stop
   event ends it like SIGTERM does, other events go to the process's handler;
6. on its way out removes its heartbeat and stops following.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis

from rollstream.shared import telemetry
from rollstream.shared.buffer_types import default_consumer_name
from rollstream.shared.connection import STOPPING, stop_over, wait_for_redis
from rollstream.shared.errors import RollstreamError, RunLost
from rollstream.shared.events import STOP, Event, EventFollower, RunControl, remember_run
from rollstream.shared.keys import ROLES, Keys
from rollstream.shared.liveness import Heartbeat, Liveness, live_processes
from rollstream.shared.runconfig import check_run_identity, check_run_settings, run_identity
from rollstream.shared.settings import ProcessSettings, Settings
from rollstream.shared.settings_errors import redact_url
from rollstream.shared.waiting import NotYet, wait_until

log = logging.getLogger("rollstream")


class ProcessFailed(RollstreamError):
    """A background part of a process (its event follower) failed: the process stops."""


@dataclass(slots=True)
class Process:
    """A running process of the run: who it is, its connection and control, and the few
    values of the tree its life uses (the commands keep the tree itself)."""

    run: str
    redis_url: str  # as configured: redact_url() it before it is shown
    timeouts: ProcessSettings  # stop_timeout_s, wait_timeout_s
    role: str
    name: str
    stop: threading.Event
    client: redis.Redis
    control: RunControl
    liveness: Liveness
    errors: list[BaseException] = field(default_factory=list)
    run_stopped: bool = False  # the run's stop event ended it (not a signal)
    run_id: str = ""  # the run's identity in Redis, as this process found it at its start

    @property
    def keys(self) -> Keys:
        return self.control.keys


class StopSignal(threading.Event):
    """Set by the first SIGTERM / SIGINT: a warm stop (finish in-flight work for a grace,
    hand back what is left). A second signal sets ``cold`` as well: stop at once, handing
    every claim back without waiting, as rq and Celery workers do."""

    def __init__(self) -> None:
        super().__init__()
        self.cold = threading.Event()
        self.signals: list[str] = []  # the signals received, in order


def cold_stop(stop: threading.Event) -> threading.Event | None:
    """The cold-stop flag of a stop event made by ``stop_on_signals`` (None otherwise)."""
    return getattr(stop, "cold", None)


_SIGNAL_PIPES: weakref.WeakKeyDictionary[threading.Event, int] = weakref.WeakKeyDictionary()


def stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """SIGTERM and SIGINT set the event: a process finishes what it is doing and exits; a
    second signal makes it a cold stop (see StopSignal). Call it again with the same event
    after ``ray.init``, which installs handlers of its own.

    The handler only writes the signal's number to a pipe; a thread of its own reads it
    and acts (logs, sets the events). A handler runs in the main thread between two of its
    bytecodes, maybe while that thread holds an event's lock (inside ``stop.wait()``,
    ``STOPPING.set()``, or the handler of a signal that came just before, as a second
    SIGTERM right after the first does): an ``Event.set()`` there waited for ever on a lock
    its own thread held, and the process hung instead of stopping."""
    stop = stop or StopSignal()
    write = _SIGNAL_PIPES.get(stop)
    if write is None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        _SIGNAL_PIPES[stop] = write
        relay = threading.Thread(
            target=_relay_signals, args=(read, _on_signal(stop)), name="signals", daemon=True
        )
        relay.start()

    def handler(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):  # a full pipe holds signals enough already
            os.write(write, bytes([signum]))

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _on_signal(stop: threading.Event) -> Callable[[int], None]:
    """What a signal does to ``stop``, in the relay thread."""
    cold = cold_stop(stop)
    received = getattr(stop, "signals", None)

    def act(signum: int) -> None:
        name = signal.Signals(signum).name
        # the second *signal* is a cold stop: a stop that the run's stop event began is
        # still warm when the process manager's SIGTERM follows
        if received is None or not received:
            log.info("%s received: stopping (a second one stops at once)", name)
        elif cold is not None and not cold.is_set():
            log.warning("%s received again: cold stop, handing back what is in flight now", name)
            cold.set()
        if received is not None:
            received.append(name)
        STOPPING.set()  # a process manager stops Redis too: outages are not ridden out now
        stop.set()

    return act


def _relay_signals(read: int, act: Callable[[int], None]) -> None:
    """The signals' thread: each signal number written by the handler, acted on in order."""
    while True:
        try:
            data = os.read(read, 64)
        except OSError as exc:  # never silent: a process that cannot hear SIGTERM says so
            log.error("the signal relay stopped (%s): SIGTERM no longer stops this process", exc)
            return
        if not data:  # the write end closed: nothing can signal through it any more
            return
        for signum in data:
            try:
                act(signum)
            except Exception:  # a failure to log must not deafen the process to the next signal
                log.exception("acting on signal %d failed", signum)


def wait_until_gone(process: Process, roles: tuple[str, ...]) -> None:
    """Wait until no other process of ``roles`` keeps a heartbeat, up to stop_timeout_s."""
    deadline = time.monotonic() + process.timeouts.stop_timeout_s
    shown = time.monotonic()
    while time.monotonic() < deadline:
        try:
            others = [
                p for p in live_processes(process.client, process.keys)
                if p.role in roles and p.name != process.name
            ]  # fmt: skip
        except redis.RedisError as exc:
            log.warning("%s: cannot see who is still running (%s); going on", process.role, exc)
            return
        if not others:
            return
        if time.monotonic() - shown >= 1.0:
            shown = time.monotonic()
            log.info(
                "%s: waiting for %s to stop", process.role, ", ".join(f"{p.role} {p.name}" for p in others)
            )
        time.sleep(0.1)
    log.warning("%s: others still running after %.0f s; going on", process.role,
                process.timeouts.stop_timeout_s)  # fmt: skip


def start_line(role: str, settings: Settings, **extra: Any) -> None:
    """The one line that says who started where: never a secret in it."""
    parts = [f"run {settings.run!r}", f"Redis {redact_url(settings.redis.url)}"]
    parts += [f"{k} {v}" for k, v in extra.items()]
    log.info("%s starting: %s", role, ", ".join(parts))


@contextmanager
def running(settings: Settings, role: str, stop: threading.Event, **options: Any) -> Iterator[Process | None]:
    """The process's life around its work (``_running``), with its Prometheus metrics served
    meanwhile on metrics.port or $PORT (shared/telemetry.py); the same options."""
    with (
        telemetry.serving(settings.metrics, settings.run, role),
        _running(settings, role, stop, **options) as process,
    ):
        yield process


def _join_run(
    client: redis.Redis,
    keys: Keys,
    settings: Settings,
    name: str,
    known: str | None,
    known_by: str,
    stop: threading.Event,
) -> str | None:
    """The run's id, its settings checked (or published: the run's first process). A
    process whose ACL user may not write the run's state (metrics: deploy/redis/acl.sh)
    cannot be that first process: it waits for another to make the run (up to
    process.wait_timeout_s), or for ``stop`` (None)."""

    # the settings stay out of the probe that shared/waiting.py calls back (the settings
    # object never climbs the layers: tools/settings_trace.py)
    url = settings.redis.url
    publish = functools.partial(check_run_settings, client, keys, settings, name)

    def joined() -> str:
        try:
            run_id = run_identity(client, keys, url, known, known_by)
            if publish():
                log.info("published the run's shared settings (rollout, tasks)")
        except redis.exceptions.NoPermissionError as exc:
            raise NotYet(
                f"this Redis user may not make the run ({exc}): a feeder, producer or trainer does"
            ) from None
        return run_id

    return wait_until(joined, f"run {keys.run!r} to be made", settings.process.wait_timeout_s, stop)


@contextmanager
def _running(
    settings: Settings,
    role: str,
    stop: threading.Event,
    *,
    name: str | None = None,
    detail: Callable[[], dict[str, Any]] | None = None,
    on_event: Callable[[Event], None] | None = None,
    heartbeat: bool = True,
    follow: bool = True,
    known_run: tuple[str, str] | None = None,
    refuse_stopped: bool = True,
    **start_info: Any,
) -> Iterator[Process | None]:
    """The process's life around its work; yields None when ``stop`` is set while it
    still waits for Redis. A failure of the event follower stops the process and is
    raised as ProcessFailed on the way out.

    The process checks the run's identity (its ``run_id`` in the state hash) at its
    start and every second after: a run that Redis lost (emptied, restarted without its
    data) stops it with RunLost, and so does an error in its work while the run is gone
    (a NOGROUP of a stream that went with it). ``known_run``: the run id a record of its
    own says the run had, and which record, so that even at the start a Redis that came
    back empty is not taken for a new run. Redis gone while a signal stops the process
    (a process manager stopping Redis too) is said, and the stop is clean: exit 0.

    A run that was stopped already (its stop event published before this process
    started) is not worked on: it says so and yields None, as for a stop while waiting
    (exit 0, so that a supervisor that restarts on failure leaves it down), unless
    ``refuse_stopped`` is False (the metrics and archive processes, which only read)."""
    name = name or default_consumer_name(role)
    start_line(role, settings, name=name, **start_info)
    client = wait_for_redis(settings.redis, settings.process.wait_timeout_s, stop)
    if client is None:
        yield None
        return
    keys = Keys(settings.run)
    known, known_by = known_run or (None, "")
    run_id = _join_run(client, keys, settings, name, known, known_by, stop)
    if run_id is None:
        yield None
        return
    remember_run(client, keys.run, run_id)
    control = RunControl(client, keys)
    if refuse_stopped and (why := run_stopped(control, role, name)):
        # a process manager restarting what exited on the stop (a Deployment), or a process
        # started late: the stop event is behind it, and it would work on a finished run
        log.warning("%s and exits", why)
        yield None
        return
    after = control.last_event_id()  # before the caller reads any state: nothing is missed
    process = Process(
        settings.run, settings.redis.url, settings.process, role, name, stop, client, control,
        Liveness(client, keys, role, name, settings.process.liveness_ttl_s), run_id=run_id,
    )  # fmt: skip

    def handle(event: Event) -> None:
        if event.type == STOP:
            log.info("run %r stopped (event %s): %s %s stops", settings.run, event.id, role, name)
            process.run_stopped = True
            STOPPING.set()  # the whole formation stops, Redis with it: outages are not ridden out now
            stop.set()
        elif on_event is not None:
            on_event(event)

    def failed(exc: BaseException) -> None:
        process.errors.append(exc)
        stop.set()

    follower = EventFollower(control, after, handle, failed).start() if follow else None
    beat = Heartbeat(process.liveness, detail).start() if heartbeat else None
    ended = threading.Event()  # the process's life is over: the identity watch ends with it
    watch = threading.Thread(
        target=_watch_run, args=(process, failed, ended), name="run-identity", daemon=True
    )
    watch.start()
    try:
        yield process
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        signals: list[str] = getattr(stop, "signals", None) or []
        if not signals:
            raise
        # a process manager stopping everything may stop Redis first: the signal's stop is
        # done (exit 0), and what this process still held stays pending in Redis' data
        log.warning("Redis at %s went away while %s %s stopped on %s (%s): what it still held "
                    "stays pending there, taken back after buffer.claim_idle_ms once Redis is back",
                    redact_url(settings.redis.url), role, name, signals[0], exc)  # fmt: skip
    except Exception as exc:
        lost = _run_lost(process)  # an error because the run is gone says so, once
        if lost is not None:
            raise lost from exc
        raise
    finally:
        STOPPING.set()
        ended.set()
        if follower is not None:
            follower.stop()
        if beat is not None:
            beat.stop()
        with contextlib.suppress(redis.RedisError):
            process.liveness.clear()
    try:
        if process.run_stopped:
            # A process manager ends the whole formation, Redis included, when the first
            # process exits: leave only once every process of the run has finished its own
            # clean stop (its heartbeat key is gone), so that none loses Redis half-way.
            wait_until_gone(process, ROLES)
    finally:
        # this process's stop is over: a later client in the same interpreter (a test, the
        # demo's next part) rides out outages again
        stop_over()
    if process.errors:
        if isinstance(process.errors[0], RunLost):
            raise process.errors[0]
        raise ProcessFailed(f"{role} {name} stopped: {process.errors[0]!r}")


def run_stopped(control: RunControl, role: str, name: str) -> str:
    """Why ``role`` ``name`` will not work on the run ("" while the run goes on): its stop
    event was published before the process started."""
    stopped = control.stopped()
    if stopped is None:
        return ""
    at = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(stopped))
    return (
        f"run {control.keys.run!r} was stopped at {at} (its stop event): {role} {name} will not work "
        "on it; `rollstream resume` lets the run go on, and a new run needs a new run name (run, "
        "ROLLSTREAM_RUN)"
    )


WATCH_RUN_S = 1.0


def _run_lost(process: Process) -> RunLost | None:
    """RunLost when Redis no longer holds the run this process started in, else None."""
    if process.errors and isinstance(process.errors[0], RunLost):
        return process.errors[0]
    try:
        check_run_identity(
            process.client, process.keys, process.redis_url, process.run_id,
            f"{process.role} {process.name}",
        )  # fmt: skip
    except RunLost as exc:
        return exc
    except redis.RedisError:
        return None  # Redis itself is away: the process's own errors say so
    return None


def _watch_run(process: Process, failed: Callable[[BaseException], None], ended: threading.Event) -> None:
    """Every WATCH_RUN_S, the run's identity: a run that Redis lost stops the process with
    one error, instead of a feeder dying on NOGROUP, a producer claiming nothing for ever
    or a trainer waiting in silence. It ends with the process's life (``ended``): a command
    that returned on its own (a burst producer, an in-process caller) leaves no thread
    behind that asks a Redis it no longer uses."""
    while not ended.wait(WATCH_RUN_S) and not process.stop.is_set():
        lost = _run_lost(process)
        if lost is not None:  # said once, by the command's exit
            failed(lost)
            return
