"""A prompt's own sampling (meta["sampling"]): an eval prompt decoded greedily is asked
of the engine at temperature 0 while the others keep the producer's; a bad one fails
its group with a reason that names it."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from rollstream.producer.engines.base import EngineHealth, Generation, SamplingParams
from rollstream.producer.fleet.pool import LocalPool
from rollstream.producer.group import (
    COMPLETED,
    FAILED,
    SAMPLING_META,
    GroupFailed,
    prompt_sampling,
)
from rollstream.shared.records import ID_DTYPE, LOGPROB_DTYPE, Prompt
from rollstream.shared.settings import ProducerSettings
from tests.conftest import BufferFactory
from tests.integration.test_group_timeout import runner_for

pytestmark = pytest.mark.integration


class RecordingEngine:
    """Answers "2" at once and keeps the sampling parameters of each request."""

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> list[Generation]:
        self.params.append(params)
        ids, logprobs = np.array([50], dtype=ID_DTYPE), np.array([-0.1], dtype=LOGPROB_DTYPE)
        return [Generation(ids, logprobs, np.zeros(1, dtype=ID_DTYPE), "stop", text="2") for _ in range(n)]

    async def abort(self, request_ids: list[str] | None = None) -> int:
        return 0

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, model_step: int, path: str | None = None) -> None: ...

    async def health(self) -> EngineHealth:
        return EngineHealth(True, 0, False, 0, 0, 0, 0.0)


def test_each_prompt_is_sampled_its_own_way(real_buffer: BufferFactory) -> None:
    overrides: dict[str, Any] = {
        "tasks": [{"name": "math", "n": 2}],
        "producer": {"temperature": 0.7, "top_p": 0.9, "is_valid": "keep_all"},
    }
    buffer = real_buffer("p", **overrides)
    meta = {"answer": "2"}
    buffer.feed(
        [
            Prompt("plain", "math", "1 + 1?", meta=meta),
            Prompt("greedy", "math", "1 + 1?", meta={**meta, SAMPLING_META: {"temperature": 0}}),
            Prompt("bad", "math", "1 + 1?", meta={**meta, SAMPLING_META: {"temperature": -1}}),
        ]
    )
    engine = RecordingEngine()
    runner = runner_for(buffer, LocalPool([engine]), **overrides)

    async def run_all() -> list[str]:
        return [await runner.run(claim) for claim in buffer.claim("math", 3)]

    assert asyncio.run(run_all()) == [COMPLETED, COMPLETED, FAILED]
    assert [(p.temperature, p.top_p) for p in engine.params] == [(0.7, 0.9), (0.0, 0.9)]
    (dead,) = buffer.client.xrange(buffer.keys.dead)[-1:]
    reason = dead[1][b"reason"].decode()
    assert "prompt math:bad: meta['sampling'] needs temperature >= 0 and 0 < top_p <= 1" in reason


def test_prompt_sampling_checks_what_it_is_given() -> None:
    producer = ProducerSettings(temperature=1.0, top_p=1.0)

    def of(sampling: object) -> tuple[float, float]:
        return prompt_sampling(Prompt("u", "t", "p", meta={SAMPLING_META: sampling}), producer)

    assert prompt_sampling(Prompt("u", "t", "p"), producer) == (1.0, 1.0)
    assert of({"temperature": 0}) == (0.0, 1.0)
    assert of({"top_p": 0.5}) == (1.0, 0.5)
    with pytest.raises(GroupFailed, match=r"must be an object of temperature and top_p, got \{'temp': 0\}"):
        of({"temp": 0})
    with pytest.raises(GroupFailed, match="must be an object"):
        of(0.0)
    with pytest.raises(GroupFailed, match="needs temperature >= 0"):
        of({"top_p": 0})
    with pytest.raises(GroupFailed, match="needs temperature >= 0"):
        of({"temperature": "hot"})
