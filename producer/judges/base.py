"""The judge protocol: what turns a group's responses into rewards.

A judge is pure: it reads the response texts (``sample.text``) and the ground
truth the prompt carries (``prompt.meta``) and returns one reward dict per
sample, each with at least a float "score". It does not touch the samples;
``apply_rewards`` does, so that a judge run in another process (an rq worker)
and one run in-process end the same way.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rollstream.shared.errors import RollstreamError
from rollstream.shared.records import Prompt, Sample

Reward = dict[str, float]


class JudgeError(RollstreamError):
    """A judge could not score a group: it failed, timed out, was cancelled, or answered wrongly."""

    def __init__(self, what: str, job_id: str | None = None) -> None:
        super().__init__(what)
        self.job_id = job_id


@runtime_checkable
class Judge(Protocol):
    def __call__(self, prompt: Prompt, samples: list[Sample]) -> list[Reward]: ...


def apply_rewards(samples: Sequence[Sample], rewards: Sequence[Mapping[str, Any]]) -> None:
    """Set each sample's reward, after checking that the judge answered one per sample with a score.

    Only "score" must be a finite number; other entries are kept as the judge
    gave them (they travel as JSON, so a custom judge may add text too).
    """
    if len(rewards) != len(samples):
        raise JudgeError(f"the judge returned {len(rewards)} rewards for {len(samples)} samples")
    checked: list[dict[str, Any]] = []
    for i, reward in enumerate(rewards):
        if not isinstance(reward, Mapping) or "score" not in reward:
            raise JudgeError(f"reward {i} has no 'score': {reward!r}")
        score = reward["score"]
        if not isinstance(score, numbers.Real) or not math.isfinite(score):
            raise JudgeError(f"reward {i} has a score that is not a finite number: {score!r}")
        checked.append({**reward, "score": float(score)})
    # all checked before any is set: a bad reward leaves the whole group untouched
    for sample, reward in zip(samples, checked, strict=True):
        sample.reward = reward


def ground_truth(prompt: Prompt, key: str = "answer") -> str:
    """The reference answer of a prompt as text; a JudgeError that names the prompt if it has none."""
    value = prompt.meta.get(key)
    if value is None:
        raise JudgeError(f"prompt {prompt.group_id} has no meta[{key!r}] to judge against")
    return str(value)
