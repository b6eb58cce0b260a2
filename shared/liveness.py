"""Who is alive in a run: every process keeps a heartbeat key that expires by itself.

    rs:{run}:alive:{role}:{name}   JSON {role, name, host, pid, started, ts, ...detail}
                                   SET with PX = process.liveness_ttl_s

A process renews its key every third of the TTL (a producer every producer.heartbeat_s,
with its status and claims on the same beat: ``Heartbeat``); one that dies (kill -9, a lost
machine) drops out of ``rollstream status`` when the key expires, with nothing to
clean up. A clean stop deletes the key at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import redis

from rollstream.shared.keys import Keys
from rollstream.shared.redis_cluster import scan_run
from rollstream.shared.streams import text

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ProcessBeat:
    role: str
    name: str
    host: str
    pid: int
    started: float
    ts: float
    age_s: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Liveness:
    """The heartbeat key of one process."""

    def __init__(self, client: redis.Redis, keys: Keys, role: str, name: str, ttl_s: float) -> None:
        self.client = client
        self.key = keys.alive(role, name)
        self.role = role
        self.name = name
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.started = time.time()

    def beat(self, **detail: Any) -> None:
        body = {
            "role": self.role,
            "name": self.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self.started,
            "ts": time.time(),
            "detail": detail,
        }
        self.client.set(self.key, orjson.dumps(body, default=str), px=self.ttl_ms)

    def clear(self) -> None:
        self.client.delete(self.key)


class Heartbeat:
    """A process's heartbeat, the one there is: a daemon thread that renews the process's
    liveness key (when it has one) with what ``detail`` returns, every ``every_s``
    (default: a third of the key's TTL). ``also`` runs first in each beat: a producer
    renews its status in the run's state (events.ProducerStatus) and the claims it holds
    there, on the same beat. By default a beat that Redis fails is logged once, not per
    beat, and the thread beats on; with ``on_failure``, a beat that raises ends the
    thread and is handed to it (a producer stops rather than go on without liveness),
    and ``beat`` raises too."""

    def __init__(
        self,
        liveness: Liveness | None,
        detail: Callable[[], dict[str, Any]] | None = None,
        *,
        every_s: float | None = None,
        also: Callable[[], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        name: str = "",
    ) -> None:
        if every_s is None:
            if liveness is None:
                raise ValueError("a heartbeat without a liveness key needs every_s")
            every_s = liveness.ttl_ms / 3000
        self.liveness = liveness
        self.detail = detail or dict
        self.every_s = every_s
        self.also = also
        self.on_failure = on_failure
        self.who = name or (f"{liveness.role} {liveness.name}" if liveness is not None else "process")
        self._stop = threading.Event()
        thread = f"heartbeat-{liveness.role}" if liveness is not None and not name else f"heartbeat-{name}"
        self._thread = threading.Thread(target=self._run, name=thread, daemon=True)

    def start(self) -> Heartbeat:
        """One beat now, then one every ``every_s`` in the thread (none once stopped)."""
        if self._stop.is_set():
            return self
        self.beat()
        self._thread.start()
        return self

    def beat(self, *, quiet: bool = False) -> bool:
        """One beat: ``also``, then the liveness key. False when Redis failed it (said
        unless ``quiet``); with ``on_failure`` set, whatever failed it is raised instead."""
        detail: dict[str, Any] = {}
        if self.liveness is not None:
            try:
                detail = self.detail()
            except Exception as exc:
                # the key says the process lives; a detail that cannot be had must not stop it
                # (a dead heartbeat thread lets the key expire under a live process)
                log.warning("heartbeat detail of %s failed: %s", self.who, exc)
        try:
            if self.also is not None:
                self.also()
            if self.liveness is not None:
                self.liveness.beat(**detail)
        except redis.RedisError as exc:
            if self.on_failure is not None:
                raise
            if not quiet:
                log.warning("heartbeat of %s failed: %s", self.who, exc)
            return False
        return True

    def _run(self) -> None:
        healthy = True
        try:
            while not self._stop.wait(self.every_s):
                ok = self.beat(quiet=not healthy)
                if ok and not healthy:
                    log.info("heartbeat of %s renewed again", self.who)
                healthy = ok
        except BaseException as exc:
            if self.on_failure is None:
                raise
            self.on_failure(exc)

    def stop(self, *, clear: bool = True, wait_s: float = 5.0) -> None:
        """Stop beating, waiting up to ``wait_s`` for a beat under way, so that none lands
        after the stop; then (``clear``) delete the key: the process leaves the run's
        status now. A process whose key another part of it clears passes ``clear=False``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=wait_s)
        if not clear or self.liveness is None:
            return
        try:
            self.liveness.clear()
        except redis.RedisError as exc:
            log.warning("could not remove the heartbeat key %s: %s", self.liveness.key, exc)


def live_processes(client: redis.Redis, keys: Keys) -> list[ProcessBeat]:
    """Every process whose heartbeat key has not expired, by role and name."""
    names = sorted(text(k) for k in scan_run(client, keys.state, keys.alive_pattern, 1000))
    if not names:
        return []
    now = time.time()
    beats = []
    for raw in client.mget(names):
        if raw is None:  # expired between SCAN and MGET
            continue
        try:
            body = orjson.loads(raw)
            beat = ProcessBeat(
                role=str(body["role"]),
                name=str(body["name"]),
                host=str(body.get("host", "")),
                pid=int(body.get("pid", 0)),
                started=float(body.get("started", 0.0)),
                ts=float(body["ts"]),
                detail=dict(body.get("detail") or {}),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("ignoring an unreadable heartbeat: %r", raw[:200])
            continue
        beat.age_s = round(max(0.0, now - beat.ts), 3)
        beats.append(beat)
    return sorted(beats, key=lambda b: (b.role, b.name))
