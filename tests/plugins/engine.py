"""A plug-in engine: ``engines.kind = "tests.plugins.engine:make"``, its settings in
``engines.options``. Its tokens are ids no built-in engine makes (the sim engine's are
bytes), so a group in the stream shows that it came from here."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from rollstream.producer.engines import (
    FINISH_STOP,
    EngineHealth,
    EngineSettings,
    Generation,
    SamplingParams,
)

MARK = 90_000  # sample i of every group is `tokens` times the id MARK + i


class MarkedEngine:
    made: ClassVar[list[MarkedEngine]] = []  # every engine built, for the tests to look at

    def __init__(self, tokens: int = 4, mark: int = MARK) -> None:
        self.tokens = tokens
        self.mark = mark
        self.step = 0
        self.loaded: list[tuple[int, str | None]] = []  # update_weights calls: (step, path)
        self.requests: list[str | None] = []
        self.prompts: list[list[int]] = []  # the prompt ids of each request
        MarkedEngine.made.append(self)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> list[Generation]:
        self.requests.append(request_id)
        self.prompts.append(list(prompt_ids))
        await asyncio.sleep(0)  # a real engine awaits its scheduler here
        length = min(self.tokens, params.max_tokens)
        return [
            Generation(
                response_ids=[self.mark + i] * length,
                logprobs=[-0.25] * length,
                versions=[self.step] * length,
                finish_reason=FINISH_STOP,
                text=f"plug-in sample {i}",
            )
            for i in range(n)
        ]

    async def abort(self, request_ids: list[str] | None = None) -> int:
        return 0  # nothing runs across an await long enough to abort

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        self.loaded.append((model_step, path))
        self.step = model_step

    async def health(self) -> EngineHealth:
        return EngineHealth(
            healthy=True,
            model_step=self.step,
            paused=False,
            outstanding=0,
            running=0,
            queued=0,
            busy_fraction=0.0,
            detail="marked",
        )


def make(settings: EngineSettings) -> MarkedEngine:
    return MarkedEngine(**settings.options)


def not_an_engine(settings: EngineSettings) -> Any:
    """A factory that returns something else: make_engine must refuse it."""
    return {"generate": "no"}


class HalfAnEngine:
    """Generates, and has none of the other methods."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> list[Generation]:
        return []


def make_half(settings: EngineSettings) -> HalfAnEngine:
    return HalfAnEngine()


NOT_CALLABLE = 42
