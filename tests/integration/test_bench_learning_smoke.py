"""bench/learning.py at its smoke size, as ``make bench`` runs it: two recipes and the
plain-loop reference on one seed for a few steps each, its JSON and plot written, and
run_all gathering its ratios. No timing or learning is asserted here (the benchmark's
output and tests/integration/test_learning.py are for that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.heavy]

REPO = Path(__file__).resolve().parents[2]


def bench(results: Path, *args: str) -> str:
    env = {**os.environ, "ROLLSTREAM_BENCH_RESULTS": str(results)}
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(600)
def test_learning_benchmark_at_smoke_size(tmp_path: Path) -> None:
    bench(tmp_path, "bench/learning.py", "--quick")
    report = json.loads((tmp_path / "learning.json").read_text())
    assert set(report["recipes"]) == {"sync", "async_decoupled"}
    runs = {r["recipe"]: r for r in report["runs"]}
    for name, run in runs.items():
        assert 1 <= run["steps"] <= report["max_steps"], name
        assert len(run["reward_by_step"]) == len(run["seconds_by_step"]) == run["steps"]
        assert run["seconds_by_step"] == sorted(run["seconds_by_step"])
        # a run that stopped early reached the target at its last step
        if run["steps"] < report["max_steps"]:
            assert run["steps_to_target"] == run["steps"], name
    assert max(int(k) for k in runs["sync"]["staleness"]) == 0  # on-policy
    assert max(int(k) for k in runs["async_decoupled"]["staleness"]) <= 2
    assert report["reference_runs"][0]["steps"] >= 1
    assert (tmp_path / "learning.png").stat().st_size > 10_000

    table = bench(tmp_path, "bench/run_all.py", "--only")  # runs nothing, gathers what is there
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["learning"]["recipes"]["sync"]["reached"] == report["recipes"]["sync"]["reached"]
    if report["recipes"]["async_decoupled"]["steps_over_sync"]["n"]:
        assert "learning.async_decoupled.steps_over_sync" in table
