"""bench/compare_commits.py at a smoke size: two versions of the replay buffer's hot path
side by side, each run's processes importing rollstream from their own tree. No timing is
asserted: speed lives in the benchmark's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# a benchmark at smoke size: the heavy tier (make test-all and CI), so that make test answers in minutes
pytestmark = [pytest.mark.integration, pytest.mark.heavy]

REPO = Path(__file__).resolve().parents[2]


def test_the_last_commit_against_the_working_tree_at_smoke_size(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    args = ["HEAD", ".", "--groups", "32", "--repeats", "2", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "bench/compare_commits.py", *args],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )  # a child that imported rollstream from the other tree, or lost a group, fails the run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["repeat"] for run in runs] == [1, 2]
    for way in ("raw", "old", "new"):
        assert all(run[way] > 0 and run[f"{way}_cpu_us"] > 0 for run in runs), way
    assert "new / old" in done.stdout and "CPU µs per group" in done.stdout
