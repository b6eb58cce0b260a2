"""Who is alive in a run: every process keeps a heartbeat key that expires by itself.

    rs:{run}:alive:{role}:{name}   JSON {role, name, host, pid, started, ts, ...detail}
                                   SET with PX = process.liveness_ttl_s

A process renews its key every third of the TTL; one that dies (kill -9, a lost
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
    """Renews a process's liveness key from a daemon thread, every third of its TTL,
    with what ``detail`` returns; a Redis outage is logged once, not per beat."""

    def __init__(self, liveness: Liveness, detail: Callable[[], dict[str, Any]] | None = None) -> None:
        self.liveness = liveness
        self.detail = detail or dict
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{liveness.role}", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self, *, quiet: bool = False) -> bool:
        try:
            detail = self.detail()
        except Exception as exc:
            # the key says the process lives; a detail that cannot be had must not stop it
            # (a dead heartbeat thread lets the key expire under a live process)
            log.warning("heartbeat detail of %s %s failed: %s", self.liveness.role, self.liveness.name, exc)
            detail = {}
        try:
            self.liveness.beat(**detail)
        except redis.RedisError as exc:
            if not quiet:
                log.warning("heartbeat of %s %s failed: %s", self.liveness.role, self.liveness.name, exc)
            return False
        return True

    def _run(self) -> None:
        period = self.liveness.ttl_ms / 3000
        healthy = True
        while not self._stop.wait(period):
            ok = self.beat(quiet=not healthy)
            if ok and not healthy:
                log.info("heartbeat of %s %s renewed again", self.liveness.role, self.liveness.name)
            healthy = ok

    def stop(self) -> None:
        """Stop renewing and delete the key: the process leaves the run's status now."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.liveness.clear()
        except redis.RedisError as exc:
            log.warning("could not remove the heartbeat key %s: %s", self.liveness.key, exc)


def live_processes(client: redis.Redis, keys: Keys) -> list[ProcessBeat]:
    """Every process whose heartbeat key has not expired, by role and name."""
    names = sorted(text(k) for k in client.scan_iter(match=keys.alive_pattern, count=1000))
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
