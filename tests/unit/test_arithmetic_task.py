"""The arithmetic task for the real model (recipes/arithmetic.py): seeded, distinct
questions with exact answers, train and held-out never sharing one, scored by the math
judge's final answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.producer.prompts import read_prompt_file
from rollstream.recipes import arithmetic


def _ask(prompt: object) -> tuple[int, str, int]:
    content = prompt.prompt[0]["content"]  # type: ignore[attr-defined]
    a, op, b = content.removeprefix("What is ").split("?")[0].split()
    return int(a), op, int(b)


def test_questions_are_seeded_distinct_and_answered_exactly() -> None:
    batch = arithmetic.prompts(300, seed=3)
    assert [p.uid for p in batch] == [p.uid for p in arithmetic.prompts(300, seed=3)]
    assert [p.uid for p in batch] != [p.uid for p in arithmetic.prompts(300, seed=4)]
    assert len({p.uid for p in batch}) == 300
    for p in batch:
        a, op, b = _ask(p)
        assert p.task == arithmetic.TASK and p.prompt[0]["role"] == "user"
        assert int(p.meta["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0
    assert {_ask(p)[1] for p in batch} == {"+", "-", "*"}


def test_no_held_out_question_is_trained_on() -> None:
    train = {p.uid for seed in range(3) for p in arithmetic.prompts(400, seed=seed)}
    held = {p.uid for p in arithmetic.prompts(200, seed=0, split="held_out")}
    assert len(held) == 200 and not train & held
    with pytest.raises(ValueError, match="'train' or 'held_out'"):
        arithmetic.prompts(1, split="test")


def test_accuracy_is_the_math_judges_exact_match() -> None:
    batch = arithmetic.prompts(3, seed=0, ops=("+",))
    truth = [p.meta["answer"] for p in batch]
    answers = [
        f"{_ask(batch[0])[0]} + {_ask(batch[0])[2]} = {truth[0]}",
        f"\\boxed{{{truth[1]}}}",
        "I think 7",
    ]
    expected = 2 / 3 if truth[2] != "7" else 1.0
    assert arithmetic.accuracy(batch, answers) == pytest.approx(expected)


def test_the_prompt_files_read_back_as_rollstream_feed_reads_them(tmp_path: Path) -> None:
    train_path, eval_path = arithmetic.write_prompt_files(tmp_path, seed=1, count=50)
    train = read_prompt_file(train_path, arithmetic.TASK)
    held = read_prompt_file(eval_path, arithmetic.TASK)
    assert [p.uid for p in train] == [p.uid for p in arithmetic.prompts(50, seed=1)]
    assert len(held) == 200 and train[0].prompt == arithmetic.prompts(1, seed=1)[0].prompt
    assert held[0].meta == arithmetic.prompts(1, seed=1, split="held_out")[0].meta
