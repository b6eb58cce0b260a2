"""Which engine gets the next group: engines scaled in get none, an engine that is gone
(its node died, it is restarting) gets none for a while, new engines join."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollstream.producer.engines.base import Generation, SamplingParams
from rollstream.producer.fleet import pool as pool_module
from rollstream.producer.fleet.pool import BasePool, EnginePool

PARAMS = SamplingParams(max_tokens=4)


class Gone(Exception):
    pass


class FakePool(BasePool):
    """Engine ``down`` is gone: its calls fail as an unreachable Ray actor's do."""

    def __init__(self, size: int, down: int | None = None) -> None:
        super().__init__(size)
        self.down = down
        self.calls: list[int] = []

    async def _generate(self, index: int, *args: Any) -> list[Generation]:
        self.calls.append(index)
        if index == self.down:
            raise Gone(f"engine {index} died")
        return []

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        self.calls.append(index)
        return None

    def _unreachable(self, exc: Exception) -> bool:
        return isinstance(exc, Gone)


def test_an_engine_that_is_gone_gets_no_new_groups_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: clock[0])
    pool = FakePool(2, down=0)
    # engine 0 is picked first (fewest outstanding, lowest index) and fails
    result = asyncio.run(pool.generate([1], PARAMS, 2, "g1"))
    assert result.failed and result.engine == 0
    # Then the next groups go to engine 1, though engine 0 has no more outstanding
    assert [pool.pick() for _ in range(3)] == [1, 1, 1]
    assert pool.pick(avoid=[1]) == 0  # unless nothing else is left
    # After the cool-down it is tried again; a second failure in a row waits twice as long
    clock[0] += pool_module.COOLDOWN_S + 0.1
    assert pool.pick() == 0
    asyncio.run(pool.generate([1], PARAMS, 2, "g2"))
    clock[0] += pool_module.COOLDOWN_S + 0.1
    assert pool.pick() == 1
    clock[0] += pool_module.COOLDOWN_S
    assert pool.pick() == 0
    # and once it serves again it is an engine like the others
    pool.down = None
    assert not asyncio.run(pool.generate([1], PARAMS, 2, "g3", engine=0)).failed
    assert 0 not in pool.cooling


def test_an_engine_that_refuses_a_request_is_not_avoided() -> None:
    class Refusing(FakePool):
        def _unreachable(self, exc: Exception) -> bool:
            return False

    pool = Refusing(2, down=0)
    assert asyncio.run(pool.generate([1], PARAMS, 2, "g")).failed
    assert pool.pick() == 0


def test_retired_engines_get_no_groups_nor_broadcasts() -> None:
    pool = FakePool(3)
    pool.retired = {1, 2}
    assert pool.serving() == [0]
    assert [pool.pick() for _ in range(2)] == [0, 0]
    assert pool.pick(avoid=[0]) == 0  # the only engine serving
    assert asyncio.run(pool.pause()) == []
    assert pool.calls == [0]
    assert asyncio.run(pool.sync_weights(3, timeout_s=0.1)) == [0]  # never confirms; 1, 2 not asked
    assert set(pool.calls) == {0}


def test_engine_pool_resize_adds_new_engines_and_retires_those_above() -> None:
    pool = EnginePool("r", ["h0", "h1"])
    pool.resize(["h0", "h1", "h2"])
    assert (pool.handles, pool.outstanding, pool.serving()) == (["h0", "h1", "h2"], [0, 0, 0], [0, 1, 2])
    pool.outstanding[2] = 1  # a group in flight on engine 2 when it is scaled in
    pool.resize(["h0"])
    assert pool.serving() == [0] and pool.retired == {1, 2}
    pool.outstanding[2] -= 1  # its call ends later: the slot is still there
    pool.resize(["h0", "h1b"])  # scaled out again: engine 1 comes back (a new actor)
    assert pool.serving() == [0, 1] and pool.handles[1] == "h1b"
    pool.forget_retired()
    assert pool.handles == ["h0", "h1b"] and pool.outstanding == [0, 0]


class SilentPool(FakePool):
    """Engine ``down``'s calls never return (its node is gone; Ray holds them)."""

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        self.calls.append(index)
        if index == self.down:
            await asyncio.Event().wait()
        return args[0] if method == "sync_weights" else None

    async def _health(self, index: int) -> Any:
        if index == self.down:
            await asyncio.Event().wait()
        return object()


def test_a_weight_sync_gives_up_at_once_on_an_engine_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_module, "SYNC_PROBE_S", 0.2)
    monkeypatch.setattr(pool_module, "PROBE_ANSWER_S", 0.2)
    pool = SilentPool(3, down=1)

    async def main() -> tuple[list[int], float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        stuck = await pool.sync_weights(5, timeout_s=30.0)
        return stuck, loop.time() - started

    stuck, took = asyncio.run(main())
    assert stuck == [1]
    assert took < 5.0  # not the 30 s of the timeout
    assert pool.target[0] == 5
    assert pool.pick() != 1 and 1 in pool.cooling  # and it gets no new work meanwhile
    # the next sync does not wait for it again while it is known gone
    calls = len(pool.calls)
    stuck, took = asyncio.run(main())
    assert stuck == [1] and took < 1.0
    assert 1 not in pool.calls[calls:]


def test_pause_reports_an_engine_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "CONTROL_TIMEOUT_S", 0.2)
    assert asyncio.run(SilentPool(2, down=0).pause()) == [0]
