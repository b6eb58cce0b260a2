"""`make demo` stops on the held-out greedy accuracy (>= 0.9), not on the training
reward (which reached its target in runs whose model then scored 0.75 held out), and its
plot names the target and chance lines in the legend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollstream.cli import demo
from rollstream.consumer.evaluation import Evaluator
from rollstream.recipes import learning
from rollstream.shared.settings import load_settings

ACCURACY = "eval/greedy/score/mean@1"


def result_with(rewards: list[float], evals: dict[int, float]) -> learning.LearnResult:
    result = learning.LearnResult("async_decoupled", 0, load_settings(run="demo-stop"))
    for i, reward in enumerate(rewards, start=1):
        metrics = {ACCURACY: evals[i], "eval/heldout/score/mean@8": reward} if i in evals else {}
        result.steps.append(learning.StepRecord(i, reward, float(i), {0: 8}, eval=metrics))
    return result


def evaluator(every: int = 25) -> Evaluator:
    return Evaluator(coordinator=None, sets=[], every=every)  # type: ignore[arg-type]


def test_a_training_reward_at_target_with_a_held_out_accuracy_below_it_goes_on() -> None:
    watch = evaluator()
    result = result_with([0.95] * 25, {25: 0.75})
    assert result.steps_to(learning.TARGET) is not None  # where the demo used to stop
    assert learning.should_stop(result, watch, None, learning.ACCURACY_TARGET) is False
    # and the held-out accuracy is looked at more often from now on
    assert watch.every == learning.CLOSE_EVAL_EVERY


def test_the_held_out_accuracy_at_target_stops_it() -> None:
    watch = evaluator()
    result = result_with([0.5] * 25 + [0.95] * 5, {25: 0.75, 30: 0.94})
    assert learning.should_stop(result, watch, None, learning.ACCURACY_TARGET) is True
    assert learning.steps_to_accuracy(result) == 30


def test_before_the_training_reward_gets_there_the_cadence_stays() -> None:
    watch = evaluator()
    assert learning.should_stop(result_with([0.3] * 25, {25: 0.1}), watch, None, 0.9) is False
    assert watch.every == 25


def test_the_demo_stops_on_the_accuracy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: dict[str, Any] = {}

    class Asked(Exception):
        pass

    def run_learning(recipe: Any, **options: Any) -> learning.LearnResult:
        asked.update(options)
        raise Asked

    monkeypatch.setattr(learning, "run_learning", run_learning)
    monkeypatch.setattr(demo.reverse, "parameter_count", lambda model: 0)
    monkeypatch.setattr(demo.reverse, "make_model", lambda seed: None)
    with pytest.raises(Asked):
        demo.learning_demo(50, as_json=True, plot=None)
    assert asked["stop_at_accuracy"] == learning.ACCURACY_TARGET == 0.9
    assert asked.get("stop_at") is None


def test_the_plot_names_the_target_and_chance_lines() -> None:
    pytest.importorskip("matplotlib")
    figure = demo._figure(result_with([0.5] * 30, {15: 0.5, 30: 0.94}))
    try:
        for ax in figure.axes:
            labels = [t.get_text() for t in ax.get_legend().get_texts()]
            assert "target: greedy accuracy 0.9" in labels
            assert any(label.startswith(f"chance: reward {demo.reverse.CHANCE:.2f}") for label in labels)
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)
