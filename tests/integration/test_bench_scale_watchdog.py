"""bench/scale.py's watchdog: a producer that dies ends the benchmark, and takes the other
producers and the benchmark's redis-server with it (before, the redis-server was left
running after the exit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for

# a benchmark at smoke size: the heavy tier (make test-all and CI), so that make test answers in minutes
pytestmark = [pytest.mark.integration, pytest.mark.heavy]

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import threading

sys.path.insert(0, "bench")
import scale
from rollstream.shared.embedded import EmbeddedRedis


class DeadProducer:
    def check(self):
        raise RuntimeError("producer pid 1 exited 1: a test's death")

    def stop(self, timeout_s=20.0):
        print("producers stopped", flush=True)


server = EmbeddedRedis().start()
scale.SERVER.append(server)
print("redis-server", server.pid, flush=True)
scale._watch(DeadProducer(), threading.Event())
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_watchdog_stops_the_producers_and_the_redis_server_when_a_producer_dies() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "a test's death" in done.stdout
    assert "producers stopped" in lines
    pid = int(next(line for line in lines if line.startswith("redis-server")).split()[1])
    wait_for(lambda: not alive(pid), timeout=10)
