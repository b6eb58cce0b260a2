"""What the tests know of the Redis exporter (oliver006/redis_exporter, Debian's
prometheus-redis-exporter package) that every layout runs beside Redis: the names and
labels of the series the alert rules and the dashboard use. The unit tests check the rules
and the dashboard against these; tests/integration/test_redis_exporter.py checks these
against what the real exporter serves for a primary and its replica, so a name written
from memory fails there, not in production."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from rollstream.shared.embedded import free_port
from tests.conftest import CI
from tests.helpers import wait_for

# name -> the labels of its own (beyond job and instance) that the exporter gives it
EXPORTER_METRICS: dict[str, frozenset[str]] = {
    "redis_up": frozenset(),
    "redis_memory_used_bytes": frozenset(),
    "redis_memory_max_bytes": frozenset(),
    "redis_connected_clients": frozenset(),
    "redis_commands_processed_total": frozenset(),
    "redis_db_keys": frozenset({"db"}),
    "redis_aof_enabled": frozenset(),
    "redis_aof_last_write_status": frozenset(),
    "redis_aof_last_bgrewrite_status": frozenset(),
    "redis_connected_slaves": frozenset(),
    "redis_master_repl_offset": frozenset(),
    # on a primary, one per replica
    "redis_connected_slave_offset_bytes": frozenset({"slave_ip", "slave_port", "slave_state"}),
    # on a replica
    "redis_master_link_up": frozenset({"master_host", "master_port"}),
    "redis_slave_repl_offset": frozenset({"master_host", "master_port"}),
}
# served only by a replica (its link to the primary) or only by a primary with a replica
ON_REPLICA = frozenset({"redis_master_link_up", "redis_slave_repl_offset"})
ON_PRIMARY_WITH_REPLICA = frozenset({"redis_connected_slave_offset_bytes"})
EXPORTER_LABELS = frozenset().union(*EXPORTER_METRICS.values())
DEFAULT_PORT = 9121  # the exporter's own default, and every layout's


def exporter_binary() -> str:
    found = shutil.which("prometheus-redis-exporter")
    if found is None:
        if CI:
            raise RuntimeError("no prometheus-redis-exporter: CI installs Debian's package (make test does)")
        pytest.skip("no prometheus-redis-exporter (apt-get install prometheus-redis-exporter)")
    return found


class Exporter:
    """A Redis exporter of the test's own, for one Redis, on a free port, given the
    password through its environment as every layout gives it; stopped by its handle
    (SIGTERM)."""

    def __init__(self, redis_url: str, log: Path, password: str = "", user: str = "") -> None:
        self.port = free_port()
        self.log = log.open("wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_")}
        env.update({k: v for k, v in (("REDIS_PASSWORD", password), ("REDIS_USER", user)) if v})
        self.proc = subprocess.Popen(
            [exporter_binary(), f"-redis.addr={redis_url}", f"-web.listen-address=127.0.0.1:{self.port}"],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        wait_for(self.serving, 60, 0.2)

    def serving(self) -> bool:
        """Its port answers /metrics (it listens some moments after it starts)."""
        try:
            self.scrape()
        except OSError:
            return False
        return True

    def scrape(self) -> str:
        assert self.proc.poll() is None, "the exporter exited: see its log"
        with urllib.request.urlopen(self.url, timeout=10) as reply:
            return str(reply.read().decode())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
