"""The dynamic per-attempt timeout (producer.timeout_ratio x the mean time of recent
groups) has a floor: fast groups made it a few milliseconds, and a failover or a busy
moment then timed out and dead-lettered every group in flight."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from rollstream.producer.group import DYNAMIC_TIMEOUT_AFTER, GroupRunner
from rollstream.shared.settings import load_settings


def timeout(recent_s: list[float], **producer: object) -> float | None:
    settings = load_settings(producer=producer)
    runner = SimpleNamespace(producer=settings.producer, recent_s=deque(recent_s))
    return GroupRunner.timeout_s(runner)  # type: ignore[arg-type]


def test_fast_groups_get_the_floor_not_a_few_milliseconds() -> None:
    assert timeout([0.002] * DYNAMIC_TIMEOUT_AFTER) == 30.0
    assert timeout([0.002] * DYNAMIC_TIMEOUT_AFTER, min_timeout_s=5) == 5.0


def test_slow_groups_get_ratio_times_their_mean() -> None:
    assert timeout([20.0] * DYNAMIC_TIMEOUT_AFTER) == 80.0
    assert timeout([1.0]) is None  # too few groups seen yet
    assert timeout([0.002] * DYNAMIC_TIMEOUT_AFTER, group_timeout_s=7) == 7.0
