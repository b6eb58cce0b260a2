"""``rollstream train --eval-file``: the reference trainer evaluates held-out prompts
through the coordinator every --eval-every steps and logs the metrics with the step;
a bad eval file stops it before anything runs, naming the line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from rollstream.shared.embedded import EmbeddedRedis
from tests.integration.test_cli import write_jsonl

pytestmark = pytest.mark.integration


def env_for(url: str, run: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=url,
        ROLLSTREAM_RUN=run,
        ROLLSTREAM_TASKS=orjson.dumps([{"name": "math", "n": 2}]).decode(),
        ROLLSTREAM_ROLLOUT__BATCH_SIZE="4",
        ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="100",
        ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS="50",
        ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
        ROLLSTREAM_PRODUCER__HEARTBEAT_S="0.2",
    )
    return env


@pytest.mark.timeout(180)
def test_train_logs_an_eval_every_few_steps(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = env_for(redis_server.url, run_name)
    main = [sys.executable, "-m", "rollstream.cli.main"]
    train_file = write_jsonl(tmp_path / "train.jsonl", 40)
    eval_file = write_jsonl(tmp_path / "eval.jsonl", 3)  # in their batch, uids of their own
    fed = subprocess.run([*main, "feed", str(train_file), "--task", "math"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert fed.returncode == 0, fed.stderr
    with subprocess.Popen([*main, "produce", "--local-engines"], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as producer:  # fmt: skip
        try:
            trainer = subprocess.run(
                [*main, "train", "--steps", "4", "--step-time", "0", "--eval-file", str(eval_file),
                 "--eval-every", "2"],
                env=env, capture_output=True, text=True, timeout=150,
            )  # fmt: skip
        finally:
            producer.terminate()
            producer.communicate(timeout=60)
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    evals = [line for line in trainer.stderr.splitlines() if "trainer: eval at step" in line]
    assert [line.split("eval at step ")[1].split(":")[0] for line in evals] == ["2", "4"]
    assert all("'heldout/score/mean@2'" in line and "'greedy/score/mean@2'" in line for line in evals)


def test_a_bad_eval_file_names_the_line(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> None:
    bad = write_jsonl(tmp_path / "eval.jsonl", 5, bad_line=4)
    command = [sys.executable, "-m", "rollstream.cli.main", "train", "--steps", "1", "--eval-file", str(bad)]
    result = subprocess.run(command, env=env_for(redis_server.url, run_name), capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert f"{bad}:4:" in result.stderr


def test_an_eval_between_weight_syncs_is_refused(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    eval_file = write_jsonl(tmp_path / "eval.jsonl", 3)
    env = env_for(redis_server.url, run_name) | {"ROLLSTREAM_ROLLOUT__SYNC_WEIGHTS_INTERVAL": "3"}
    command = [sys.executable, "-m", "rollstream.cli.main", "train", "--steps", "1",
               "--eval-file", str(eval_file), "--eval-every", "10"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "--eval-every 10 must be a multiple of rollout.sync_weights_interval (3)" in result.stderr
