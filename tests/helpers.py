"""Record builders and waiting helpers shared by the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from shared.records import Group, Prompt, Sample

T = TypeVar("T")


def prompts(task: str, count: int, start: int = 0) -> list[Prompt]:
    return [
        Prompt(uid=f"u{i}", task=task, prompt=f"What is {i} + 1?", meta={"answer": str(i + 1)})
        for i in range(start, start + count)
    ]


def group_for(prompt: Prompt, n: int = 4, tokens: int = 8, step: int = 0) -> Group:
    samples = [
        Sample(
            prompt_ids=[1, 2, 3],
            response_ids=list(range(i, i + tokens)),
            logprobs=[-0.5] * tokens,
            response_versions=[step] * tokens,
            finish_reason="stop",
            reward={"score": float(i % 2)},
        )
        for i in range(n)
    ]
    return Group.for_prompt(prompt, samples=samples)


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Poll until predicate() is truthy; fail with a clear message at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
