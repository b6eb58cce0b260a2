"""A producer notices that the run's engines moved to another Ray cluster (the engines
process restarted) and stops, so that its supervisor restarts it there."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import fakeredis

from rollstream.cli.produce import _watch_ray_address
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from tests.helpers import wait_for


def test_a_new_ray_address_stops_the_producer() -> None:
    control = RunControl(fakeredis.FakeRedis(), Keys("r1"))
    control.set_ray_address("10.0.0.1:6380")
    stop, moved = threading.Event(), threading.Event()
    process = SimpleNamespace(control=control)
    watcher = threading.Thread(target=_watch_ray_address, args=(process, "10.0.0.1:6380", stop, moved))
    watcher.start()
    try:
        control.clear_ray_address("10.0.0.1:6380")  # the engines stopped: not a move
        control.set_ray_address("10.0.0.2:6380")  # a new engines process, a new cluster
        wait_for(moved.is_set, timeout=10)
        assert stop.is_set()
    finally:
        stop.set()
        watcher.join(timeout=5)
