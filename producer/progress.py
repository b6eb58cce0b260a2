"""What a producer says about its work: its counts (``ProducerStats``), one record per
model step in the run's metrics stream (``metrics_record``, capped at METRICS_CAP), and
a progress line in its log every process.progress_s (``report_progress``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollstream.producer.group import ABORTED, FAILED, FILTERED, Window

METRICS_CAP = 100_000
log = logging.getLogger(__name__)


@dataclass(slots=True)
class ProducerStats:
    outcomes: dict[str, int] = field(default_factory=dict)
    weight_syncs: int = 0
    retries: int = 0
    admission_waits: int = 0
    claims: int = 0

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    @property
    def groups(self) -> int:
        return sum(self.outcomes.values())


def metrics_record(
    producer: str,
    model_step: int,
    window: Window,
    ended: float,
    stats: ProducerStats,
    retried: int,
    busy: list[float],
) -> dict[Any, Any]:
    """The metrics record of what ``window`` (the groups completed since the last record,
    until ``ended``, time.monotonic) brought, with the producer's counts so far and its
    engines' ``busy`` fractions."""
    elapsed = max(1e-9, ended - window.started)
    outcomes = stats.outcomes
    return {
        "producer": producer,
        "model_step": model_step,
        "groups": window.groups,
        "tokens": window.tokens,
        "groups_per_s": round(window.groups / elapsed, 3),
        "tokens_per_s": round(window.tokens / elapsed, 1),
        "reward_mean": round(window.reward_sum / window.rewards, 4) if window.rewards else "",
        "filtered": outcomes.get(FILTERED, 0),
        "aborted": outcomes.get(ABORTED, 0),
        "failed": outcomes.get(FAILED, 0),
        "retried": retried,
        "admission_waits": stats.admission_waits,
        "engine_busy": round(sum(busy) / len(busy), 3) if busy else "",
    }


async def report_progress(
    producer: str, stats: ProducerStats, every_s: float, now: Callable[[], tuple[int, int, bool]]
) -> None:
    """A progress line every ``every_s``: claims and groups per second, in flight, model
    step. ``now``: the producer's groups in flight, model step and whether it is paused."""
    last, claims, groups = time.monotonic(), stats.claims, stats.groups
    while True:
        await asyncio.sleep(every_s)
        at = time.monotonic()
        dt = max(1e-9, at - last)
        inflight, model_step, paused = now()
        log.info(
            "producer %s: %.1f claims/s, %.1f groups/s, %d in flight, model step %d%s",
            producer, (stats.claims - claims) / dt, (stats.groups - groups) / dt,
            inflight, model_step, ", paused" if paused else "",
        )  # fmt: skip
        last, claims, groups = at, stats.claims, stats.groups
