"""The benchmarks at their smoke sizes, as they run from ``make bench``: they finish,
and what they check along the way holds (every group arrives, nothing is trained past
the staleness bound). No timing is asserted: speed lives in the benchmarks' output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.shared import codec

# a benchmark at smoke size: the heavy tier (make test-all and CI), so that make test answers in minutes
pytestmark = [pytest.mark.integration, pytest.mark.heavy]

REPO = Path(__file__).resolve().parents[2]


def bench(results: Path, *args: str) -> str:
    env = {**os.environ, "ROLLSTREAM_BENCH_RESULTS": str(results)}
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_buffer_pipeline_and_summary_at_smoke_size(tmp_path: Path) -> None:
    bench(tmp_path, "bench/buffer.py", "--quick")  # raises unless every token reached the consumer
    buffer = json.loads((tmp_path / "buffer.json").read_text())
    assert buffer["ours_groups_per_s"] > 0 and buffer["raw_groups_per_s"] > 0
    for row in buffer["memory_sweep"]:  # ours stores what raw stores, give or take its counters
        assert abs(row["ours_bytes"] / row["raw_bytes"] - 1) < 0.02, row

    bench(tmp_path, "bench/pipeline.py", "--quick", "--only", "k=8 partial")
    pipeline = json.loads((tmp_path / "pipeline.json").read_text())
    (run,) = pipeline["runs"]
    assert run["groups"] > 0 and run["staleness_violations"] == 0
    assert sum(run["staleness"].values()) == run["groups"]
    assert max(int(k) for k in run["staleness"]) < pipeline["runs"][0]["staleness_bound"]

    bench(tmp_path, "bench/durability.py", "--quick")  # both servers carried every group through
    durability = json.loads((tmp_path / "durability.json").read_text())
    assert durability["ratio_always_vs_everysec"]["n"] == 1
    assert durability["ratio_wait_vs_no_wait"]["n"] == 1  # WAIT for the replica vs not, one run

    bench(tmp_path, "bench/summary.py", "--quick")  # both ways decode; the trainer read every group
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0 < summary["bytes_overhead"] < 0.01 and summary["summary_chars_max"] <= codec.SUMMARY_MAX

    # runs nothing (each benchmark above ran at its smoke size; the others have smoke tests of
    # their own or run in make bench only), gathers and prints what is there
    table = bench(tmp_path, "bench/run_all.py", "--only")
    assert "buffer.ratio_vs_raw" in table and "pipeline.staleness_violations" in table
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["pipeline"]["staleness_violations"] == 0
    assert latest["buffer"]["ratio_vs_raw"] == buffer["ratio_vs_raw"]
    assert "durability.always_vs_everysec" in table
    assert "summary.hot_path_overhead" in table


def test_the_archive_benchmark_at_smoke_size(tmp_path: Path) -> None:
    bench(tmp_path, "bench/archive.py", "--quick")  # every commit acked; the archiver wrote files
    archive = json.loads((tmp_path / "archive.json").read_text())
    assert archive["archived_files"] > 0 and "step_overhead" in archive["archiving"]
