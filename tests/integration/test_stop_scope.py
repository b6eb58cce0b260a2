"""A process's stop is its own: once ``running`` has ended, a later client in the same
interpreter (a test, the demo's next part) rides out Redis outages again."""

from __future__ import annotations

import threading

import pytest

from rollstream.cli.process import running
from rollstream.shared.connection import STOPPING
from rollstream.shared.embedded import EmbeddedRedis
from tests.conftest import SettingsFactory

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
