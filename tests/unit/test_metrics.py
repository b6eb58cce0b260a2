from __future__ import annotations

import numpy as np
import pytest

from rollstream.consumer.metrics import bootstrap_metric, eval_metrics
from rollstream.shared.records import Group, Prompt, Sample


def group(uid: str, scores: list[float]) -> Group:
    samples = [Sample([1], [2], [0.0], [0], "stop", {"score": s}) for s in scores]
    return Group.for_prompt(Prompt(uid=uid, task="math", prompt="q"), samples=samples)


def test_eval_metrics_on_known_rewards() -> None:
    groups = [group("a", [1, 0, 1, 1]), group("b", [0, 0, 0, 1]), group("c", [1, 1, 1, 1])]
    m = eval_metrics("gsm", groups)
    assert m["eval/gsm/finished_task_count"] == 3
    assert m["eval/gsm/score/mean@4"] == pytest.approx((0.75 + 0.25 + 1.0) / 3)
    assert m["eval/gsm/score/std@4"] == pytest.approx((np.std([1, 0, 1, 1]) + np.std([0, 0, 0, 1]) + 0) / 3)
    assert m["eval/gsm/score/best@2"] >= m["eval/gsm/score/mean@4"] >= m["eval/gsm/score/worst@2"]
    assert m["eval/gsm/score/best@4"] >= m["eval/gsm/score/best@2"]
    assert "eval/gsm/score/best@8" not in m
    assert eval_metrics("gsm", groups) == m  # fixed seed: the same results give the same metrics


def test_bootstrap_best_of_n_matches_its_closed_form() -> None:
    # a task right half the time: the best of 2 draws with replacement is right 3/4 of the time
    ((best, _),) = bootstrap_metric([1, 0] * 4, 2, [np.max], n_bootstrap=4000)
    assert best == pytest.approx(0.75, abs=0.03)
