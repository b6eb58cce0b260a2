"""Redis goes away under a running producer and trainer and comes back from its
append-only file: both ride the outage out in place (no exit, nothing lost, no step
trained twice), and say how long it lasted. Past redis.outage_limit_s a process
gives up with a clear message."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from rollstream.shared.connection import STOPPING, OutageRetry, connect, stop_over
from rollstream.shared.embedded import free_port
from rollstream.shared.keys import Keys
from rollstream.shared.settings import RedisSettings
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


class AofRedis:
    """`rollstream redis` (deploy/redis.conf: append-only file) on a port of its own."""

    def __init__(self, data: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.data = data
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "ROLLSTREAM_REDIS__URL": self.url}
        self.data.mkdir(parents=True, exist_ok=True)
        log = self.data / "server.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollstream.cli.main", "redis", "--dir", str(self.data)],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        client = redis.Redis.from_url(self.url)
        proc = self.proc

        def up() -> bool:
            code = proc.poll()
            assert code is None, f"rollstream redis exited with {code}:\n{log.read_text()[-2000:]}"
            return _answers(client)

        wait_for(up, timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # redis-server flushes its append-only file and exits
            self.proc.wait(timeout=30)
        self.proc = None

    def crash_losing_the_last_commit(self, groups_stream: str) -> None:
        """kill -9, and the append-only file loses everything from the last trainer commit
        (XACK of the groups stream) on: what appendfsync everysec may lose in a crash."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        files = sorted(self.data.glob("appendonlydir/*.incr.aof")) or [self.data / "appendonly.aof"]
        aof = files[-1]
        content = aof.read_bytes()
        key = groups_stream.encode()
        at = content.rfind(b"$4\r\nXACK\r\n$%d\r\n%s\r\n" % (len(key), key))
        assert at > 0, "no commit in the append-only file yet"
        aof.write_bytes(content[: content.rfind(b"*", 0, at)])  # cut before that command
        self.proc = None


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[AofRedis]:
    server = AofRedis(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("outage", ["restart", "crash losing the last commit"])
def test_producer_and_trainer_ride_out_a_redis_restart(
    aof_redis: AofRedis, run_name: str, tmp_path: Path, outage: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=aof_redis.url,
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
        ROLLSTREAM_ROLLOUT__BATCH_SIZE="4",
        ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="20",
        ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS="100",
        ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
        ROLLSTREAM_PRODUCER__HEARTBEAT_S="0.2",
        ROLLSTREAM_BUFFER__CLAIM_IDLE_MS="5000",
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(200))
    )
    feed = subprocess.run([sys.executable, "-m", "rollstream.cli.main", "feed", str(prompts),
                           "--task", "math"], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert feed.returncode == 0, feed.stderr
    logs = {name: tmp_path / f"{name}.log" for name in ("producer", "trainer")}
    args = {
        "producer": ["produce", "--local-engines"],
        "trainer": ["train", "--steps", "12", "--step-time", "0.2", "--stop-run"],
    }
    procs = {}
    for name, path in logs.items():
        with path.open("wb") as out:
            procs[name] = subprocess.Popen([sys.executable, "-m", "rollstream.cli.main", *args[name]],
                                           env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        # Given a run in progress
        wait_for(lambda: b"trainer: step 3," in logs["trainer"].read_bytes() or _exited(procs), timeout=90)
        assert not _exited(procs), _tails(logs)
        # When Redis stops (or crashes and loses its last writes), and both processes have
        # noticed it, and it comes back
        if outage == "restart":
            aof_redis.stop()
        else:
            aof_redis.crash_losing_the_last_commit(Keys(run_name).groups("math"))
        wait_for(lambda: all(b"does not answer" in p.read_bytes() for p in logs.values()) or _exited(procs),
                 timeout=30)  # fmt: skip
        assert not _exited(procs), _tails(logs)
        aof_redis.start()
        # Then the run goes on to its last step and ends by itself
        for proc in procs.values():
            proc.wait(timeout=120)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs.values()] == [0, 0], _tails(logs)
    for path in logs.values():
        assert b"answers again after" in path.read_bytes()
    assert b"trainer: step 12," in logs["trainer"].read_bytes()
    status = subprocess.run([sys.executable, "-m", "rollstream.cli.main", "status", "--json"], env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    result = orjson.loads(status.stdout)
    assert result["train_step"] == 12
    account = result["accounts"]["math"]
    assert account["lost"] == 0, account
    # every step trained its 4 groups once: after the crash, the commit Redis lost (its
    # groups back pending for the trainer, train_step one behind) was replayed exactly
    assert account["trained"] == 48, (account, _tails(logs))
    replayed = b"were replayed exactly" in logs["trainer"].read_bytes()
    assert replayed == (outage != "restart"), _tails(logs)
    assert result["rewound"] is None, result


def _exited(procs: dict[str, subprocess.Popen[bytes]]) -> bool:
    return any(p.poll() is not None for p in procs.values())


def _tails(logs: dict[str, Path]) -> str:
    return "\n".join(f"--- {name}\n{path.read_text()[-2500:]}" for name, path in logs.items())


def test_a_client_gives_up_after_the_outage_limit_naming_no_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    client = connect(RedisSettings(url=url, outage_limit_s=0.3), check=False)
    with caplog.at_level(logging.WARNING), pytest.raises(redis.ConnectionError):
        client.ping()
    text = caplog.text
    assert "does not answer" in text and "giving up" in text
    assert "s3cret" not in text and "user:***@127.0.0.1" in text


def test_outage_retry_returns_once_the_call_succeeds(caplog: pytest.LogCaptureFixture) -> None:
    retry = OutageRetry("redis://host:1/0", limit_s=10, base_s=0.001, cap_s=0.002)
    outcomes: list[Exception | None] = [redis.ConnectionError("down"), redis.TimeoutError("slow"), None]
    failures: list[int] = []

    def do() -> str:
        error = outcomes.pop(0)
        if error is not None:
            raise error
        return "ok"

    with caplog.at_level(logging.INFO):
        result = retry.call_with_retry(do, lambda error, n: failures.append(n), with_failure_count=True)
    assert result == "ok" and failures == [1, 2]
    assert caplog.text.count("does not answer") == 1  # one line per outage, not per retry
    assert "answers again after" in caplog.text


def test_a_stopping_process_waits_for_a_gone_redis_once(caplog: pytest.LogCaptureFixture) -> None:
    # a process manager stops Redis with the rest: a stopping process's last writes
    # (heartbeat keys, counts) must not each wait STOPPING_LIMIT_S past the manager's grace
    retry = OutageRetry("redis://host:1/0", limit_s=10, base_s=0.001, cap_s=0.002)
    attempts: list[str] = []
    up = [False]

    def do() -> str:
        attempts.append("try")
        if not up[0]:
            raise redis.ConnectionError("Connection refused")
        return "ok"

    STOPPING.set()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(redis.ConnectionError):
            retry.call_with_retry(do, lambda error: None)
        assert len(attempts) > 1  # the first call rode it out for the stopping limit
        assert "gone while this process stops" in caplog.text
        attempts.clear()
        with pytest.raises(redis.ConnectionError):
            retry.call_with_retry(do, lambda error: None)
        assert attempts == ["try"]  # the next one failed at once
        up[0] = True
        assert retry.call_with_retry(do, lambda error: None) == "ok"
        up[0] = False
        attempts.clear()
        with pytest.raises(redis.ConnectionError):  # Redis answered in between: ridden out again
            retry.call_with_retry(do, lambda error: None)
        assert len(attempts) > 1
    finally:
        stop_over()
    attempts.clear()
    up[0] = False
    outcomes = iter([False, False, True])

    def flaky() -> str:
        attempts.append("try")
        if not next(outcomes):
            raise redis.ConnectionError("Connection refused")
        return "ok"

    # the stop over, a later outage is ridden out for the whole limit again
    assert retry.call_with_retry(flaky, lambda error: None) == "ok" and len(attempts) == 3


def test_a_process_past_the_outage_limit_exits_3(tmp_path: Path, run_name: str) -> None:
    # a server that answers once (the start-up check) and is then gone for good
    server = AofRedis(tmp_path / "r")
    server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=server.url, ROLLSTREAM_RUN=run_name, ROLLSTREAM_REDIS__OUTAGE_LIMIT_S="1"
    )
    with subprocess.Popen([sys.executable, "-m", "rollstream.cli.main", "train", "--steps", "1"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as trainer:  # fmt: skip
        client = redis.Redis.from_url(server.url)
        wait_for(lambda: trainer.poll() is not None or any(client.scan_iter(match="rs:*alive*")), timeout=30)
        server.stop()
        _, err = trainer.communicate(timeout=60)
    assert trainer.returncode == 3, err[-2000:]
    assert "Redis gone for longer than redis.outage_limit_s" in err
