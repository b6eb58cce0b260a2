"""`rollstream train --record`: the version it writes for each group read is the one the
trainer's staleness rule uses (docs/stream-format.md §11.3)."""

from __future__ import annotations

from rollstream.cli.train import _oldest_version
from rollstream.shared.records import Group, Prompt, Sample


def test_a_group_without_a_response_token_is_recorded_at_its_model_step() -> None:
    empty = [Sample([1, 2], [], [], [], finish_reason="stop", reward={"score": 0.0}) for _ in range(2)]
    prompt = Prompt(uid="q1", task="math", prompt="Say nothing.")
    group = Group.for_prompt(prompt, samples=empty, start_step=5)
    assert group.model_step == 5
    assert _oldest_version(group) == 5  # was -1: an empty group looked stale at every step


def test_a_group_with_tokens_is_recorded_at_its_oldest_token_version() -> None:
    samples = [
        Sample([1], [7, 8], [-0.1, -0.2], [3, 4], finish_reason="stop", reward={"score": 1.0}),
        Sample([1], [9], [-0.3], [2], finish_reason="stop", reward={"score": 0.0}),
    ]
    group = Group.for_prompt(Prompt(uid="q2", task="math", prompt="Go."), samples=samples)
    assert _oldest_version(group) == 2
