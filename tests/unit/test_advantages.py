"""Group advantages against numbers worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollstream.consumer.advantages import (
    ADVANTAGE_ESTIMATORS,
    batch_advantages,
    dr_grpo_advantages,
    group_advantages,
    group_scores,
    grpo_advantages,
    rloo_advantages,
)
from rollstream.shared.records import Group, Prompt, Sample

EPS = 1e-6


def group(*scores: float | None, uid: str = "u") -> Group:
    return Group.for_prompt(
        Prompt(uid=uid, task="math", prompt="q"),
        samples=[
            Sample([1], [2, 3], [-0.5, -0.5], [0, 0], "stop", {} if s is None else {"score": s})
            for s in scores
        ],
    )


def test_grpo_two_samples_unbiased_std() -> None:
    # mean 0.5; unbiased std sqrt(((1 - 0.5)² + (0 - 0.5)²) / (2 - 1)) = sqrt(0.5)
    expected = [0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)]
    assert grpo_advantages([1.0, 0.0], eps=EPS) == pytest.approx(expected, rel=1e-12)


def test_grpo_two_samples_population_std() -> None:
    # population std sqrt(((0.5)² + (0.5)²) / 2) = 0.5: advantages ±0.5 / (0.5 + eps), about ±1
    expected = [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)]
    assert grpo_advantages([1.0, 0.0], eps=EPS, std="population") == pytest.approx(expected, rel=1e-12)


def test_grpo_three_samples_and_eps() -> None:
    # rewards 0, 1, 2: mean 1; unbiased std sqrt((1 + 0 + 1) / 2) = 1
    assert grpo_advantages([0.0, 1.0, 2.0], eps=0.5) == pytest.approx([-1 / 1.5, 0.0, 1 / 1.5])
    # population std sqrt(2 / 3)
    pop = math.sqrt(2 / 3)
    assert grpo_advantages([0.0, 1.0, 2.0], eps=0.0, std="population") == pytest.approx(
        [-1 / pop, 0.0, 1 / pop]
    )


def test_dr_grpo_is_reward_minus_mean() -> None:
    assert dr_grpo_advantages([1.0, 0.0]) == pytest.approx([0.5, -0.5])
    # mean of 0, 0, 3 is 1
    assert dr_grpo_advantages([0.0, 0.0, 3.0]) == pytest.approx([-1.0, -1.0, 2.0])


def test_rloo_leaves_each_sample_out_of_its_baseline() -> None:
    # 0 - (1 + 2) / 2 = -1.5; 1 - (0 + 2) / 2 = 0; 2 - (0 + 1) / 2 = 1.5
    assert rloo_advantages([0.0, 1.0, 2.0]) == pytest.approx([-1.5, 0.0, 1.5])
    # two samples: each one's baseline is the other: 1 - 0, 0 - 1
    assert rloo_advantages([1.0, 0.0]) == pytest.approx([1.0, -1.0])
    # 1 - (0 + 0 + 0) / 3 = 1; 0 - (1 + 0 + 0) / 3 = -1/3
    assert rloo_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("rewards", [[0.7], [0.1, 0.1, 0.1], [1.0, 1.0], []])
def test_no_signal_gives_exact_zeros(estimator: str, rewards: list[float]) -> None:
    for eps in (0.0, EPS):
        adv = group_advantages(rewards, estimator, eps=eps)  # type: ignore[arg-type]
        assert adv.shape == (len(rewards),)
        assert not np.isnan(adv).any()
        assert not adv.any()


def test_group_advantages_dispatches_and_refuses_unknown_names() -> None:
    assert group_advantages([1.0, 0.0], "rloo") == pytest.approx([1.0, -1.0])
    assert group_advantages([1.0, 0.0], "dr_grpo") == pytest.approx([0.5, -0.5])
    assert group_advantages([1.0, 0.0], "grpo", std="population", eps=0.0) == pytest.approx([1.0, -1.0])
    with pytest.raises(ValueError, match="allowed: grpo, dr_grpo, rloo"):
        group_advantages([1.0, 0.0], "ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allowed: unbiased, population"):
        grpo_advantages([1.0, 0.0], std="sample")  # type: ignore[arg-type]


def test_non_finite_rewards_are_refused() -> None:
    with pytest.raises(ValueError, match="reward of sample 1 is nan"):
        grpo_advantages([0.0, float("nan")])
    with pytest.raises(ValueError, match="1-D"):
        dr_grpo_advantages([[0.0, 1.0]])


def test_group_scores_count_a_missing_score_as_given() -> None:
    g = group(1.0, None, 0.25)
    assert group_scores(g).tolist() == [1.0, 0.0, 0.25]
    assert group_scores(g, missing=-1.0).tolist() == [1.0, -1.0, 0.25]


def test_batch_advantages_baseline_per_group_in_sample_order() -> None:
    groups = [group(1.0, 0.0, uid="a"), group(0.5, uid="b"), group(0.0, 0.0, 3.0, uid="c")]
    # a: mean 0.5 -> 0.5, -0.5; b: one sample -> 0; c: mean 1 -> -1, -1, 2
    assert batch_advantages(groups, "dr_grpo").tolist() == pytest.approx([0.5, -0.5, 0.0, -1.0, -1.0, 2.0])
    assert batch_advantages([], "grpo").shape == (0,)
