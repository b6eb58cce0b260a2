"""``rollstream demo`` as a user runs it: the learning run (hf engines in Ray, the reverse
task's model), cut short, with its JSON summary (the fields the simulated demo has, and
what the model learned) and its plot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.heavy]

SIM_FIELDS = (
    "steps", "groups_trained", "groups_per_s", "engine_busy", "trainer_idle", "staleness",
    "staleness_violations", "reward_mean", "seconds", "prompts_fed", "prompts_trained", "prompts_waiting",
    "prompts_filtered", "prompts_expired", "prompts_dead", "prompts_lost",
)  # fmt: skip


@pytest.mark.timeout(300)
def test_the_learning_demo_reports_per_step_rewards_and_evals(tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    args = ["demo", "--steps", "30", "--eval-every", "15", "--plot", str(plot), "--json"]
    command = [sys.executable, "-m", "rollstream.cli.main", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = orjson.loads(result.stdout)  # nothing but the JSON on stdout
    for field in SIM_FIELDS:
        assert field in summary, field
    assert summary["steps"] == len(summary["reward_by_step"]) == 30
    assert summary["groups_trained"] == summary["prompts_trained"] == 30 * 8
    assert summary["prompts_lost"] == 0 and summary["staleness_violations"] == 0
    assert max(int(k) for k in summary["staleness"]) <= 2  # async, max_staleness 2
    assert 0 < summary["engine_busy"] <= 1
    assert all(0 <= r <= 1 for r in summary["reward_by_step"])
    assert summary["eval_accuracy"] is not None and 0 <= summary["eval_accuracy"] <= 1
    assert sorted(summary["eval_by_step"], key=int) == ["15", "30"]
    assert summary["plot"] == str(plot) and plot.stat().st_size > 10_000


def test_an_unknown_recipe_is_refused_naming_the_choices() -> None:
    command = [sys.executable, "-m", "rollstream.cli.main", "demo", "--recipe", "ppo"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "invalid choice: 'ppo'" in result.stderr and "async_decoupled" in result.stderr
