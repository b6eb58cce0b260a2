"""Evaluation metrics over groups: for each prompt (task) k responses with a score.

    eval/{name}/{metric}/mean@k    mean over tasks of the mean of their k scores
    eval/{name}/{metric}/std@k     mean over tasks of the std of their k scores
    eval/{name}/{metric}/best@n    mean over tasks of the bootstrapped expected best of n
    eval/{name}/{metric}/worst@n   ... and worst of n, for n = 2, 4, 8, ... <= k
    eval/{name}/finished_task_count

Bootstrap (Trinity-RFT's bootstrap_metric): 1,000 resamples of n scores with
replacement, fixed seed, so the same results give the same metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from rollstream.shared.records import Group

Reduce = Callable[[npt.NDArray[np.float64]], float]


def bootstrap_metric(
    data: Sequence[float],
    subset_size: int,
    reduce_fns: Sequence[Reduce],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """(mean, std) of each reduce function over ``n_bootstrap`` resampled subsets."""
    values = np.asarray(data, dtype=np.float64)
    rng = np.random.default_rng(seed)
    subsets = values[rng.integers(0, len(values), size=(n_bootstrap, subset_size))]
    out = []
    for fn in reduce_fns:
        stats = np.array([fn(row) for row in subsets])
        out.append((float(stats.mean()), float(stats.std())))
    return out


def eval_metrics(name: str, groups: Sequence[Group], metric: str = "score") -> dict[str, float]:
    per_task = [[float(s.reward[metric]) for s in g.samples if metric in s.reward] for g in groups]
    per_task = [scores for scores in per_task if scores]
    prefix = f"eval/{name}"
    out: dict[str, float] = {f"{prefix}/finished_task_count": float(len(per_task))}
    if not per_task:
        return out
    k = min(len(scores) for scores in per_task)
    out[f"{prefix}/{metric}/mean@{k}"] = float(np.mean([np.mean(s) for s in per_task]))
    out[f"{prefix}/{metric}/std@{k}"] = float(np.mean([np.std(s) for s in per_task]))
    n = 2
    while n <= k:
        best, worst = zip(*(bootstrap_metric(s, n, [np.max, np.min]) for s in per_task), strict=True)
        out[f"{prefix}/{metric}/best@{n}"] = float(np.mean([mean for mean, _ in best]))
        out[f"{prefix}/{metric}/worst@{n}"] = float(np.mean([mean for mean, _ in worst]))
        n *= 2
    return out
