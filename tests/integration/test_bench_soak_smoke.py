"""bench/soak.py at a tiny size, so that it cannot rot: the full pipeline runs, every key of
the run is sampled, the verdict is written, and the dead-letter and filtered streams stay
at their caps (buffer.dead_maxlen / filtered_maxlen) while the run fills them past them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# a benchmark at smoke size: the heavy tier (make test-all and CI), so that make test answers in minutes
pytestmark = [pytest.mark.integration, pytest.mark.heavy]

REPO = Path(__file__).resolve().parents[2]
CAP = 5
NODE = 100  # MAXLEN ~ trims whole stream nodes (stream-node-max-entries 100)


def test_the_soak_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [
        sys.executable, "bench/soak.py", "--groups", "3000", "--sample-every", "300",
        "--dead-maxlen", str(CAP), "--filtered-maxlen", str(CAP), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verdict:" in done.stdout
    soak = json.loads(out.read_text())
    assert soak["groups"] >= 3000
    samples = soak["samples"]
    assert len(samples) >= 10 and [s["groups"] for s in samples] == sorted(s["groups"] for s in samples)
    keys = soak["verdict"]["keys"]
    for stream in ("rs:{soak}:prompts:math", "rs:{soak}:groups:math", "rs:{soak}:progress"):
        assert stream in keys, sorted(keys)
    # one prompt in ten is filtered (~330 here): the stream holds less than its cap + a node
    assert max(s["keys"].get("rs:{soak}:filtered", 0) for s in samples) < CAP + NODE
    assert keys["rs:{soak}:filtered"]["cap"] == CAP
    assert soak["verdict"]["memory_last_third_over_first"] > 0
