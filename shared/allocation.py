"""How many groups each task contributes to a batch, and how many extra to schedule.

The split is the largest-remainder (Hamilton) method, as in XTuner's
producer: every task gets the floor of its exact quota, and the units left over
go one each to the largest fractional remainders, earlier tasks first on a tie.
The arithmetic is exact (fractions, not floats) so that equal weights give
equal remainders and the tie-break, not rounding noise, decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction


def allocate_batch_sizes(batch_size: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Split ``batch_size`` over the tasks in proportion to their weights; sums to batch_size.

    >>> allocate_batch_sizes(10, {"math": 1, "code": 1, "chat": 1})
    {'math': 4, 'code': 3, 'chat': 3}
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if not weights:
        raise ValueError("weights is empty: no task to allocate the batch to")
    for task, weight in weights.items():
        if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight of task {task!r} must be a finite number > 0, got {weight!r}")

    exact = {task: Fraction(weight) for task, weight in weights.items()}
    total = sum(exact.values())
    quotas = {task: batch_size * weight / total for task, weight in exact.items()}
    sizes = {task: math.floor(quota) for task, quota in quotas.items()}
    left = batch_size - sum(sizes.values())
    # sorted() is stable, so tasks with equal remainders keep their given order
    by_remainder = sorted(quotas, key=lambda task: quotas[task] - sizes[task], reverse=True)
    for task in by_remainder[:left]:
        sizes[task] += 1
    return sizes


def over_sample_budget(batch_size: int, threshold: float) -> int:
    """The extra groups to schedule beyond ``batch_size``: ceil(threshold * batch_size).

    The threshold is taken at its decimal value, so 0.7 of 10 is 7, not the 8
    that ``math.ceil(0.7 * 10)`` gives (the float product is 7.000000000000001).
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"over_sample_threshold must be a finite number >= 0, got {threshold!r}")
    return math.ceil(Fraction(repr(float(threshold))) * batch_size)
