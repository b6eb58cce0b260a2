"""The reference group every buffer benchmark moves: 8 samples x 2,048 response
tokens + 512 prompt tokens, with logprobs and a weight sync a third of the way
(versions in two runs, as after a partial rollout)."""

from __future__ import annotations

import numpy as np

from rollstream.shared.records import Group, Prompt, Sample

SAMPLES = 8
RESPONSE_TOKENS = 2_048
PROMPT_TOKENS = 512
VOCAB = 151_936


def build_samples(seed: int = 0, score: float | None = None, tokens: int = RESPONSE_TOKENS) -> list[Sample]:
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int32)
    return [
        Sample(
            prompt_ids=prompt_ids,
            response_ids=rng.integers(0, VOCAB, tokens, dtype=np.int32),
            logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
            response_versions=np.repeat(
                np.array([6, 7], dtype=np.int32), [tokens // 3, tokens - tokens // 3]
            ),
            finish_reason="stop",
            reward={"score": float(rng.integers(0, 2)) if score is None else score},
        )
        for _ in range(SAMPLES)
    ]


def build_group(seed: int = 0) -> Group:
    prompt = Prompt(uid=f"p{seed}", task="bench", prompt="Solve: what is 17 * 23? Think step by step.")
    return Group.for_prompt(prompt, samples=build_samples(seed), producer="bench-0")
