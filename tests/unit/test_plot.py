"""`rollstream plot`: a run's reward, staleness and throughput drawn from the trainer's
TensorBoard figures (--log-to tensorboard) into a PNG."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import require

require("tensorboard", "tensorboard")
require("matplotlib", "bench")

from rollstream.cli.plot import plot, read_scalars
from rollstream.consumer.tracking import open_loggers, step_figures
from rollstream.shared.errors import InputError


def logged_run(logdir: Path, steps: int = 12) -> None:
    trackers = open_loggers("tensorboard", logdir)
    for step in range(1, steps + 1):
        scores = [min(1.0, step / steps), 0.0, 1.0, 0.5]
        figures = step_figures(0.5, 0.1, 4, scores, {step % 3: 4}, 0)
        if step % 4 == 0:
            figures["eval/heldout/accuracy/mean@8"] = step / steps
        trackers.log(step, figures)
    trackers.close()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_the_plot_draws_the_logged_figures(tmp_path: Path) -> None:
    logged_run(tmp_path / "tb")
    scalars = read_scalars(tmp_path / "tb")
    assert len(scalars["reward/mean"]) == 12 and len(scalars["eval/heldout/accuracy/mean@8"]) == 3
    path = plot(tmp_path / "tb", tmp_path / "out" / "run.png", stale_threshold=2)
    assert png_size(path) == (1600, 450)


def test_a_folder_without_figures_is_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such folder"):
        read_scalars(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="was the trainer run with --log-to tensorboard"):
        read_scalars(tmp_path / "empty")


def test_rollstream_plot_writes_the_png_beside_the_logs(tmp_path: Path) -> None:
    logged_run(tmp_path / "runs" / "exp1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    done = subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", "--run", "exp1", "plot"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert png_size(tmp_path / "runs" / "exp1" / "run.png")[0] > 0
    assert "reward, staleness and throughput of runs/exp1" in done.stdout
