"""Group advantages: how much better each response was than its siblings.

Every sample of a group answers the same prompt, so the group itself is the baseline
(no value model). Three estimators, by the names the papers and trainers use:

- ``grpo``: ``(r - mean) / (std + eps)`` (DeepSeekMath's GRPO). ``std`` is the unbiased
  (Bessel-corrected, n - 1) standard deviation by default, because that is what the
  reference implementations compute (``torch.std`` in TRL's GRPOTrainer, verl's
  ``compute_grpo_outcome_advantage`` and OpenRLHF); ``std="population"`` divides by n
  instead. ``eps`` defaults to verl's 1e-6 (TRL uses 1e-4).
- ``dr_grpo``: ``r - mean``, no division by the std (Dr. GRPO, "Understanding R1-Zero-
  Like Training"): the std favours groups whose rewards barely differ.
- ``rloo``: ``r_i - mean of the other n - 1 rewards`` (REINFORCE leave-one-out, Ahmadian
  et al.): an unbiased baseline, equal to ``n / (n - 1) * (r_i - mean)``.

A group of one sample, or one whose rewards are all equal, carries no signal: its
advantages are exactly zero for every estimator (never NaN, whatever ``eps``), so a
trainer can tell "nothing to learn" by ``not advantages.any()``.

Pure numpy: a trainer without torch uses it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeAlias, get_args

import numpy as np
import numpy.typing as npt

from rollstream.shared.algorithm_settings import AdvantageEstimator, StdKind  # the names settings validate
from rollstream.shared.records import Group

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "batch_advantages",
    "dr_grpo_advantages",
    "group_advantages",
    "group_scores",
    "grpo_advantages",
    "rloo_advantages",
]

ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
_STD_KINDS: tuple[str, ...] = get_args(StdKind)

Rewards: TypeAlias = npt.NDArray[np.float64]


def group_scores(group: Group, missing: float = 0.0) -> Rewards:
    """Each sample's ``reward["score"]`` in sample order; a sample without a score counts
    as ``missing`` (0 by default, as a failed judgement)."""
    return np.array([missing if s.score is None else s.score for s in group.samples], dtype=np.float64)


def _rewards(rewards: npt.ArrayLike) -> Rewards:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be one value per sample (1-D), got shape {r.shape}")
    bad = np.flatnonzero(~np.isfinite(r))
    if len(bad):
        raise ValueError(f"reward of sample {int(bad[0])} is {r[bad[0]]}: rewards must be finite numbers")
    return r


def _no_signal(r: Rewards) -> bool:
    return len(r) < 2 or bool(np.all(r == r[0]))


def grpo_advantages(rewards: npt.ArrayLike, eps: float = 1e-6, std: StdKind = "unbiased") -> Rewards:
    """``(r - mean) / (std + eps)`` over the group; ``std`` "unbiased" (n - 1, as
    TRL and verl) or "population" (n)."""
    if std not in _STD_KINDS:
        raise ValueError(f"std is {std!r}; allowed: {', '.join(_STD_KINDS)}")
    r = _rewards(rewards)
    if _no_signal(r):
        return np.zeros_like(r)
    spread = float(np.std(r, ddof=1 if std == "unbiased" else 0))
    out: Rewards = (r - r.mean()) / (spread + eps)
    return out


def dr_grpo_advantages(rewards: npt.ArrayLike) -> Rewards:
    """``r - mean`` over the group (Dr. GRPO: no std normalisation)."""
    r = _rewards(rewards)
    if _no_signal(r):
        return np.zeros_like(r)
    out: Rewards = r - r.mean()
    return out


def rloo_advantages(rewards: npt.ArrayLike) -> Rewards:
    """``r_i - (sum of the others) / (n - 1)``: each sample's baseline leaves it out."""
    r = _rewards(rewards)
    if _no_signal(r):
        return np.zeros_like(r)
    out: Rewards = r - (r.sum() - r) / (len(r) - 1)
    return out


def group_advantages(
    rewards: npt.ArrayLike,
    estimator: AdvantageEstimator = "grpo",
    *,
    eps: float = 1e-6,
    std: StdKind = "unbiased",
) -> Rewards:
    """The advantages of one group's rewards by ``estimator``; ``eps`` and ``std`` only
    matter to "grpo"."""
    if estimator == "grpo":
        return grpo_advantages(rewards, eps=eps, std=std)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards)
    if estimator == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"advantage estimator is {estimator!r}; allowed: {', '.join(ADVANTAGE_ESTIMATORS)}")


def batch_advantages(
    groups: Iterable[Group],
    estimator: AdvantageEstimator = "grpo",
    *,
    eps: float = 1e-6,
    std: StdKind = "unbiased",
    missing: float = 0.0,
) -> Rewards:
    """One advantage per sample of ``groups`` (each group its own baseline), flat, in the
    order of the groups and of their samples: the order ``consumer.tensors`` lays the
    samples out in."""
    parts = [group_advantages(group_scores(g, missing), estimator, eps=eps, std=std) for g in groups]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)
