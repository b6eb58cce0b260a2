"""The shipped Procfile, run the way users run it: under honcho, every process at once,
and by hand in reverse order (the trainer first, Redis last). Either way the run ends
by itself with exit status 0, every fed prompt is accounted for, and each process
said who it is when it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from honcho.environ import parse as parse_env
from honcho.environ import parse_procfile

from rollstream.shared.embedded import free_port
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS = 4
ROLES = ("redis", "engines", "feeder", "producer", "judge", "trainer")


def formation_env(tmp_path: Path, run: str) -> dict[str, str]:
    """The shipped .env, on a Redis port and run of this test's own, and a few steps."""
    values = dict(parse_env((ROOT / ".env").read_text()))
    values.update(
        ROLLSTREAM_RUN=run,
        ROLLSTREAM_REDIS__URL=f"redis://127.0.0.1:{free_port()}/0",
        ROLLSTREAM_REDIS_DIR=str(tmp_path / "redis"),
        ROLLSTREAM_TRAINER_RECORD=str(tmp_path / "trainer.json"),
        ROLLSTREAM_STEPS=str(STEPS),
    )
    return values


def process_env(values: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS"))}
    env.update(values)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # `rollstream` of this environment
    return env


def rollstream(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "rollstream"), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def restarted_redis(tmp_path: Path) -> Iterator[Any]:
    """After the formation: its redis-server again, from the append-only file it left."""
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str]) -> redis.Redis:
        proc = subprocess.Popen(
            [str(BIN / "rollstream"), "redis", "--dir", env["ROLLSTREAM_REDIS_DIR"]],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        started.append(proc)
        client = redis.Redis.from_url(env["ROLLSTREAM_REDIS__URL"])
        wait_for(lambda: _answers(client) or proc.poll() is not None, timeout=30)
        assert proc.poll() is None, "redis-server did not start again from its append-only file"
        return client

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=30)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def check_the_run(env: dict[str, str], log: str, restart: Any) -> None:
    """Every fed prompt accounted for, the run at its last step, nothing pending, and a
    start line of every role in the log."""
    for role in ROLES[1:]:
        assert f"{role} starting: run '{env['ROLLSTREAM_RUN']}'" in log, f"no start line of {role}"
    assert "redis starting" in log
    restart(env)
    status = rollstream(env, "status", "--json")
    assert status.returncode == 0, status.stderr
    result = orjson.loads(status.stdout)
    assert result["train_step"] == STEPS and result["model_step"] == STEPS
    account = result["accounts"]["default"]
    assert account["fed"] > 0
    assert account["trained"] == STEPS * 16
    assert account["lost"] == 0, account
    assert all(s["pending"] == 0 for s in result["streams"]), result["streams"]
    assert result["processes"] == []  # every one stopped and said so


def test_honcho_runs_the_procfile_to_the_end(tmp_path: Path, run_name: str, restarted_redis: Any) -> None:
    values = formation_env(tmp_path, run_name)
    env_file = tmp_path / "formation.env"
    env_file.write_text("".join(f"{k}='{v}'\n" for k, v in values.items()))
    env = process_env(values)
    done = subprocess.run(
        [str(BIN / "honcho"), "start", "-e", str(env_file), "-c", "producer=2"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "trainer.1 stopped (rc=0)" in log, log[-4000:]
    for name in ("engines.1", "feeder.1", "producer.1", "producer.2", "judge.1", "redis.1"):
        assert f"{name} stopped (rc=0)" in log, f"{name} did not stop cleanly:\n{log[-4000:]}"
    check_the_run(env, log, restarted_redis)


def test_processes_started_in_reverse_order_wait_for_each_other(
    tmp_path: Path, run_name: str, restarted_redis: Any
) -> None:
    values = formation_env(tmp_path, run_name)
    env = process_env(values)
    commands = dict(parse_procfile((ROOT / "Procfile").read_text()).processes)
    order = ["trainer", "judge", "producer", "producer", "feeder", "engines", "redis"]
    logs = [tmp_path / f"{i}-{role}.log" for i, role in enumerate(order)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for role, path in zip(order, logs, strict=True):
            with path.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        ["/bin/sh", "-c", commands[role]],
                        env=env,
                        cwd=ROOT,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            if role != "redis":  # each one is up (and waiting for Redis) before the next starts
                wait_for(lambda p=path: b"starting:" in p.read_bytes(), timeout=60)
        for proc in procs[:-1]:  # the run's stop event ends every rollstream process
            proc.wait(timeout=240)
        procs[-1].send_signal(signal.SIGTERM)  # a redis-server stops when told to
        procs[-1].wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = "\n".join(p.read_text() for p in logs)
    assert "waiting for Redis" in logs[0].read_text()  # the trainer came first and waited
    assert [p.returncode for p in procs] == [0] * len(procs), log[-4000:]
    check_the_run(env, log, restarted_redis)
