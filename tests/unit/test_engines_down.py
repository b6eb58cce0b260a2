"""While no engine is reachable (the only engines' node is gone), a group waits for one
instead of spending its buffer.max_attempts in milliseconds and going to the dead
letters; a failure while another engine is reachable still counts."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rollstream.producer.engines.base import Generation
from rollstream.producer.filters import keep_all
from rollstream.producer.fleet import pool as pool_module
from rollstream.producer.fleet.pool import BasePool
from rollstream.producer.group import GroupFailed, GroupRunner
from rollstream.producer.judges.registry import load_judge
from rollstream.producer.tokenizer import BytesTokenizer
from rollstream.shared.keys import Keys
from rollstream.shared.records import Prompt
from rollstream.shared.settings import load_settings


class Gone(Exception):
    pass


class FlakyPool(BasePool):
    """Every engine unreachable for the first ``down_calls`` calls, then serving."""

    def __init__(self, size: int, down_calls: int, clock: list[float]) -> None:
        super().__init__(size)
        self.down_calls = down_calls
        self.calls = 0
        self.clock = clock

    async def _generate(self, index: int, prompt_ids: Any, params: Any, n: int, request_id: str) -> Any:
        self.calls += 1
        if self.calls <= self.down_calls:
            raise Gone(f"engine {index}: its node is gone")
        return [Generation([1, 2], [-0.1, -0.2], [0, 0], "stop", "ok") for _ in range(n)]

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        return None

    async def _abort(self, index: int, request_ids: list[str] | None) -> int:
        return 0

    def _unreachable(self, exc: Exception) -> bool:
        return isinstance(exc, Gone)


def _runner(pool: BasePool, clock: list[float], max_attempts: int = 2) -> tuple[GroupRunner, list[float]]:
    settings = load_settings(tasks=[{"name": "math", "n": 2}])
    buffer: Any = SimpleNamespace(client=None, keys=Keys("r"), consumer="p1")
    runner = GroupRunner(
        settings.producer, settings.tasks, buffer, pool, BytesTokenizer(), load_judge("math"), keep_all,
        on_weight_sync="drain", max_attempts=max_attempts,
    )  # fmt: skip
    waits: list[float] = []

    async def sleep(seconds: float) -> None:  # the cool-downs pass on the test's clock
        waits.append(seconds)
        clock[0] += seconds

    runner._sleep = sleep  # type: ignore[method-assign]
    return runner, waits


def _claim() -> Any:
    prompt = Prompt("q1", "math", "What is 1 + 1?", meta={"answer": "2"})
    entry = SimpleNamespace(id="1-0")
    return SimpleNamespace(group_id="g1", task="math", prompt=prompt, partial=[], entry=entry)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    return now


def test_a_group_waits_for_an_engine_while_none_is_reachable(clock: list[float]) -> None:
    # Given both engines unreachable for 6 calls, and 2 attempts per group
    pool = FlakyPool(2, down_calls=6, clock=clock)
    runner, waits = _runner(pool, clock)
    # When a group is generated
    samples = asyncio.run(runner.generate(_claim()))
    # Then it waited out the cool-downs (growing) and completed: no attempt was spent
    assert len(samples) == 2 and all(len(s.response_ids) == 2 for s in samples)
    assert pool.calls == 7
    waited = [w for w in waits if w > 0]  # 0: the other engine's cool-down had ended: try it now
    assert len(waited) >= 2 and waited == sorted(waited) and max(waited) <= pool_module.COOLDOWN_MAX_S


def test_failures_while_an_engine_is_reachable_spend_attempts(clock: list[float]) -> None:
    class Refusing(FlakyPool):  # the engines answer, with an error: the group's fault
        def _unreachable(self, exc: Exception) -> bool:
            return False

    pool = Refusing(2, down_calls=6, clock=clock)
    runner, waits = _runner(pool, clock)
    with pytest.raises(GroupFailed, match=r"2 attempts, last: .*node is gone"):
        asyncio.run(runner.generate(_claim()))
    assert pool.calls == 2 and waits == []


def test_one_reachable_engine_left_means_no_wait(clock: list[float]) -> None:
    pool = FlakyPool(2, down_calls=1, clock=clock)
    runner, waits = _runner(pool, clock)
    samples = asyncio.run(runner.generate(_claim()))
    assert len(samples) == 2 and pool.calls == 2 and waits == []
    assert np.all(samples[0].response_ids == [1, 2])
