"""A process's stop is its own: once ``running`` has ended, a later client in the same
interpreter (a test, the demo's next part) rides out Redis outages again."""

from __future__ import annotations

import threading

import pytest

from rollstream.cli.process import running
from rollstream.shared.connection import STOPPING
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import STOP
from tests.conftest import SettingsFactory
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


def test_stopping_is_cleared_once_the_process_has_stopped(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory
) -> None:
    settings = make_settings(redis_server.url)
    stop = threading.Event()
    with running(settings, "producer", stop, heartbeat=False, follow=False) as process:
        assert process is not None
        assert not STOPPING.is_set()
        stop.set()
    assert not STOPPING.is_set()


def test_the_runs_stop_event_makes_the_process_stop_riding_out_no_outage(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory
) -> None:
    """The run's stop event ends the whole formation, Redis with it: like a SIGTERM, it
    bounds the outages the stopping process rides out (an engines process retried a
    vanished Redis for 120 s and was killed by its process manager)."""
    settings = make_settings(redis_server.url)
    stop = threading.Event()
    with running(settings, "producer", stop, heartbeat=False) as process:
        assert process is not None
        process.control.publish(STOP)
        wait_for(stop.is_set, timeout=10)
        assert STOPPING.is_set()
    assert not STOPPING.is_set()
