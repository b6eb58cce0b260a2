"""The rollstream command against a real redis-server, as a user runs it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import redis

from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis, find_redis_server, free_port
from rollstream.shared.keys import Keys
from rollstream.shared.settings import RedisSettings
from tests.ha import Node
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


def rollstream(*args: str, url: str, run: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROLLSTREAM_REDIS__URL": url, "ROLLSTREAM_RUN": run}
    return subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )  # type: ignore[call-overload,no-any-return]


def write_jsonl(path: Path, count: int, bad_line: int | None = None) -> Path:
    lines = []
    for i in range(1, count + 1):
        row = {"uid": f"q{i}", "prompt": f"What is {i} * 2?", "meta": {"answer": str(2 * i)}}
        lines.append('{"uid": "q7", "meta": {}}' if i == bad_line else orjson.dumps(row).decode())
    path.write_text("\n".join(lines) + "\n")
    return path


def test_feed_then_status_json_shows_the_prompts(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "math.jsonl", 12)
    fed = rollstream("feed", str(path), "--task", "default", url=redis_server.url, run=run_name)
    assert fed.returncode == 0, fed.stderr
    assert "12 prompts added" in fed.stdout and "0 already there" in fed.stdout
    again = rollstream("feed", str(path), "--task", "default", url=redis_server.url, run=run_name)
    assert "0 prompts added" in again.stdout and "12 already there" in again.stdout

    status = rollstream("status", "--json", url=redis_server.url, run=run_name)
    assert status.returncode == 0, status.stderr
    data = orjson.loads(status.stdout)
    prompts = next(s for s in data["streams"] if s["kind"] == "prompts")
    assert (prompts["task"], prompts["length"], prompts["pending"], prompts["lag"]) == ("default", 12, 0, 12)
    assert data["progress"] == {"default:fed": 12}
    assert data["run"] == run_name

    table = rollstream("status", url=redis_server.url, run=run_name)
    assert f"rs:{{{run_name}}}:prompts:default" in table.stdout


def test_feed_with_a_bad_line_7_writes_nothing_and_names_line_7(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", 10, bad_line=7)
    result = rollstream("feed", str(path), "--task", "default", url=redis_server.url, run=run_name)
    assert result.returncode == 2
    assert f"{path}:7:" in result.stderr
    assert "'prompt'" in result.stderr
    client = redis.Redis.from_url(redis_server.url)
    assert client.xlen(Keys(run_name).prompts("default")) == 0
    assert client.exists(Keys(run_name).fed("default")) == 0


def test_feed_to_an_unknown_task_names_the_known_ones(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "math.jsonl", 1)
    result = rollstream("feed", str(path), "--task", "poetry", url=redis_server.url, run=run_name)
    assert result.returncode == 2
    assert "unknown task 'poetry'" in result.stderr and "default" in result.stderr


def test_check_answers_zero_when_redis_is_up(redis_server: EmbeddedRedis, run_name: str) -> None:
    result = rollstream("check", url=redis_server.url, run=run_name)
    assert result.returncode == 0
    assert "answers at" in result.stdout


@pytest.mark.parametrize(
    ("policy", "said"),
    [("allkeys-lru", "evicts any key"), ("volatile-ttl", "liveness keys"), ("noeviction", None)],
)
def test_an_evicting_redis_is_named_as_a_risk(
    tmp_path: Path, run_name: str, policy: str, said: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    # a Redis that evicts under memory pressure drops a run's keys without an error
    server = Node(find_redis_server(), tmp_path / "r", ["--save", "", "--maxmemory-policy", policy]).start()
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        result = rollstream("check", url=url, run=run_name)
        assert result.returncode == 0, result.stderr
        warned = [line for line in result.stdout.splitlines() if line.startswith("warning: ")]
        with caplog.at_level(logging.WARNING, logger="rollstream.shared.connection"):
            connect(RedisSettings(url=url)).close()
            connect(RedisSettings(url=url)).close()  # said once per process, not per client
        logged = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    finally:
        server.stop()
    if said is None:
        assert warned == [] and logged == []
    else:
        assert len(warned) == 1 and said in warned[0] and f"maxmemory-policy {policy}" in warned[0]
        assert "noeviction" in warned[0]
        assert len(logged) == 1 and said in logged[0]


def test_check_names_the_url_but_never_the_password(run_name: str) -> None:
    url = f"redis://trainer:hunter2@127.0.0.1:{free_port()}/0"
    result = rollstream("check", url=url, run=run_name)
    assert result.returncode == 3
    assert f"redis://trainer:***@127.0.0.1:{url.rsplit(':', 1)[1]}" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout
    assert "not reachable" in result.stderr


def test_invalid_setting_fails_at_start_naming_it(redis_server: EmbeddedRedis, run_name: str) -> None:
    env = {**os.environ, "ROLLSTREAM_BUFFER__MAX_ATTEMPTS": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", "--redis-url", redis_server.url, "status"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "buffer.max_attempts (ROLLSTREAM_BUFFER__MAX_ATTEMPTS): must be >= 1" in result.stderr


def test_feeder_process_stops_on_sigterm_and_resumes_where_it_stopped(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "math.jsonl", 20)
    keys = Keys(run_name)
    client = redis.Redis.from_url(redis_server.url)
    env = {**os.environ, "ROLLSTREAM_REDIS__URL": redis_server.url, "ROLLSTREAM_RUN": run_name}
    args = [sys.executable, "-m", "rollstream.cli.main", "feed", str(path), "--task", "default",
            "--epochs", "2", "--shuffle", "--seed", "3", "--keep-ahead", "8"]  # fmt: skip
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as feeder:
        wait_for(lambda: client.xlen(keys.prompts("default")) == 8, timeout=30)
        feeder.send_signal(signal.SIGTERM)
        _, err = feeder.communicate(timeout=30)
    assert feeder.returncode == 0, err
    assert "stopped after 8 prompts" in err  # its log
    # consume what was fed, then a new feeder goes on from the stored cursor
    client.delete(keys.prompts("default"))
    done = subprocess.run([*args[:-1], "40"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "done after 32 prompts" in done.stderr
    uids = [f[b"uid"].decode() for _, f in client.xrange(keys.prompts("default"))]
    assert len(uids) == len(set(uids)) == 32
    assert all(u.endswith(("@0", "@1")) for u in uids)


def test_demo_runs_the_pipeline_and_loses_nothing() -> None:
    args = ["demo", "--sim", "--prompts", "96", "--steps", "3", "--step-time", "0.05", "--json"]
    command = [sys.executable, "-m", "rollstream.cli.main", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = orjson.loads(result.stdout)
    assert summary["steps"] == 3
    assert summary["prompts_fed"] == 96
    assert summary["prompts_trained"] == 3 * 16
    assert summary["prompts_lost"] == 0
    assert summary["staleness_violations"] == 0
    assert 0 < summary["engine_busy"] <= 1
    for key in ("groups_per_s", "engine_busy", "prompts_trained"):
        assert key in summary
