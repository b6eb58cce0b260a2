"""bench/trl_rollstream.py at its smoke size: TRL's GRPOTrainer alone and with rollstream's
rollout function, a few steps each on the reverse task, its JSON written and run_all
gathering its ratios. No speed is asserted (the benchmark's output is for that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import require

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.heavy]

require("trl", "trl", load=False)
REPO = Path(__file__).resolve().parents[2]


def bench(results: Path, *args: str) -> str:
    env = {**os.environ, "ROLLSTREAM_BENCH_RESULTS": str(results)}
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=500
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(600)
def test_trl_benchmark_at_smoke_size(tmp_path: Path) -> None:
    out = bench(tmp_path, "bench/trl_rollstream.py", "--quick")
    report = json.loads((tmp_path / "trl_rollstream.json").read_text())
    runs = {r["way"]: r for r in report["runs"]}
    assert set(runs) == {"trl", "trl+rollstream"}
    for way, run in runs.items():
        assert run["steps"] == report["steps"] == 4, way
        assert len(run["reward_by_step"]) == len(run["seconds_by_step"]) == 4, way
        assert run["seconds_by_step"] == sorted(run["seconds_by_step"]), way
        assert run["samples"] == 4 * 8 * 8 and run["samples_per_s"] > 0, way
        assert all(0.0 <= r <= 1.0 for r in run["reward_by_step"]), way
    assert report["ratios"]["samples_per_s"] == pytest.approx(
        runs["trl+rollstream"]["samples_per_s"] / runs["trl"]["samples_per_s"]
    )
    assert "rollstream / trl" in out

    table = bench(tmp_path, "bench/run_all.py", "--only")  # runs nothing, gathers what is there
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["trl_rollstream"]["ratios"] == report["ratios"]
    assert "trl_rollstream.samples_per_s" in table
