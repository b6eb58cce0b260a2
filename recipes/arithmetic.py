"""Arithmetic for a real pretrained model: a verifiable task generated in code, no data
set to download.

Each prompt asks for one two-digit sum, difference or product as a chat message; the
ground truth is the exact integer, and the `math` judge scores a response by its final
answer (the last \\boxed{} or, failing one, the last number: "score" 1.0 or 0.0, "format"
1.0 where it boxed an answer). Train and held-out prompts are drawn from one seeded
stream and told apart by their operands, so no held-out question is ever trained on.

The mix and the wording are calibrated on SmolLM2-135M-Instruct (`smollm2-135m`): its
greedy exact-match accuracy on the held-out prompts is what a learning run has to raise
(``calibrate`` measures it; bench/learning_real.py and the README give the figures).
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
LR = 2e-6  # Adam on a pretrained model: a small step
TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
# operand ranges per operation: sums and differences of two-digit numbers, products of a
# two-digit and a one-digit number
RANGES: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "+": ((10, 99), (10, 99)),
    "-": ((10, 99), (10, 99)),
    "*": ((10, 99), (2, 9)),
}


def _question(rng: random.Random, op: str) -> tuple[int, int, int]:
    (lo_a, hi_a), (lo_b, hi_b) = RANGES[op]
    a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
    if op == "-" and b > a:
        a, b = b, a  # no negative answers: the model's weakest case is not the point
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return a, b, answer


def write_prompt_files(directory: str | Path, seed: int = 0, count: int = 4000) -> tuple[Path, Path]:
    """train.jsonl (``count`` prompts) and eval.jsonl (200 held-out ones) in ``directory``,
    for `rollstream feed --task arithmetic` and `rollstream train --eval-file`."""
    train, held = prompts(count, seed), prompts(200, seed, split="held_out")
    return prompt_files.write_prompt_files(directory, train, held)


def held_out(question: tuple[str, int, int]) -> bool:
    """One in five questions is held out, by its operands alone (stable across seeds)."""
    op, a, b = question
    return (a * 131 + b * 31 + ord(op)) % 5 == 0


def prompts(
    count: int, seed: int = 0, *, split: str = "train", ops: Sequence[str] = tuple(RANGES)
) -> list[Prompt]:
    """``count`` distinct questions of ``split`` ("train" or "held_out"), drawn from the
    seeded stream; the uid names the question, so a question is fed once."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split is {split!r}: 'train' or 'held_out'")
    rng = random.Random(seed)
    out: list[Prompt] = []
    seen: set[tuple[str, int, int]] = set()
    while len(out) < count:
        op = ops[rng.randrange(len(ops))]
        a, b, answer = _question(rng, op)
        key = (op, a, b)
        if key in seen or held_out(key) != (split == "held_out"):
            continue
        seen.add(key)
        name = {"+": "add", "-": "sub", "*": "mul"}[op]
        message = {"role": "user", "content": TEMPLATE.format(a=a, op=op, b=b)}
        out.append(Prompt(f"{name}-{a}-{b}", TASK, [message], meta={"answer": str(answer)}))
    return out


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


def calibrate(model_dir: str | Path = MODEL, count: int = 200, seed: int = 0) -> dict[str, float]:
    """The greedy exact-match accuracy on ``count`` held-out prompts, per operation and in all."""
    model, tokenizer = load(model_dir)
    figures: dict[str, float] = {}
    everything: list[tuple[Prompt, str]] = []
    for op in RANGES:
        batch = prompts(count // len(RANGES), seed, split="held_out", ops=(op,))
        answers = greedy_answers(model, tokenizer, batch)
        figures[op] = accuracy(batch, answers)
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
