"""An idle producer backs off its looks for work (issue 26, goal P7): with nothing to claim,
each empty look doubles the wait to the next, from POLL_S up to producer.idle_poll_max_s,
so a fleet of idle producers costs Redis little; work fed later is still picked up within
that cap. On a real redis-server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
import redis

from rollstream.producer.assembly import build_producer
from rollstream.producer.worker import POLL_S, Producer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import SettingsError
from rollstream.shared.settings import load_settings
from tests.helpers import prompts, wait_for
from tests.integration.test_producer import settings_for
from tests.integration.test_producer_lifecycle import Counting, Running, throughout

pytestmark = pytest.mark.integration

MARGIN_S = 1.0  # scheduling slack on a loaded 2-core machine


class Looks:
    """The times (monotonic) of a producer's looks at admission: its ``admit`` calls."""

    def __init__(self, producer: Producer) -> None:
        self.times: list[float] = []
        self._lock = threading.Lock()
        admit = producer.admit

        def counted() -> Any:
            with self._lock:
                self.times.append(time.monotonic())
            return admit()

        producer.admit = counted  # type: ignore[method-assign]

    def between(self, start: float, end: float) -> list[float]:
        with self._lock:
            return [t for t in self.times if start <= t <= end]


def idle_producer(redis_server: EmbeddedRedis, run_name: str, **producer: Any) -> Producer:
    settings = settings_for(redis_server.url, run_name, producer=producer)
    client = redis.Redis.from_url(redis_server.url, connection_class=Counting)
    return build_producer(client, settings, name="idle")


def nothing_claimed(producer: Producer) -> None:
    assert producer.stats.claims == 0 and not producer.inflight


@pytest.fixture
def running() -> Iterator[list[Running]]:
    started: list[Running] = []
    yield started
    for run in started:
        run.stop()


@pytest.mark.timeout(90)
def test_an_idle_producer_backs_off_its_looks_for_work(
    redis_server: EmbeddedRedis, run_name: str, running: list[Running]
) -> None:
    # Given a producer with nothing to claim (no prompt fed) and the default cap of 1 s
    producer = idle_producer(redis_server, run_name)
    assert producer.plan.idle_poll_max_s == 1.0
    looks = Looks(producer)
    running.append(Running(producer).start())
    wait_for(lambda: looks.times, timeout=30)
    assert throughout(1.0, lambda: nothing_claimed(producer)) > 0
    # When it stays idle for 3 s more
    start, sent = time.monotonic(), Counting.sent
    assert throughout(3.0, lambda: nothing_claimed(producer)) > 0
    end = time.monotonic()
    in_window = looks.between(start, end)
    commands = Counting.sent - sent
    # Then it looks a few times (at most every 1 s once backed off), not every POLL_S
    # (60 looks, a few commands each, before the back-off)
    assert 1 <= len(in_window) <= 6, in_window
    assert commands < 30, commands
    # And the gaps between its looks have grown from POLL_S to the cap, never beyond it
    everything = looks.between(0.0, end)
    gaps = [b - a for a, b in pairwise(everything)]
    assert gaps, everything
    assert gaps[0] < 0.5, gaps  # the first empty looks come quickly
    assert all(g >= 0.4 for g in gaps[-2:]), gaps  # backed off by now
    assert max(gaps) <= 1.0 + MARGIN_S, gaps
    assert producer.stats.claims == 0


@pytest.mark.timeout(90)
def test_work_fed_after_a_long_idle_stretch_is_picked_up_within_the_cap(
    redis_server: EmbeddedRedis, run_name: str, running: list[Running]
) -> None:
    # Given a producer idle for 3 s with a cap of 0.5 s: backed off to the cap
    producer = idle_producer(redis_server, run_name, idle_poll_max_s=0.5)
    looks = Looks(producer)
    running.append(Running(producer).start())
    wait_for(lambda: looks.times, timeout=30)
    assert throughout(3.0, lambda: nothing_claimed(producer)) > 0
    # When prompts are fed
    fed = time.monotonic()
    producer.buffer.feed(prompts("math", 4))
    # Then it claims them within the cap (plus scheduling slack), and generates them
    wait_for(lambda: producer.stats.claims > 0, timeout=0.5 + MARGIN_S)
    picked_up = time.monotonic() - fed
    assert picked_up <= 0.5 + MARGIN_S, picked_up
    wait_for(lambda: producer.stats.outcomes.get("completed") == 4, timeout=30)
    # And while it was idle it never waited longer than the cap between looks
    idle = looks.between(0.0, fed)
    assert all(b - a <= 0.5 + MARGIN_S for a, b in pairwise(idle))
    assert len(idle) >= 4  # it kept looking: 0.05, 0.1, 0.2, then every 0.5 s


@pytest.mark.parametrize("value", [0.0, POLL_S / 2, -1.0])
def test_the_idle_poll_cap_is_at_least_poll_s(value: float) -> None:
    with pytest.raises(SettingsError, match="idle_poll_max_s"):
        load_settings(producer={"idle_poll_max_s": value})
