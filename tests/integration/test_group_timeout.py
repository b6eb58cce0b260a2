"""An attempt past the per-attempt timeout is blamed on the engine that ran it: the
retry goes elsewhere, and the reason names that engine."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from rollstream.producer.engines.base import EngineHealth, Generation, SamplingParams
from rollstream.producer.filters import keep_all
from rollstream.producer.fleet.pool import LocalPool
from rollstream.producer.group import COMPLETED, FAILED, GroupRunner
from rollstream.producer.judges.registry import load_judge
from rollstream.producer.tokenizer import BytesTokenizer
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.records import ID_DTYPE, LOGPROB_DTYPE
from rollstream.shared.settings import load_settings
from tests.conftest import BufferFactory
from tests.helpers import prompts

pytestmark = pytest.mark.integration

TIMEOUT_S = 0.5


class FakeEngine:
    """Answers each request once ``gate`` is open; never answers when ``hangs``."""

    def __init__(self, gate: asyncio.Event | None = None, *, hangs: bool = False) -> None:
        self.gate = gate
        self.hangs = hangs
        self.requests: list[str | None] = []
        self.received = asyncio.Event()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> list[Generation]:
        self.requests.append(request_id)
        self.received.set()
        if self.hangs:
            await asyncio.Event().wait()  # until the runner's timeout cancels it
        if self.gate is not None:
            await self.gate.wait()
        ids, logprobs = np.array([50], dtype=ID_DTYPE), np.array([-0.1], dtype=LOGPROB_DTYPE)
        return [Generation(ids, logprobs, np.zeros(1, dtype=ID_DTYPE), "stop", text="2") for _ in range(n)]

    async def abort(self, request_ids: list[str] | None = None) -> int:
        return 0

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, model_step: int, path: str | None = None) -> None: ...

    async def health(self) -> EngineHealth:
        return EngineHealth(True, 0, False, len(self.requests), 0, 0, 0.0)


def runner_for(buffer: ReplayBuffer, pool: LocalPool, /, **overrides: Any) -> GroupRunner:
    """A runner built, as the producer builds it, from the sections it uses: those of the
    settings ``overrides`` (the ones the buffer was opened with)."""
    s = load_settings(**overrides)
    return GroupRunner(
        s.producer, s.tasks, buffer, pool, BytesTokenizer(), load_judge("math"), keep_all,
        on_weight_sync=s.rollout.on_weight_sync, max_attempts=s.buffer.max_attempts,
    )  # fmt: skip


def settings(**buffer: Any) -> dict[str, Any]:
    return {
        "tasks": [{"name": "math", "n": 2}],
        "buffer": {"claim_idle_ms": 60_000, "max_attempts": 2, **buffer},
        "producer": {"group_timeout_s": TIMEOUT_S, "is_valid": "keep_all"},
    }


@pytest.mark.timeout(30)
def test_a_timed_out_attempt_is_retried_away_from_the_engine_that_hung(real_buffer: BufferFactory) -> None:
    buffer = real_buffer("p", **settings())
    buffer.feed(prompts("math", 2))
    busy, slow = buffer.claim("math", 2)
    gate = asyncio.Event()
    fine, hung = FakeEngine(gate), FakeEngine(hangs=True)
    pool = LocalPool([fine, hung])
    runner = runner_for(buffer, pool, **settings())

    async def main() -> tuple[str, str]:
        first = asyncio.create_task(runner.run(busy))  # engine 0 busy: the next group goes to 1
        second = asyncio.create_task(runner.run(slow))
        await asyncio.wait_for(hung.received.wait(), TIMEOUT_S)
        assert pool.outstanding == [1, 1]
        gate.set()  # engine 0 is idle again long before engine 1's attempt times out
        return await first, await second

    assert asyncio.run(main()) == (COMPLETED, COMPLETED)
    assert hung.requests == [f"{slow.group_id}#{slow.entry.id}#1"]  # tried there once, never again
    assert fine.requests[-1] == f"{slow.group_id}#{slow.entry.id}#2"
    assert runner.retries == 1
    assert pool.outstanding == [0, 0]


@pytest.mark.timeout(30)
def test_the_timeout_reason_names_the_engine_that_hung(real_buffer: BufferFactory) -> None:
    buffer = real_buffer("p", **settings())
    buffer.feed(prompts("math", 1))
    (claim,) = buffer.claim("math", 1)
    engines = [FakeEngine(hangs=True), FakeEngine(hangs=True)]
    runner = runner_for(buffer, LocalPool(list(engines)), **settings())
    assert asyncio.run(runner.run(claim)) == FAILED
    assert [len(e.requests) for e in engines] == [1, 1]
    dead_letters: Any = buffer.client.xrange(buffer.keys.dead)
    ((_, dead),) = dead_letters
    assert dead[b"reason"].decode() == (
        f"generation failed: 2 attempts, last: engine 1: timed out after {TIMEOUT_S:.1f} s"
    )
