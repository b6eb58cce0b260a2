"""bench/scale.py's simulated fleet at a tiny size, so that it cannot rot: the 2-producer
base and a fleet of real producers in bench/scale_fleet.py processes in the same run, with
Redis CPU per group, its ratio to the base, and event-to-live weight-sync times."""

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


def test_a_small_fleet_against_two_producers(tmp_path: Path) -> None:
    command = [
        sys.executable, "bench/scale.py", "--producers", "2", "--fleet", "4x4",
        "--fleet-processes", "2", "--long-producers", "0", "--warmup-s", "1", "--window-s", "2",
        "--windows", "2", "--sync-interval", "2",
    ]  # fmt: skip
    env = {**os.environ, "ROLLSTREAM_BENCH_RESULTS": str(tmp_path)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    scale = json.loads((tmp_path / "scale.json").read_text())
    fleet = scale["scaling"]["4x4"]
    assert (fleet["producers"], fleet["engines"], fleet["processes"]) == (4, 4, 2)
    assert fleet["groups"] > 0 and fleet["redis_cpu_ms_per_group"] > 0
    assert scale["redis_cpu_per_group_vs_2"]["2"] == 1.0 and scale["redis_cpu_per_group_vs_2"]["4x4"] > 0
    # every producer of the fleet reported each weight sync it followed (a sync every 2 steps)
    assert fleet["sync_event_to_live_ms"]["n"] >= 4 and fleet["sync_event_to_live_ms"]["p99"] >= 0
    assert 0 < fleet["redis_idle_busy"] < 1 and 0 < fleet["redis_busy"] < 1


def test_the_fleet_against_two_producers_at_equal_producer_rates(tmp_path: Path) -> None:
    command = [
        sys.executable, "bench/scale_equal_rate.py", "--fleet", "4x4", "--time-compression", "0.4",
        "--repeats", "1", "--warmup-s", "1", "--window-s", "2",
    ]  # fmt: skip
    env = {**os.environ, "ROLLSTREAM_BENCH_RESULTS": str(tmp_path)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "scale_equal_rate.json").read_text())
    two, fleet = result["runs"]
    assert (two["setup"], two["producers"], fleet["setup"], fleet["producers"]) == ("2", 2, "4x4", 4)
    # engine-bound: a producer's rate is its engine's, whether 2 or 4 of them run
    assert 0.5 < fleet["groups_per_s_per_producer"] / two["groups_per_s_per_producer"] < 2
    assert result["cpu_per_group_vs_2"] == [fleet["redis_cpu_ms_per_group"] / two["redis_cpu_ms_per_group"]]
    assert two["redis_commands_per_group"]["xadd"][0] > 0  # the round trips per group it reports
