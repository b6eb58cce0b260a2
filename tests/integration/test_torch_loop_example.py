"""examples/torch_loop.py, the PyTorch loop docs/integrations.md shows, run as its users run it
(settings from ROLLSTREAM_* variables) against producers on hf engines in Ray actors: it
trains its steps on the run's groups, commits each, and the engines end on weights it
published. Heavy: Ray, the engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.helpers import require, wait_for

pytestmark = [pytest.mark.heavy, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]

require("torch", "hf", load=False)
require("transformers", "hf", load=False)

from rollstream.cli.status import run_status
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings
from tests.hf_fixtures import save_model
from tests.trl_fixtures import TASK, Pipeline, pipeline_settings, word_prompts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pipeline(
    redis_server: EmbeddedRedis, ray_local: None, run_name: str, tmp_path: Path
) -> Iterator[Pipeline]:
    model_dir = save_model(tmp_path / "model", seed=3)
    settings = pipeline_settings(redis_server.url, run_name, model_dir, tmp_path / "weights", n=4, batch=2)
    open_buffer(redis.Redis.from_url(redis_server.url), settings, "feeder").feed(word_prompts(8))
    pipe = Pipeline(settings).start()
    yield pipe
    pipe.stop()


def environment(settings: Settings) -> dict[str, str]:
    """The settings as ROLLSTREAM_* variables: sections and lists as JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    for name, value in settings.model_dump(mode="json").items():
        env[f"ROLLSTREAM_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return {**env, "PYTHONPATH": str(ROOT)}


def test_the_example_loop_trains_commits_and_publishes(pipeline: Pipeline, tmp_path: Path) -> None:
    settings = pipeline.settings
    client = redis.Redis.from_url(settings.redis.url)
    control = RunControl(client, Keys(settings.run))
    base = pipeline.digests()[0]["tensors"]

    done = subprocess.run(
        [sys.executable, "examples/torch_loop.py", "--model", settings.engines.hf.model, "--steps", "2"],
        cwd=ROOT, env=environment(settings), capture_output=True, text=True, timeout=400,
    )  # fmt: skip

    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "step 1: 2 groups" in done.stdout and "step 2: 2 groups" in done.stdout
    assert control.train_step() == 2 and control.model_step() == 2
    got = run_status(client, Keys(settings.run)).accounts[TASK]
    assert got.trained == 4 and got.lost == 0
    # the engines moved to the loop's last weights
    engine = wait_for(lambda: (d := pipeline.digests()[0])["model_step"] == 2 and d, timeout=60)
    assert engine["tensors"] != base
    pipeline.check()
