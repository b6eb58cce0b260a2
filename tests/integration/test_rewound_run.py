"""A run that goes backwards further than the trainer can put back: Redis's train_step
drops below steps the trainer committed (as after a failover that lost the writes of a
split brain, here made by setting the step back by hand, beyond the 8 commits the
trainer keeps). The trainer stops naming the lost steps (exit 5) and marks the run;
the producer stops on the mark, a producer started afterwards refuses, `rollstream
status` shows it, and `rollstream steps --train-step N --yes` clears it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import REWOUND, TRAIN_STEP, Keys
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


def _cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "rollstream.cli.main", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_run_set_back_past_what_the_trainer_keeps_stops_every_process(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=redis_server.url,
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
        ROLLSTREAM_ROLLOUT__BATCH_SIZE="2",
        ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="50",
        ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS="50",
        ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
        ROLLSTREAM_PRODUCER__HEARTBEAT_S="0.2",
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(400))
    )
    assert _cli(env, "feed", str(prompts), "--task", "math").returncode == 0
    logs = {name: tmp_path / f"{name}.log" for name in ("producer", "trainer")}
    args = {
        "producer": ["produce", "--local-engines"],
        "trainer": ["train", "--steps", "150", "--step-time", "0.1"],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name, path in logs.items():
        with path.open("wb") as out:
            procs[name] = subprocess.Popen([sys.executable, "-m", "rollstream.cli.main", *args[name]],
                                           env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    try:
        # Given a run past step 12
        wait_for(lambda: int(client.hget(keys.state, TRAIN_STEP) or 0) >= 12 or _exited(procs), timeout=180)
        assert not _exited(procs), _tails(logs)
        # When Redis's train_step goes back to 2 (steps 3.. lost: more than the 8 commits kept)
        client.hset(keys.state, TRAIN_STEP, 2)
        # Then the trainer stops naming what was lost, and the producer stops on the mark
        for proc in procs.values():
            proc.wait(timeout=120)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs.values()] == [5, 5], _tails(logs)
    trainer_log = logs["trainer"].read_text()
    said = trainer_log[-3000:]
    assert "went backwards: Redis at" in trainer_log and "holds train_step 2" in trainer_log, said
    assert "no longer holds what steps 3-" in trainer_log, said
    assert "went backwards" in logs["producer"].read_text(), _tails(logs)
    mark = orjson.loads(client.hget(keys.state, REWOUND) or b"{}")
    assert mark["train_step"] == 2 and mark["committed"] >= 12, mark
    status = orjson.loads(_cli(env, "status", "--json").stdout)
    assert "went backwards" in (status["rewound"] or ""), status
    # a producer started now (a supervisor's restart) refuses the run, naming the mark
    again = _cli(env, "produce", "--local-engines", timeout=180)
    assert again.returncode == 5 and "rollstream steps --train-step" in again.stderr, again.stderr[-2000:]
    # the operator goes on on purpose: the step set, the mark cleared and said
    repaired = _cli(env, "steps", "--train-step", str(mark["committed"]), "--yes")
    assert repaired.returncode == 0 and "cleared the run's rewound mark" in repaired.stdout, repaired
    assert client.hget(keys.state, REWOUND) is None
    assert int(client.hget(keys.state, TRAIN_STEP) or 0) == mark["committed"]


def _exited(procs: dict[str, subprocess.Popen[bytes]]) -> bool:
    return any(p.poll() is not None for p in procs.values())


def _tails(logs: dict[str, Path]) -> str:
    return "\n".join(f"--- {name}\n{path.read_text()[-2500:]}" for name, path in logs.items())
