"""`make gpu-check` on this CPU machine, in its tiny configuration: every part runs (each
in a process of its own), the report says whether there is a GPU, and what the CPU can
measure is measured: decode ratios, every file transport exact, learning steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import require

torch = require("torch", "hf")
require("transformers", "hf")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.heavy
def test_the_gpu_check_runs_clean_on_a_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    command = [
        sys.executable,
        str(ROOT / "bench" / "gpu_check.py"),
        "--tiny",
        "--timeout",
        "300",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"env", "decode", "transports", "learning"}
    gpu = torch.cuda.is_available()
    assert (report["env"]["gpu"] == "no GPU") == (not gpu)
    assert ("no GPU" in done.stdout) == (not gpu)
    decode = report["decode"]["cpu:tiny"]
    assert decode["engine_tokens_per_s"] > 0 and decode["bare_tokens_per_s"] > 0
    assert decode["engine_over_bare"] > 0 and "thread_hop_added_ms" in decode["step_ms"]
    ways = report["transports"]["cpu:tiny"]["ways"]
    assert {"safetensors (today)", "file disk", "file shm", "file shm changed", "collective"} <= set(ways)
    assert all(w["exact"] for w in ways.values()), ways
    from rollstream.shared.transport_auto import shm_available

    assert ({"shm", "shm changed"} <= set(ways)) == shm_available()
    learning = report["learning"]["cpu"]
    assert learning["steps"] == 3 and learning["seconds"] > 0
    assert ("cuda" in report["learning"]) == gpu


def test_the_parts_option_is_not_handed_to_the_parts_in_either_form() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "bench"))
    # `--parts decode` left "decode" behind for each part's child, which refused it
    argv = ["--parts", "decode", "--n", "32", "--parts=env", "--repeats", "1"]
    assert gpu_check.without_option(argv, "--parts") == ["--n", "32", "--repeats", "1"]
    child = gpu_check.parse_args(gpu_check.without_option(argv, "--parts"))
    assert child.n == 32
