"""The arithmetic task for the real model (recipes/arithmetic.py): seeded, distinct
questions with exact answers, train and held-out never sharing a product (in either
order), scored by the math judge's final answer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollstream.producer.prompts import read_prompt_file
from rollstream.recipes import arithmetic


def _ask(prompt: object) -> tuple[int, int]:
    content = prompt.prompt[0]["content"]  # type: ignore[attr-defined]
    a, b = (int(x) for x in re.findall(r"\d+", content))
    return a, b


def test_questions_are_seeded_distinct_and_answered_exactly() -> None:
    batch = arithmetic.prompts(300, seed=3)
    assert [p.uid for p in batch] == [p.uid for p in arithmetic.prompts(300, seed=3)]
    assert [p.uid for p in batch] != [p.uid for p in arithmetic.prompts(300, seed=4)]
    assert len({p.uid for p in batch}) == 300
    for p in batch:
        a, b = _ask(p)
        assert p.task == arithmetic.TASK and p.prompt[0]["role"] == "user"
        assert min(a, b) >= arithmetic.LOW and max(a, b) <= arithmetic.HIGH
        assert int(p.meta["answer"]) == a * b
    # every phrasing is asked
    assert {p.uid.rsplit("-", 1)[1] for p in batch} == {str(t) for t in range(len(arithmetic.PHRASINGS))}


def test_no_held_out_product_is_trained_on_in_either_order() -> None:
    train, held = arithmetic.questions("train"), arithmetic.questions("held_out")
    span = arithmetic.HIGH - arithmetic.LOW + 1
    assert len(held) >= 200 and len(train) + len(held) == len(arithmetic.PHRASINGS) * span * span
    trained = {frozenset(_ask(p)) for p in train}
    assert not trained & {frozenset(_ask(p)) for p in held}
    with pytest.raises(ValueError, match="'train' or 'held_out'"):
        arithmetic.prompts(1, split="test")
    with pytest.raises(ValueError, match=f"the split has {len(held)}"):
        arithmetic.prompts(len(held) + 1, split="held_out")


def test_accuracy_is_the_math_judges_exact_match() -> None:
    batch = arithmetic.prompts(3, seed=0)
    truth = [p.meta["answer"] for p in batch]
    a, b = _ask(batch[0])
    answers = [f"{a} * {b} = {truth[0]}", f"\\boxed{{{truth[1]}}}", "I think 1"]
    assert arithmetic.accuracy(batch, answers) == pytest.approx(2 / 3)
    # the last number is the answer: a right product followed by more numbers is wrong
    assert arithmetic.accuracy(batch[:1], [f"{a} * {b} = {truth[0]}, plus 3"]) == 0.0


def test_the_prompt_files_read_back_as_rollstream_feed_reads_them(tmp_path: Path) -> None:
    train_path, eval_path = arithmetic.write_prompt_files(tmp_path, seed=1, count=50)
    train = read_prompt_file(train_path, arithmetic.TASK)
    held = read_prompt_file(eval_path, arithmetic.TASK)
    assert [p.uid for p in train] == [p.uid for p in arithmetic.prompts(50, seed=1)]
    assert train[0].prompt == arithmetic.prompts(1, seed=1)[0].prompt
    assert [p.uid for p in held] == [p.uid for p in arithmetic.questions("held_out")]
    assert held[0].meta == arithmetic.questions("held_out")[0].meta
