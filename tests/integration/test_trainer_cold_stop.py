"""The trainer's warm-then-cold stop, as the producer's: a first SIGTERM lets the step in
training finish and commit; a second one stops at once, the step uncommitted and its
groups left pending for the trainer's consumer name, and its restart trains that step
with them: nothing lost, nothing trained twice."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import orjson
import pytest
import redis

from rollstream.consumer.assembly import create_trainer
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import TRAINER, Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import group_for, prompts, rollstream, wait_for

pytestmark = pytest.mark.integration

WARM_STEP_S = 300  # the step a warm stop would finish: far longer than a cold stop may take


def produce(buffer: ReplayBuffer, count: int) -> list[str]:
    buffer.feed(prompts("math", count))
    ids = []
    for claim in buffer.claim("math", count):
        buffer.complete(claim, group_for(claim.prompt, step=0))
        ids.append(claim.prompt.group_id)
    return ids


def trainer_pending(client: redis.Redis, run: str) -> int:
    return int(client.xpending(Keys(run).groups("math"), TRAINER)["pending"])


def read_records(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line]


def test_a_cold_stop_ends_the_step_in_training_uncommitted(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = load_settings(
        run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}],
        rollout={"batch_size": 2},
    )  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    produced = produce(open_buffer(client, settings, "p"), 2)
    trainer = create_trainer(settings, client=client, step_time_s=WARM_STEP_S, consumer="trainer")
    stop, cold = threading.Event(), threading.Event()
    result: list[object] = []
    runner = threading.Thread(target=lambda: result.append(trainer.run(1, stop=stop, cold=cold)), daemon=True)
    runner.start()
    # Given a trainer in the middle of a long step (its batch read)
    wait_for(lambda: trainer_pending(client, run_name) == 2, timeout=30)
    # When it is stopped warm, then cold
    stop.set()
    cold.set()
    started = time.monotonic()
    runner.join(timeout=30)
    # Then it returns at once, without the step, and commits nothing
    assert not runner.is_alive()
    assert time.monotonic() - started < 30
    assert [s.step for s in result[0].steps] == []  # type: ignore[attr-defined]
    assert RunControl(client, Keys(run_name)).train_step() == 0
    # and the groups stay pending for its consumer name, for its restart
    assert trainer_pending(client, run_name) == 2
    again = create_trainer(settings, client=client, step_time_s=0, consumer="trainer").run(1)
    assert [(s.step, s.groups) for s in again.steps] == [(1, 2)]
    assert trainer_pending(client, run_name) == 0
    assert len(produced) == 2


def test_a_second_sigterm_mid_step_stops_the_trainer_at_once_and_its_restart_trains_the_step(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=redis_server.url,
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
        ROLLSTREAM_ROLLOUT__BATCH_SIZE="2",
    )
    settings = load_settings(
        run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}],
        rollout={"batch_size": 2},
    )  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    produced = produce(open_buffer(client, settings, "p"), 2)
    record, err_path = tmp_path / "record.jsonl", tmp_path / "trainer.err"
    args = ("train", "--steps", "1", "--step-time", str(WARM_STEP_S), "--consumer", "trainer")
    with err_path.open("w") as err:
        trainer = subprocess.Popen(
            rollstream(*args, "--record", str(record)), env=env, stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        # Given a trainer in the middle of a long step: its batch read, nothing committed
        wait_for(lambda: trainer.poll() is not None or trainer_pending(client, run_name) == 2, timeout=60)
        assert trainer.poll() is None, err_path.read_text()[-3000:]
        # When it gets SIGTERM, starts its warm stop (the step goes on), then a second SIGTERM
        trainer.send_signal(signal.SIGTERM)
        wait_for(lambda: "a second one stops at once" in err_path.read_text(), timeout=30)
        assert trainer.poll() is None, err_path.read_text()[-3000:]
        trainer.send_signal(signal.SIGTERM)
        started = time.monotonic()
        # Then it stops at once (far inside the warm stop's step), exit 0
        code = trainer.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    log = err_path.read_text()
    assert code == 0, log[-3000:]
    assert took < 60 < WARM_STEP_S
    assert "cold stop" in log and "0 steps done, stopped (cold stop)" in log, log[-3000:]
    # with step 1 neither committed nor recorded as trained, its groups pending for its name
    control = RunControl(client, keys)
    assert control.train_step() == 0
    assert [r for r in read_records(record) if r["event"] == "read"] == []
    assert trainer_pending(client, run_name) == 2
    assert list(client.scan_iter(match=keys.alive_pattern)) == []
    # When the trainer restarts under the same name
    restart = rollstream(
        "train", "--steps", "1", "--step-time", "0", "--consumer", "trainer", "--record", str(record)
    )
    again = subprocess.run(restart, env=env, capture_output=True, text=True, timeout=120)
    # Then it trains step 1 with exactly the groups the stopped one held: nothing lost
    assert again.returncode == 0, again.stderr[-3000:]
    reads = [r for r in read_records(record) if r["event"] == "read"]
    assert [r["step"] for r in reads] == [1]
    assert sorted(g[0] for g in reads[0]["groups"]) == sorted(produced)  # type: ignore[union-attr]
    assert control.train_step() == 1
    assert trainer_pending(client, run_name) == 0
