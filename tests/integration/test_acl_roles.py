"""The layouts' Redis ACL users (deploy/redis/acl.sh) on a real redis-server that loads
the ACL file it prints: every role's real process runs a run to its end under its own
user, nothing lost; and each user is refused what its role must not do, by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import redis

from rollstream.shared.embedded import find_redis_server, free_port
from tests.helpers import wait_for
from tests.redis_exporter import Exporter

pytestmark = pytest.mark.integration

ACL_SH = Path(__file__).parents[2] / "deploy" / "redis" / "acl.sh"
ROLES = (
    "admin", "producer", "trainer", "feeder", "engines", "judge", "archive", "metrics", "monitor", "exporter",
)  # fmt: skip
RUN = "aclrun"


@dataclass
class AclRedis:
    port: int
    passwords: dict[str, str]

    def url(self, role: str) -> str:
        return f"redis://{role}:{self.passwords[role]}@127.0.0.1:{self.port}/0"

    def client(self, role: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(role))


def write_acl_file(path: Path) -> dict[str, str]:
    """acl.sh's ACL file for RUN at ``path``, a password of the test's own per role; the
    passwords."""
    passwords = {role: f"pw-{role}-{os.urandom(6).hex()}" for role in ROLES}
    env = {"PATH": os.environ["PATH"], "RUN": RUN}
    env.update({f"REDIS_PASSWORD_{role.upper()}": pw for role, pw in passwords.items()})
    made = subprocess.run(["sh", str(ACL_SH)], env=env, capture_output=True, text=True, check=True)
    assert all(pw not in made.stdout for pw in passwords.values())  # only their hashes
    path.write_text(made.stdout)
    return passwords


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[AclRedis]:
    passwords = write_acl_file(tmp_path / "users.acl")
    port = free_port()
    proc = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path), "--aclfile", str(tmp_path / "users.acl")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = AclRedis(port, passwords)
    admin = server.client("admin")

    def up() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return bool(admin.ping())
        except redis.RedisError:
            return False

    try:
        wait_for(up, timeout=30)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        yield server
    finally:
        admin.close()
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def _env(server: AclRedis, role: str, tmp_path: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=server.url(role),
        ROLLSTREAM_RUN=RUN,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
        ROLLSTREAM_ROLLOUT__BATCH_SIZE="4",
        ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
        ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="50",
        ROLLSTREAM_PRODUCER__JUDGE_ON_QUEUE="true",
        ROLLSTREAM_ARCHIVE__KEEP="100",
        ROLLSTREAM_ARCHIVE__DIR=str(tmp_path / "archive"),
        ROLLSTREAM_METRICS__PORT="0",
        **more,
    )
    return env


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _refused(server: AclRedis) -> str:
    """What the server refused, and to whom (its ACL LOG): for a failure's message."""
    entries = server.client("admin").acl_log()
    return "; ".join(f"{e['username']} {e['reason']} {e['object']} ({e['context']})" for e in entries)


def _start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollstream.cli.main", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _keda(port: int) -> tuple[int, dict[str, object]] | None:
    """(status, body) of the metrics process's /keda, None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/keda", timeout=10) as reply:
            return reply.status, orjson.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())
    except OSError:
        return None


def test_every_role_runs_under_its_own_user_and_a_run_finishes(acl_redis: AclRedis, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(8))
    )
    env = {role: _env(acl_redis, role, tmp_path) for role in ROLES}
    metrics_port = free_port()
    env["metrics"]["ROLLSTREAM_METRICS__PORT"] = str(metrics_port)
    background = {
        "judge": _start(env["judge"], "judge"),
        "archive": _start(env["archive"], "archive"),
        "metrics": _start(env["metrics"], "metrics"),
    }
    try:
        for role, args in (
            ("feeder", ["feed", str(prompts), "--task", "math"]),
            ("producer", ["produce", "--local-engines", "--burst"]),
            ("trainer", ["train", "--steps", "2", "--step-time", "0", "--stop-run"]),
        ):
            done = _cli(env[role], *args)
            assert done.returncode == 0, f"{role} {args}: {done.stderr[-3000:]} {_refused(acl_redis)}"
            if role == "feeder":  # the figure KEDA reads, read whole under the read-only metrics user
                # 503 until the metrics process has joined the run (it serves from its start)
                keda = wait_for(lambda: (k := _keda(metrics_port)) and k[0] != 503 and k, timeout=60)
                assert keda[0] == 200 and keda[1]["waiting"] == 8, keda
        for role in ("judge", "archive"):  # both end with the run
            _, err = background[role].communicate(timeout=180)
            assert background[role].returncode == 0, f"{role}: {err[-3000:]} {_refused(acl_redis)}"
        background["metrics"].send_signal(signal.SIGTERM)
        _, err = background["metrics"].communicate(timeout=60)
        assert background["metrics"].returncode == 0, f"metrics: {err[-3000:]}"
        assert "NOPERM" not in err and "can't access" not in err, err[-3000:]
    finally:
        for proc in background.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    status = _cli(env["metrics"], "status", "--json")  # the read-only user reads the whole run
    assert status.returncode == 0, status.stderr[-3000:]
    state = orjson.loads(status.stdout)
    assert state["train_step"] == 2, state
    assert state["accounts"]["math"]["lost"] == 0 and state["accounts"]["math"]["fed"] == 8, state
    assert list((tmp_path / "archive").rglob("*.parquet")), "the archiver wrote nothing"
    # refused only what each process tries and does without: INFO (the server's version,
    # read from HELLO instead), the feeder's consumer groups of streams it may not write
    # (their writers make them), the run's state to a process that started before the run
    # was made (it waits for another to make it)
    expected = {("feeder", "key", f"rs:{{{RUN}}}:{kind}:math") for kind in ("groups", "aborted", "expired")}
    expected |= {(user, "key", f"rs:{{{RUN}}}:state") for user in ("judge", "metrics", "archive")}
    refused = {
        (e["username"], e["reason"], e["object"]) for e in acl_redis.client("admin").acl_log(count=1000)
    }
    assert {r for r in refused if r[1:] != ("command", "info")} <= expected, _refused(acl_redis)


# what each user must not do: (role, command...), each answered NOPERM
REFUSED = [
    ("metrics", "XADD", f"rs:{{{RUN}}}:groups:math", "*", "f", "v"),  # no group of its own making
    ("metrics", "DEL", f"rs:{{{RUN}}}:state"),
    ("metrics", "HSET", f"rs:{{{RUN}}}:state", "paused", "1"),
    ("monitor", "XADD", f"rs:{{{RUN}}}:groups:math", "*", "f", "v"),
    ("monitor", "DEL", f"rs:{{{RUN}}}:prompts:math"),
    ("monitor", "HGETALL", f"rs:{{{RUN}}}:state"),  # not even a read beyond the streams' sizes
    ("producer", "GET", "rs:{other}:state"),  # another run's keys
    ("producer", "XADD", "rs:{other}:prompts:math", "*", "f", "v"),
    ("producer", "XADD", f"rs:{{{RUN}}}:trained:math", "*", "f", "v"),
    ("feeder", "XACK", f"rs:{{{RUN}}}:groups:math", "trainer", "1-1"),  # a commit
    ("feeder", "XDEL", f"rs:{{{RUN}}}:groups:math", "1-1"),
    ("feeder", "XADD", f"rs:{{{RUN}}}:events", "*", "f", "v"),
    ("judge", "XADD", f"rs:{{{RUN}}}:groups:math", "*", "f", "v"),
    ("engines", "XADD", f"rs:{{{RUN}}}:prompts:math", "*", "f", "v"),
    ("archive", "XADD", f"rs:{{{RUN}}}:prompts:math", "*", "f", "v"),
    ("trainer", "SET", f"rs:{{{RUN}}}:rq:queue", "x"),  # rq's keys are the producers' and judge's
    ("trainer", "FLUSHALL"),
    ("trainer", "CONFIG", "SET", "maxmemory", "1"),
]


@pytest.mark.parametrize(
    "role, command", [(r[0], r[1:]) for r in REFUSED], ids=[" ".join(r[:2]) for r in REFUSED]
)
def test_each_user_is_refused_what_its_role_must_not_do(
    acl_redis: AclRedis, role: str, command: tuple[str, ...]
) -> None:
    client = acl_redis.client(role)
    with pytest.raises(redis.exceptions.NoPermissionError, match=r"^this user has no permissions"):
        client.execute_command(*command)
    entry = acl_redis.client("admin").acl_log(count=1)[0]
    assert entry["username"] == role
    assert entry["object"] in (command[0].lower(), command[1] if len(command) > 1 else "", "config|set")


def test_the_monitor_reads_the_streams_sizes_and_default_is_the_admin(acl_redis: AclRedis) -> None:
    admin, monitor = acl_redis.client("admin"), acl_redis.client("monitor")
    stream = f"rs:{{{RUN}}}:prompts:math"
    admin.xgroup_create(stream, "producers", id="0", mkstream=True)
    admin.xadd(stream, {"f": "v"})
    # what KEDA's Redis Streams scaler asks: the length, the group's lag, its pending entries
    assert monitor.xlen(stream) == 1
    assert monitor.xinfo_groups(stream)[0]["name"] == b"producers"
    assert monitor.xpending(stream, "producers")["pending"] == 0
    with pytest.raises(redis.AuthenticationError):  # no user named, no password: refused
        redis.Redis(port=acl_redis.port).ping()
    # no user named: `default`, which is the admin (acl.sh: the append-only file's replay)
    assert redis.Redis(port=acl_redis.port, password=acl_redis.passwords["admin"]).ping()


def test_a_restart_from_the_append_only_file_keeps_every_transaction(tmp_path: Path) -> None:
    """Redis replays its append-only file as the user `default`, and before 8.4 EXEC
    checks ACL rules again then: with `default` off (acl.sh's first version) every
    MULTI/EXEC of the file, every script's writes among them, was refused and silently
    left out at a restart (the Compose run with faults lost its progress counters and
    stalled). With `default` the admin, a restart keeps them."""
    passwords = write_acl_file(tmp_path / "users.acl")
    port = free_port()
    command = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes", "--appendfsync", "always", "--dir", str(tmp_path),
               "--aclfile", str(tmp_path / "users.acl")]  # fmt: skip
    server = AclRedis(port, passwords)
    progress = f"rs:{{{RUN}}}:progress"
    for start in ("first", "after the restart"):
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            admin = server.client("admin")
            wait_for(lambda a=admin, p=proc: _pings(a) or p.poll() is not None, timeout=30)
            assert proc.poll() is None, f"redis-server exited at its {start} start"
            producer = server.client("producer")
            if start == "first":
                # a transaction and a script (replicated as MULTI/EXEC), as a role's user
                pipe = producer.pipeline(transaction=True)
                pipe.hincrby(progress, "math:fed", 3)
                pipe.hincrby(progress, "math:completed", 1)
                pipe.execute()
                producer.eval("redis.call('HINCRBY', KEYS[1], 'math:consumed', 2)", 1, progress)
            else:
                counts = {k.decode(): int(v) for k, v in admin.hgetall(progress).items()}
                assert counts == {"math:fed": 3, "math:completed": 1, "math:consumed": 2}, counts
        finally:
            proc.terminate()  # a clean stop: the append-only file is on disk
            proc.wait(timeout=30)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_the_redis_exporter_reads_redis_figures_under_its_user_and_no_key(
    acl_redis: AclRedis, tmp_path: Path
) -> None:
    exporter = Exporter(f"redis://127.0.0.1:{acl_redis.port}", tmp_path / "exporter.log",
                        password=acl_redis.passwords["exporter"], user="exporter")  # fmt: skip
    try:
        # what the alerts and the dashboard read: up, memory against maxmemory, clients
        def figures() -> dict[str, float]:
            return {
                line.split()[0]: float(line.split()[-1])
                for line in exporter.scrape().splitlines()
                if line.split()
                and line.split()[0] in {"redis_up", "redis_memory_max_bytes", "redis_connected_clients"}
            }

        wait_for(lambda: figures().get("redis_up") == 1.0, timeout=60)
        assert {"redis_memory_max_bytes", "redis_connected_clients"} <= set(figures())
    finally:
        exporter.stop()
    with pytest.raises(redis.exceptions.NoPermissionError):  # and no key of any run
        acl_redis.client("exporter").get(f"rs:{{{RUN}}}:state")


def test_a_refused_command_names_the_user_and_the_command(acl_redis: AclRedis, tmp_path: Path) -> None:
    admin = acl_redis.client("admin")
    admin.hset(f"rs:{{{RUN}}}:state", "run_id", "r1")  # a run made: the metrics user joins it
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"uid": "a", "prompt": "What is 1 + 1?", "answer": "2"}\n')
    done = _cli(_env(acl_redis, "metrics", tmp_path), "feed", str(prompts), "--task", "math")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "NOPERM" in done.stderr or "no permissions" in done.stderr, done.stderr[-2000:]
    assert "Redis user 'metrics' may not do this" in done.stderr, done.stderr[-2000:]
    assert f"rs:{{{RUN}}}:" in done.stderr and "deploy/redis/acl.sh" in done.stderr, done.stderr[-2000:]
    assert acl_redis.passwords["metrics"] not in done.stderr


@pytest.mark.slow  # a Ray cluster of its own, as tests/integration/test_end_of_run_signals.py's
def test_the_engines_process_and_a_producer_on_its_cluster_run_as_their_users(
    acl_redis: AclRedis, tmp_path: Path
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(8))
    )
    env = {
        role: {k: v for k, v in _env(acl_redis, role, tmp_path).items() if not k.startswith("RAY_ADDRESS")}
        for role in ROLES
    }
    for role in env:
        env[role]["ROLLSTREAM_PRODUCER__JUDGE_ON_QUEUE"] = "false"
    engines = _start(env["engines"], "engines", "--foreground")
    producer: subprocess.Popen[str] | None = None
    try:
        done = _cli(env["feeder"], "feed", str(prompts), "--task", "math")
        assert done.returncode == 0, done.stderr[-3000:]
        # the producer attaches to the cluster the engines process recorded in the run's state
        producer = _start(env["producer"], "produce")
        done = _cli(env["trainer"], "train", "--steps", "2", "--step-time", "0", "--stop-run")
        assert done.returncode == 0, f"{done.stderr[-3000:]} {_refused(acl_redis)}"
        _, err = producer.communicate(timeout=300)
        assert producer.returncode == 0, f"{err[-3000:]} {_refused(acl_redis)}"
        _, err = engines.communicate(timeout=300)
        assert engines.returncode == 0, f"{err[-3000:]} {_refused(acl_redis)}"
    finally:
        for proc in (engines, producer):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    refused = {
        (e["username"], e["reason"], e["object"]) for e in acl_redis.client("admin").acl_log(count=1000)
    }
    expected = {("feeder", "key", f"rs:{{{RUN}}}:{kind}:math") for kind in ("groups", "aborted", "expired")}
    assert {r for r in refused if r[1:] != ("command", "info")} <= expected, _refused(acl_redis)
