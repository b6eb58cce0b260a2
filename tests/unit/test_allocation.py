"""Largest-remainder allocation of a batch over tasks, and the over-sample budget."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollstream.shared.allocation import allocate_batch_sizes, over_sample_budget


@pytest.mark.parametrize(
    ("batch_size", "weights", "expected"),
    [
        (10, {"math": 1.0}, {"math": 10}),
        (10, {"math": 1, "code": 1}, {"math": 5, "code": 5}),
        # three equal remainders of 1/3: the one left-over unit goes to the first task
        (10, {"math": 1, "code": 1, "chat": 1}, {"math": 4, "code": 3, "chat": 3}),
        (11, {"math": 1, "code": 1, "chat": 1}, {"math": 4, "code": 4, "chat": 3}),
        # order decides ties, not names
        (10, {"chat": 1, "code": 1, "math": 1}, {"chat": 4, "code": 3, "math": 3}),
        # quotas 3.69, 2.46, 1.23, 0.62: floors make 6, the 2 left go to a (.69) and d (.62)
        (8, {"a": 4.2, "b": 2.8, "c": 1.4, "d": 0.7}, {"a": 4, "b": 2, "c": 1, "d": 1}),
        (7, {"a": 0.5, "b": 0.3, "c": 0.2}, {"a": 4, "b": 2, "c": 1}),
        (1, {"a": 1, "b": 3}, {"a": 0, "b": 1}),
        (2, {"a": 1, "b": 1, "c": 1, "d": 1}, {"a": 1, "b": 1, "c": 0, "d": 0}),
        (0, {"a": 1, "b": 2}, {"a": 0, "b": 0}),
        # 0.1 + 0.2 style weights: exact arithmetic keeps the 1/3 remainders equal
        (10, {"a": 0.1, "b": 0.1, "c": 0.1}, {"a": 4, "b": 3, "c": 3}),
    ],
)
def test_allocation(batch_size: int, weights: dict[str, float], expected: dict[str, int]) -> None:
    sizes = allocate_batch_sizes(batch_size, weights)
    assert sizes == expected
    assert list(sizes) == list(weights)  # task order kept


@given(
    batch_size=st.integers(0, 10_000),
    weights=st.lists(st.floats(1e-3, 1e3, allow_nan=False), min_size=1, max_size=8),
)
def test_allocation_sums_exactly_and_stays_within_one_of_the_quota(
    batch_size: int, weights: list[float]
) -> None:
    named = {f"t{i}": w for i, w in enumerate(weights)}
    sizes = allocate_batch_sizes(batch_size, named)
    assert sum(sizes.values()) == batch_size
    total = sum(weights)
    for task, weight in named.items():
        quota = batch_size * weight / total
        assert math.floor(quota) - 1e-9 <= sizes[task] <= math.ceil(quota) + 1e-9


def test_allocation_is_deterministic() -> None:
    weights = {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}
    assert all(allocate_batch_sizes(100, weights) == {"a": 34, "b": 33, "c": 33} for _ in range(5))


@pytest.mark.parametrize(
    ("batch_size", "weights", "message"),
    [
        (-1, {"a": 1.0}, "batch_size must be >= 0"),
        (4, {}, "weights is empty"),
        (4, {"a": 1.0, "b": 0.0}, "weight of task 'b'"),
        (4, {"a": -1.0}, "weight of task 'a'"),
        (4, {"a": float("nan")}, "finite number > 0"),
        (4, {"a": float("inf")}, "finite number > 0"),
    ],
)
def test_allocation_refuses(batch_size: int, weights: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        allocate_batch_sizes(batch_size, weights)


@pytest.mark.parametrize(
    ("batch_size", "threshold", "budget"),
    [
        (10, 0.0, 0),
        (10, 0.2, 2),
        (10, 0.25, 3),
        (7, 0.5, 4),
        (30, 0.1, 3),  # math.ceil(0.1 * 30) would say 4
        (10, 0.7, 7),  # math.ceil(0.7 * 10) would say 8
        (0, 0.5, 0),
        (16, 1.0, 16),
        (16, 2, 32),
    ],
)
def test_over_sample_budget(batch_size: int, threshold: float, budget: int) -> None:
    assert over_sample_budget(batch_size, threshold) == budget


def test_over_sample_budget_refuses() -> None:
    with pytest.raises(ValueError, match="over_sample_threshold"):
        over_sample_budget(10, -0.1)
    with pytest.raises(ValueError, match="batch_size"):
        over_sample_budget(-1, 0.1)
