"""TRL's GRPOTrainer trains on groups made by rollstream's producers on hf engines in Ray
actors (consumer/integrations/trl.py), on the CPU with a tiny Llama built on the spot:
the run's account closes (every fed prompt trained, waiting or dropped, none lost, none
trained twice), the engines hold the trainer's weights after every step, tensor by
tensor, and a TRL process killed by its PID mid-run and started again from TRL's
checkpoint loses no group. Heavy: Ray, the engines, TRL (`make test-all`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.helpers import require, wait_for

pytestmark = [pytest.mark.heavy, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

torch = require("torch", "hf")
require("transformers", "hf", load=False)
with warnings.catch_warnings():  # TRL warns about the vLLM version beside it at import
    warnings.simplefilter("ignore")
    require("trl", "trl")

from rollstream.cli.status import run_status
from rollstream.consumer.weights import model_tensors
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RESUME, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.settings import Settings
from rollstream.shared.transports import tensor_digests
from tests.hf_fixtures import load_model, save_model
from tests.trl_child import PER_STEP, build, write_run
from tests.trl_fixtures import TASK, Pipeline, pipeline_settings, word_prompts

ROOT = Path(__file__).resolve().parents[2]
N = 4  # num_generations = tasks[].n


@pytest.fixture
def pipeline(
    redis_server: EmbeddedRedis, ray_local: None, run_name: str, tmp_path: Path
) -> Iterator[Pipeline]:
    model_dir = save_model(tmp_path / "model", seed=3)
    settings = pipeline_settings(
        redis_server.url, run_name, model_dir, tmp_path / "weights", n=N, batch=PER_STEP
    )
    pipe = Pipeline(settings).start()
    yield pipe
    pipe.stop()


def account(settings: Settings) -> Any:
    return run_status(redis.Redis.from_url(settings.redis.url), Keys(settings.run)).accounts[TASK]


def handed(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "handed.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_trl_trains_on_rollstream_groups_with_the_engines_on_its_weights(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    from transformers import TrainerCallback

    settings = pipeline.settings
    control = RunControl(redis.Redis.from_url(settings.redis.url), Keys(settings.run))
    steps = 3
    run_dir = tmp_path / "run"
    write_run(run_dir, settings, word_prompts(12), Path(settings.engines.hf.model), steps, save_steps=100)
    same: list[tuple[int, bool, int]] = []  # (step, engines hold the trainer's weights, tensors)

    class Compare(TrainerCallback):  # after rollstream's callback: its publish is done
        def on_step_end(self, args: Any, state: Any, ctl: Any, **kwargs: Any) -> None:
            step = control.model_step()
            engine = wait_for(lambda: (d := pipeline.digests()[0])["model_step"] == step and d, timeout=60)
            mine = tensor_digests(model_tensors(kwargs["model"]))
            theirs = engine["tensors"]
            same.append((state.global_step, all(theirs[k] == v for k, v in mine.items()), len(mine)))

    # Given a run whose producers serve hf engines in Ray actors, when TRL trains 3 steps on it
    trainer, _ = build(run_dir, callbacks=(Compare(),))
    before = tensor_digests(model_tensors(trainer.model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()

    # then each step trained on its own groups, committed after it
    lines = handed(run_dir)
    assert [line["global_step"] for line in lines] == [0, 1, 2]
    groups = [g for line in lines for g in line["groups"]]
    assert len(groups) == steps * PER_STEP == len(set(groups))
    assert control.train_step() == steps + 1  # step 1 is the trainer's first weights
    # the engines held the trainer's weights after every step, and those weights moved
    assert same == [(s, True, len(before)) for s in (1, 2, 3)]
    assert tensor_digests(model_tensors(trainer.model)) != before
    # and the account closes: everything fed trained, nothing lost or waiting
    got = account(settings)
    assert (got.fed, got.trained, got.lost, got.waiting, got.dropped, got.dead) == (6, 6, 0, 0, 0, 0)
    pipeline.check()


def test_a_killed_trl_process_restarted_from_its_checkpoint_loses_no_group(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    settings = pipeline.settings
    client = redis.Redis.from_url(settings.redis.url)
    control = RunControl(client, Keys(settings.run))
    steps = 5
    run_dir = tmp_path / "run"
    write_run(run_dir, settings, word_prompts(20), Path(settings.engines.hf.model), steps, save_steps=1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.trl_child", str(run_dir)]

    record = Keys(settings.run).adapter("trl")

    def in_flight() -> str | None:
        """The batch TRL waits for, fed and not made yet: the producers are paused."""
        batch = client.hget(record, "batch")
        status = None if batch is None else client.hget(Keys(settings.run).batch(batch.decode()), "status")
        return batch.decode() if status in (b"running", b"finalizing") else None

    # Given a TRL process training on the run, checkpointing every step, that pauses the run
    # after its step 2 (the producers leave the batch of step 3 unmade)
    first = subprocess.Popen([*command, "--pause-after", "2"], cwd=ROOT, env=env)
    try:
        # when it is killed (by its PID) waiting for that batch
        left = wait_for(lambda: first.poll() is not None or (control.paused() and in_flight()), timeout=300)
        assert first.poll() is None, f"the TRL process ended with {first.returncode} before the kill"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    committed_before = control.train_step()
    handed_before = {line["batch"] for line in handed(run_dir)}
    done_before = {
        b for b in handed_before if client.hget(Keys(settings.run).batch(b), "status") == b"finalized"
    }
    assert left not in handed_before
    saved = sorted(int(p.name.split("-")[1]) for p in (run_dir / "out").glob("checkpoint-*"))

    # and started again from its last checkpoint, the run resumed
    control.publish(RESUME)
    second = subprocess.run([*command, "--resume"], cwd=ROOT, env=env, timeout=600)
    assert second.returncode == 0

    # then no batch committed before the kill was handed to TRL again
    lines = handed(run_dir)
    after = [line for line in lines if line["pid"] != first.pid]
    assert after and not {line["batch"] for line in after} & done_before
    # the batch left in flight was the restart's first, made once the run went on (the
    # pause lands after step 2; a producer that saw it late leaves a later batch unmade)
    assert after[0]["batch"] == left and after[0]["global_step"] == saved[-1] >= 2
    # TRL trained its steps to the end, and the run committed a batch for each step it trained
    checkpoints = sorted(int(p.name.split("-")[1]) for p in (run_dir / "out").glob("checkpoint-*"))
    assert checkpoints[-1] == steps and control.train_step() > committed_before
    # every fed prompt is trained, none waiting, dropped or lost: the batch the dead process
    # had in flight was taken again, or had not been fed yet
    got = account(settings)
    assert got.lost == 0 and got.dead == 0 and got.dropped == 0 and got.waiting == 0
    assert got.fed == got.trained == PER_STEP * len({line["batch"] for line in lines})
    # and the engines hold the weights TRL ended with
    final = load_model(run_dir / "out" / f"checkpoint-{steps}")
    wait_for(lambda: pipeline.digests()[0]["model_step"] == control.model_step(), timeout=60)
    theirs = pipeline.digests()[0]["tensors"]
    assert all(theirs[k] == v for k, v in tensor_digests(model_tensors(final)).items())
    pipeline.check()
