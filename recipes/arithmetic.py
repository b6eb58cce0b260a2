"""Arithmetic for a real pretrained model: a verifiable task generated in code, no data
set to download.

Each prompt asks for one product of the times tables (``a`` x ``b``, both in 2..12) as a
chat message, in one of five phrasings; the ground truth is the exact integer, and the
`math` judge scores a response by its final answer (the last \\boxed{} or, failing one,
the last number: "score" 1.0 or 0.0, "format" 1.0 where it boxed an answer). A product is
held out by its two operands, in either order, so no held-out product is ever trained
on, not even as b x a: 205 held-out prompts (41 products, five phrasings each), 400 to
train on.

Calibrated on SmolLM2-135M-Instruct (`smollm2-135m`). It was tried first on sums,
differences and products of one- and two-digit numbers: greedy accuracy 16 %, mostly
wrong arithmetic even where it answered "a + b = c" and stopped, and a GRPO run on the
plain loop barely moved it in the steps a CPU affords. On small products it knows the
answer (where it writes "a * b = c" and stops it is right about 9 times in 10) but about
half the time it rambles instead ("To solve this, we need to convert 6 to a mixed
number...") or writes more numbers after the answer, so its greedy exact-match accuracy
on the held-out prompts is 42 % (per phrasing from 20 % to 56 %: ``calibrate``), and RL
has room to raise it within a 2-core machine's budget. Most of what a run gains is the
answer's form, learned on the train products and carried to the held-out ones; the
README and bench/learning_real.py give the figures.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollstream.producer.engines.base import FINISH_LENGTH, FINISH_STOP
from rollstream.producer.judges.base import apply_rewards
from rollstream.producer.judges.math import MathJudge
from rollstream.recipes import prompts as prompt_files
from rollstream.shared.records import Group, Prompt, Sample

TASK = "arithmetic"
MODEL = "smollm2-135m"
JUDGE = "math"
MAX_TOKENS = 24
LR = 1e-5  # AdamW on a pretrained model, full weights
LOW, HIGH = 2, 12  # the operands' range, both ends in
PHRASINGS = (
    "What is {a} * {b}? Answer with just the number.",
    "What is {a} times {b}? Answer with just the number.",
    "Multiply {a} by {b}. Answer with just the number.",
    "Compute {a} * {b}. Answer with just the number.",
    "Calculate {a} * {b}. Answer with just the number.",
)


def held_out(a: int, b: int) -> bool:
    """About one product in three is held out, by its operands alone, in either order
    (stable across seeds)."""
    lo, hi = min(a, b), max(a, b)
    return (lo * 131 + hi * 31) % 3 == 0


def questions(split: str = "train", phrasings: Sequence[int] = range(len(PHRASINGS))) -> list[Prompt]:
    """Every question of ``split`` ("train" or "held_out"), in a fixed order; the uid names
    the product and the phrasing, so a question is fed once."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split is {split!r}: 'train' or 'held_out'")
    out = []
    for a in range(LOW, HIGH + 1):
        for b in range(LOW, HIGH + 1):
            if held_out(a, b) != (split == "held_out"):
                continue
            for t in phrasings:
                message = {"role": "user", "content": PHRASINGS[t].format(a=a, b=b)}
                out.append(Prompt(f"mul-{a}-{b}-{t}", TASK, [message], meta={"answer": str(a * b)}))
    return out


def prompts(
    count: int, seed: int = 0, *, split: str = "train", phrasings: Sequence[int] = range(len(PHRASINGS))
) -> list[Prompt]:
    """``count`` distinct questions of ``split`` in the seed's order."""
    pool = questions(split, phrasings)
    if count > len(pool):
        raise ValueError(f"{count} {split} prompts asked for: the split has {len(pool)}")
    random.Random(seed).shuffle(pool)
    return pool[:count]


def write_prompt_files(directory: str | Path, seed: int = 0, count: int | None = None) -> tuple[Path, Path]:
    """train.jsonl (``count`` prompts, all when None) and eval.jsonl (every held-out one) in
    ``directory``, for `rollstream feed --task arithmetic` and `rollstream train --eval-file`."""
    train = prompts(len(questions()) if count is None else count, seed)
    return prompt_files.write_prompt_files(directory, train, questions("held_out"))


def load(model_dir: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) of ``model_dir`` (a directory, or a known model's name) for
    generating in this process, the tokenizer padding on the left."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollstream.shared import models

    path = models.resolve(str(model_dir))
    tokenizer: Any = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, tokenizer


def _encode(tokenizer: Any, batch: list[Prompt]) -> Any:
    texts = [
        tokenizer.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=False) for p in batch
    ]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def greedy_answers(
    model: Any, tokenizer: Any, batch: list[Prompt], max_tokens: int = MAX_TOKENS
) -> list[str]:
    """The model's greedy responses to ``batch``, decoded: transformers' generate, left
    padded, in batches of 32 (the check a user runs without rollstream)."""
    import torch

    answers: list[str] = []
    for start in range(0, len(batch), 32):
        enc = _encode(tokenizer, batch[start : start + 32])
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        answers += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return answers


def accuracy(batch: list[Prompt], answers: list[str]) -> float:
    """Exact-match accuracy of ``answers`` as the math judge scores them."""
    judge = MathJudge()
    scores = [
        judge.score(text, str(p.meta["answer"]))["score"] for p, text in zip(batch, answers, strict=True)
    ]
    return sum(scores) / len(scores) if scores else 0.0


def calibrate(model_dir: str | Path = MODEL) -> dict[str, float]:
    """The greedy exact-match accuracy on the held-out prompts, per phrasing and in all."""
    model, tokenizer = load(model_dir)
    figures: dict[str, float] = {}
    everything: list[tuple[Prompt, str]] = []
    for t, phrasing in enumerate(PHRASINGS):
        batch = questions("held_out", phrasings=(t,))
        answers = greedy_answers(model, tokenizer, batch)
        figures[phrasing] = accuracy(batch, answers)
        everything += zip(batch, answers, strict=True)
    figures["all"] = accuracy([p for p, _ in everything], [a for _, a in everything])
    return figures


def sample_groups(model: Any, tokenizer: Any, batch: list[Prompt], n: int, step: int) -> list[Group]:
    """n samples of each prompt at temperature 1 from ``model`` in this process, with the
    logprobs an engine records, judged by the math judge: the plain loop's rollout."""
    import torch

    enc = _encode(tokenizer, [p for p in batch for _ in range(n)])
    width = enc["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=True, temperature=1.0, top_k=0,
                             pad_token_id=tokenizer.pad_token_id, output_scores=True,
                             return_dict_in_generate=True)  # fmt: skip
        logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    judge, groups = MathJudge(), []
    for g, prompt in enumerate(batch):
        samples = []
        for row in range(g * n, (g + 1) * n):
            ids = [int(i) for i in out.sequences[row, width:]]
            stopped = tokenizer.eos_token_id in ids
            end = ids.index(tokenizer.eos_token_id) + 1 if stopped else len(ids)
            pad = int(enc["attention_mask"][row].sum())
            samples.append(
                Sample(
                    enc["input_ids"][row, width - pad :].tolist(), ids[:end], logprobs[row, :end].tolist(),
                    [step] * end, finish_reason=FINISH_STOP if stopped else FINISH_LENGTH,
                    text=tokenizer.decode(ids[:end], skip_special_tokens=True),
                )
            )  # fmt: skip
        group = Group.for_prompt(prompt, samples=samples)
        apply_rewards(group.samples, judge(prompt, group.samples))
        groups.append(group)
    return groups
