"""Warm then cold stop: the first SIGTERM is a warm stop, a second one a cold stop; a
stop that the run's stop event began stays warm when the process manager's SIGTERM
follows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from rollstream.cli.process import StopSignal, cold_stop, stop_on_signals
from rollstream.shared.connection import STOPPING
from tests.helpers import wait_for


@pytest.fixture
def handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
    STOPPING.clear()


def test_a_second_signal_is_a_cold_stop(handlers: None) -> None:
    stop = stop_on_signals()
    cold = cold_stop(stop)
    assert isinstance(stop, StopSignal) and cold is not None
    os.kill(os.getpid(), signal.SIGTERM)
    wait_for(stop.is_set, timeout=5)
    assert not cold.is_set()
    os.kill(os.getpid(), signal.SIGINT)
    wait_for(cold.is_set, timeout=5)


def test_a_stop_begun_by_the_run_stays_warm_at_the_first_signal(handlers: None) -> None:
    stop = stop_on_signals()
    assert isinstance(stop, StopSignal)
    stop.set()  # what the run's stop event does
    os.kill(os.getpid(), signal.SIGTERM)
    wait_for(lambda: stop.signals == ["SIGTERM"], timeout=5)
    assert not stop.cold.is_set()


# The main thread holds a stop event's lock (inside stop.wait() or STOPPING.set(), or the
# handler of a signal that came just before) when a signal lands: its handler runs right
# there, between two bytecodes of that thread.
HELD_LOCK = """
import os, signal, sys
from rollstream.cli.process import stop_on_signals
from rollstream.shared.connection import STOPPING
stop = stop_on_signals()
with {lock}:
    os.kill(os.getpid(), signal.SIG{signal})
    for _ in range(100_000):
        pass
print("stopped" if stop.wait(10) and STOPPING.is_set() else "not stopped", flush=True)
"""


@pytest.mark.parametrize(
    ("lock", "signum"), [("stop._cond", "TERM"), ("STOPPING._cond", "TERM"), ("STOPPING._cond", "INT")]
)
def test_a_signal_that_lands_while_the_main_thread_holds_a_stop_events_lock_stops_it(
    lock: str, signum: str
) -> None:
    script = HELD_LOCK.format(lock=lock, signal=signum)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process deadlocked in its signal handler ({lock} held)")
    assert done.stdout.strip() == "stopped", done.stderr[-2000:]
