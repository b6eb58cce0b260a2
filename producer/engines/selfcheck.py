"""Weights an engine can be trusted with: its greedy output on a few prompts must be
what Hugging Face transformers computes from the same files.

Why: an engine that loads new weights in place can get them subtly wrong and say
nothing — vLLM's in-place reload of a model with tied embeddings kept the old output
projection, and every later token came from a model the trainer never had. Greedy
decoding makes such a fault visible: each token is the argmax of the logits, so
wrong weights change the tokens within a few steps.

Two kernels seldom agree to the last bit, so an argmax between two nearly equal
logits may fall either way. At the first position where the engine and
transformers part, the engine's token is accepted when transformers gives it
within ``tolerance`` (in log-probability) of its own choice; what follows depends
on that choice, so the comparison of that prompt stops there. Wrong weights part
at once and by far more.

transformers runs on the CPU, in float32, in a worker thread: meant for small models
(tests, a start-up check), not for checking a 70B model after every step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.producer.engines.base import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)

Generate = Callable[[list[int], SamplingParams], Awaitable[Generation]]

MAX_TOKENS = 16
TOLERANCE_FP32 = 1e-3  # a float32 engine against a float32 reference: only true near-ties
TOLERANCE_HALF = 0.25  # bfloat16 / float16 kernels round far more


@dataclass(slots=True)
class Reference:
    """What transformers decodes greedily from one prompt: the tokens, and at each step
    the log-probabilities of every token (to judge a near-tie)."""

    tokens: list[int]
    logprobs: list[Any]  # one torch tensor (vocab,) per step


def probe_prompts(model_dir: str, count: int = 2, length: int = 8) -> list[list[int]]:
    """A few fixed prompts of token ids the model knows, without a tokenizer: the
    check must not depend on one (a trainer publishes weights, not vocabularies)."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0)
    if vocab <= 0:
        raise EngineError(f"no vocab_size in {model_dir}/config.json")
    # spread over the vocabulary, the same on every run
    return [[(p * 7919 + i * 104729 + 13) % vocab for i in range(length)] for p in range(1, count + 1)]


def hf_model(model_dir: str, weights: str | None = None) -> Any:
    """The model of ``model_dir`` in float32 on the CPU, with the weights a trainer
    published at ``weights`` (a directory of safetensors, or a transport's URI) loaded
    over it."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if weights is not None:
        # what the engine was given: a directory, through its index when it has one (a step
        # of only the changed tensors points to earlier steps for the rest), or a transport's URI
        from rollstream.producer.engines.vllm_worker import published_weights

        try:
            state = {k: v.clone() for k, v in published_weights(weights, ties=False, base=model_dir)}
        except (FileNotFoundError, OSError, ValueError) as exc:
            raise EngineError(f"cannot read the weights at {weights!r}: {exc}") from exc
        params = model.state_dict()
        loaded = {params[k].data_ptr() for k in state if k in params}
        # tied weights (lm_head = embeddings) are one tensor: saved once, loaded once
        missing = [k for k in params if k not in state and params[k].data_ptr() not in loaded]
        unexpected = [k for k in state if k not in params]
        if missing or unexpected:
            raise EngineError(
                f"the weights at {weights!r} do not fit the model of {model_dir!r}: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model.eval()


def hf_greedy(model: Any, prompts: Sequence[list[int]], max_tokens: int = MAX_TOKENS) -> list[Reference]:
    """Greedy decoding with transformers, ``max_tokens`` per prompt, EOS ignored."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            tokens: list[int] = []
            logprobs = []
            for _ in range(max_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                row = torch.log_softmax(logits, dim=-1)
                token = int(row.argmax())
                tokens.append(token)
                logprobs.append(row)
                ids.append(token)
            out.append(Reference(tokens, logprobs))
    return out


def first_difference(engine: Sequence[int], reference: Reference, tolerance: float) -> int | None:
    """The first position where the engine's greedy tokens differ from the reference
    beyond a near-tie; None when they agree (up to a near-tie, where the comparison
    stops)."""
    for position, (mine, theirs) in enumerate(zip(engine, reference.tokens, strict=False)):
        if mine == theirs:
            continue
        row = reference.logprobs[position]
        if mine < len(row) and float(row[theirs] - row[mine]) <= tolerance:
            return None  # a near-tie: either token is right, and the rest follows from it
        return position
    if len(engine) != len(reference.tokens):
        return min(len(engine), len(reference.tokens))
    return None


async def check_greedy(
    generate: Generate,
    model_dir: str,
    weights: str | None,
    model_step: int,
    *,
    tolerance: float = TOLERANCE_FP32,
    prompts: Sequence[list[int]] | None = None,
    max_tokens: int = MAX_TOKENS,
) -> None:
    """Raise EngineError, naming the model step, the prompt and the first differing
    position, unless ``generate`` decodes greedily what transformers decodes from
    ``model_dir`` with the safetensors of ``weights`` (None: the model's own)."""
    failed = f"self-check failed at model step {model_step}"

    def reference() -> list[Reference]:
        return hf_greedy(hf_model(model_dir, weights), probes, max_tokens)

    try:
        probes = list(prompts) if prompts is not None else probe_prompts(model_dir)
        # an incomplete checkpoint fails here: vLLM loads what is there with a warning
        expected = await asyncio.to_thread(reference)
    except (EngineError, OSError, ValueError) as exc:
        raise EngineError(f"{failed}: {exc}") from exc
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for index, (prompt, ref) in enumerate(zip(probes, expected, strict=True)):
        got = (await generate(list(prompt), params)).response_ids.tolist()
        position = first_difference(got, ref, tolerance)
        if position is not None:
            mine = got[position] if position < len(got) else None
            theirs = ref.tokens[position] if position < len(ref.tokens) else None
            raise EngineError(
                f"{failed}: greedy output differs from "
                f"transformers' on the weights {weights or model_dir!r} — prompt {index}, first at "
                f"response position {position} (engine token {mine}, transformers token {theirs}); "
                "the engine's weights are not the published ones"
            )
    log.info(
        "self-check passed at model step %d (%d prompts, %d tokens)", model_step, len(probes), max_tokens
    )
