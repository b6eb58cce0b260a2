"""bench/learning_real.py at its smoke size: smollm2-135m on arithmetic for one step through
rollstream (sync: hf engines in Ray actors, a producer, the reference trainer, the weights
to the engines) and through the plain loop, each evaluated greedily on 8 held-out prompts,
one weight sync full against LoRA, its JSON and plot written and gathered by run_all. No
learning is asserted here (one step teaches nothing measurable): the benchmark's full run
is for that. About 8 minutes on 2 cores: the engines' CPUs generate 64 samples of a 135M
model, the trainer takes a step on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import require

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.heavy]

require("gguf", "real-model", load=False)
require("transformers", "hf", load=False)

REPO = Path(__file__).resolve().parents[2]


def bench(results: Path, *args: str, timeout: float) -> str:
    env = {**os.environ, "ROLLSTREAM_BENCH_RESULTS": str(results)}
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(2400)
def test_the_real_model_benchmark_at_smoke_size(tmp_path: Path) -> None:
    bench(tmp_path, "bench/learning_real.py", "--quick", timeout=2200)
    report = json.loads((tmp_path / "learning_real.json").read_text())
    assert 0.0 <= report["base_accuracy"] <= 1.0
    assert report["target"] == pytest.approx(report["base_accuracy"] + 0.2)
    runs = {r["way"]: r for r in report["runs"]}
    assert set(runs) == {"sync", "plain"}
    for way, run in runs.items():
        assert run["steps"] == 1, way
        assert run["curve"] and all(0.0 <= acc <= 1.0 for _, _, acc in run["curve"]), way
        assert run["samples_per_s"] > 0, way
    full, lora = report["syncs"]
    assert (full["way"], lora["way"]) == ("full", "lora r8")
    assert 0 < lora["bytes"] <= 0.02 * full["bytes"]  # an adapter-only sync: under 2% of the bytes
    assert all(s["send_s"] > 0 and s["apply_s"] > 0 for s in (full, lora))
    assert (tmp_path / "learning_real.png").stat().st_size > 10_000
    table = bench(tmp_path, "bench/run_all.py", "--only", timeout=120)  # gathers what is there
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert set(latest["learning_real"]["ways"]) == {"sync", "plain"}
    assert "learning_real.sync.accuracy" in table
