"""``single_turn``: one response per sample, the model's alone (no turns, no mask).

Fresh samples are one request of n, so that one engine's prefix cache serves them
all; samples handed back by an abort in partial mode each go on from their own
tokens, with what is left of max_tokens, and keep the versions they had. The groups
it makes are exactly those of the producer before agents existed, byte for byte.
"""

from __future__ import annotations

import asyncio

import numpy as np

from rollstream.producer.agents.base import AgentConfig, Rollout
from rollstream.producer.engines.base import FINISH_ABORT, Generation
from rollstream.shared.records import IdArray, Sample, Status


class SingleTurnAgent:
    def __init__(self, config: AgentConfig) -> None:
        config.check_options("single_turn", ())
        self.config = config

    async def run_group(self, rollout: Rollout, samples: list[Sample]) -> list[Sample]:
        max_tokens = self.config.max_tokens
        prompt_ids = rollout.prompt_ids
        if all(len(s.response_ids) == 0 for s in samples):
            gens = await rollout.generate(prompt_ids, len(samples), max_tokens)
            return [_sample(prompt_ids, g) for g in gens]
        parts = [
            rollout.generate(
                prompt_ids + s.response_ids.tolist(), 1, max_tokens - len(s.response_ids), f".{i}"
            )
            for i, s in enumerate(samples)
        ]
        results = await asyncio.gather(*parts, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [_merge(prompt_ids, s, r[0]) for s, r in zip(samples, results, strict=True)]  # type: ignore[index]


def _sample(prompt_ids: list[int] | IdArray, gen: Generation) -> Sample:
    aborted = gen.finish_reason == FINISH_ABORT
    return Sample(
        prompt_ids=prompt_ids,
        response_ids=gen.response_ids,
        logprobs=gen.logprobs,
        response_versions=gen.versions,
        finish_reason=gen.finish_reason,
        status=Status.ABORTED if aborted else Status.COMPLETED,
        text=gen.text,
    )


def _merge(prompt_ids: list[int], before: Sample, gen: Generation) -> Sample:
    """A partial sample continued: its tokens, then the new ones (with their versions)."""
    merged = _sample(prompt_ids, gen)
    merged.response_ids = np.concatenate([before.response_ids, merged.response_ids])
    merged.logprobs = np.concatenate([before.logprobs, merged.logprobs])
    merged.response_versions = np.concatenate([before.response_versions, merged.response_versions])
    merged.text = before.text + merged.text
    return merged
