"""The chaos suite's short mixed-fault run: kill -9 of producers, the trainer, the
feeder, the judge worker, the archiver, an engine actor and redis-server, and a producer
stopped past claim_idle_ms, under a supervisor that restarts what exits. Nothing lost,
nothing trained twice with both steps committed, no staleness violation, every trained
group archived exactly once, and the run finishes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.heavy]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(420)
def test_a_mixed_fault_run_loses_nothing_and_finishes(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    done = subprocess.run(
        [sys.executable, "-m", "chaos.run", "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    result = orjson.loads((out / "report.json").read_bytes())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert result["finished"] is True
    assert result["lost"] == 0
    assert result["trained_twice_both_committed"] == 0
    assert result["staleness_violations"] == 0
    # every fed prompt is in exactly one row
    assert sum(result["rows"].values()) == result["prompts"] > 0
    # and faults really happened, the supervisor restarting what they killed
    assert sum(result["faults"].values()) >= 5
    assert result["restarts"]["redis"] >= 1 or "kill -9 redis-server" not in result["faults"]
    # the archive (read back with pyarrow): every committed group in it exactly once
    archive = result["archive"]
    assert result["faults"].get("kill -9 archive", 0) >= 1, result["faults"]
    assert archive["drained"] is True
    assert archive["trained_groups"] > 0
    assert archive["archived_once"] == archive["trained_groups"], archive
    assert archive["archived_twice"] == 0, archive
    assert archive["trained_not_archived"] == 0, archive
