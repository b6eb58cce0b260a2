"""The producers' scaling figure on a real run: `rollstream metrics` answers GET /keda
(what KEDA's metrics-api scaler reads) with one producer more while two producers on
slow engines keep a faster trainer waiting, and one fewer once the trainer has stopped
and the staleness bound holds the producers back, whatever number of prompts waits
(the feeder's keep-ahead pinned the old lag-based figure)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollstream.shared.embedded import EmbeddedRedis, free_port
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCH = 8
PRODUCERS = 2


def keda(port: int) -> dict[str, Any] | None:
    """/keda's answer, None while the metrics process is not serving yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/keda?min=1&max=8", timeout=10) as reply:
            assert reply.headers["Content-Type"] == "application/json"
            return dict(json.loads(reply.read()))
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The processes the test starts; whatever is left at its end is killed (by handle)."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(600)  # about 40 s alone; generous for a loaded machine
def test_keda_reads_one_producer_more_while_the_trainer_waits_and_one_fewer_at_the_bound(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS", "PORT"))}
    env.update(
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_REDIS__URL=redis_server.url,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
        ROLLSTREAM_ROLLOUT__BATCH_SIZE=str(BATCH),
        # the bound admits (model step + 2) x 8 groups: room while the trainer steps on
        ROLLSTREAM_ROLLOUT__MAX_STALENESS="1",
        ROLLSTREAM_ENGINES__COUNT="1",
        # a group takes about 2 s: two producers of 2 groups make a batch in ~4 s, and the
        # trainer's steps take 0.2 s: it waits for groups
        ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS="2000",
        ROLLSTREAM_ENGINES__SIM__SIGMA="0.2",
        ROLLSTREAM_PRODUCER__MAX_TOKENS="4000",
        ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
        ROLLSTREAM_PRODUCER__MAX_INFLIGHT="2",
        ROLLSTREAM_PRODUCER__HEARTBEAT_S="0.5",
    )
    prompts = tmp_path / "math.jsonl"
    prompts.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(400))
    )
    cli = [sys.executable, "-m", "rollstream.cli.main"]
    fed = subprocess.run(
        [*cli, "feed", str(prompts), "--task", "math"], env=env, capture_output=True, timeout=120
    )
    assert fed.returncode == 0, fed.stderr[-2000:]

    port = free_port()
    commands = {
        "metrics": ["metrics"],
        **{f"producer{i}": ["produce", "--local-engines"] for i in range(PRODUCERS)},
        "trainer": ["train", "--steps", "3", "--step-time", "0.2"],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for role, args in commands.items():  # only the metrics process serves a port here
        with (tmp_path / f"{role}.log").open("wb") as log:
            procs[role] = subprocess.Popen(
                [*cli, *args], env={**env, "PORT": str(port)} if role == "metrics" else env,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        started.append(procs[role])
    said = lambda role: (tmp_path / f"{role}.log").read_text()[-3000:]  # noqa: E731
    seen: list[dict[str, Any]] = []

    def answer_where(check: Any) -> dict[str, Any] | None:
        body = keda(port)
        if body is not None:
            seen.append(body)
            if check(body):
                return body
        for role, proc in procs.items():  # a process that died says why at once
            if role != "trainer" and proc.poll() is not None:
                raise AssertionError(f"{role} exited {proc.returncode}: {said(role)}")
        return None

    # the trainer waits, both producers are full, the engines have room: one more
    starved = wait_for(
        lambda: answer_where(lambda b: (b["producers"], b["producers_wanted"]) == (PRODUCERS, PRODUCERS + 1)),
        timeout=180, interval=0.5,
    )  # fmt: skip
    assert starved["ready"] < BATCH and starved["inflight"] == PRODUCERS * 2, starved
    assert starved["reason"] == "the trainer waits, the producers are full, work is claimable"

    # the trainer ends its steps: the producers run into the bound, prompts still waiting
    assert procs["trainer"].wait(timeout=300) == 0, said("trainer")
    held = wait_for(
        lambda: answer_where(lambda b: b["producers_wanted"] == PRODUCERS - 1 and b["inflight"] == 0),
        timeout=180, interval=0.5,
    )  # fmt: skip
    assert held["reason"] == "the staleness bound holds the work back", held
    assert held["waiting"] > 300 and held["claimable"] == 0 and held["ready"] >= BATCH, held
    # the figure never asked for more than one step above the producers alive
    assert all(b["producers_wanted"] <= b["producers"] + 1 for b in seen if b["producers"] >= 1)

    for role in ("metrics", *(f"producer{i}" for i in range(PRODUCERS))):
        procs[role].send_signal(signal.SIGTERM)
    for role in ("metrics", *(f"producer{i}" for i in range(PRODUCERS))):
        assert procs[role].wait(timeout=120) == 0, said(role)
