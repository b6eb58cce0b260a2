"""rollstream with a least-privilege ACL user: only the run's keys (and rq's), only the
command categories the README lists, no INFO. Every process works, and no error path
prints the password."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis, free_port

pytestmark = pytest.mark.integration

# the README's ACL line, for run {run}
CATEGORIES = [
    "-@all",
    "+@read",
    "+@write",
    "+@stream",
    "+@hash",
    "+@string",
    "+@set",
    "+@list",
    "+@sortedset",
    "+@scripting",
    "+@transaction",
    "+@connection",
    "+@keyspace",
    "+@pubsub",
    "-@dangerous",
    "+time",  # heartbeats and batch leases are stamped on the server's clock
]
PASSWORD = "s3cret-pw"


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_least_privilege_user_runs_feed_produce_train_and_status(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    user = f"u{run_name}"
    admin.execute_command(
        "ACL", "SETUSER", user, "on", f">{PASSWORD}", f"~rs:{{{run_name}}}:*", "&*", *CATEGORIES
    )
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
        env.update(
            ROLLSTREAM_REDIS__URL=f"redis://{user}:{PASSWORD}@127.0.0.1:{redis_server.port}/0",
            ROLLSTREAM_RUN=run_name,
            ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
            ROLLSTREAM_ROLLOUT__BATCH_SIZE="4",
            ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
            ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="50",
            ROLLSTREAM_PRODUCER__JUDGE_ON_QUEUE="true",  # rq's keys too: under the run's prefix
        )
        path = tmp_path / "p.jsonl"
        path.write_text(
            "".join(
                f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(8)
            )
        )
        outputs = []
        judge = subprocess.Popen(
            [sys.executable, "-m", "rollstream.cli.main", "judge"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in (
            ["check"],
            ["feed", str(path), "--task", "math"],
            ["produce", "--local-engines", "--burst"],
            ["train", "--steps", "1", "--step-time", "0"],
            ["status", "--json"],
        ):
            done = cli(env, *args)
            outputs.append(done.stdout + done.stderr)
            assert done.returncode == 0, f"{args}: {done.stderr[-2000:]}"
        judge.send_signal(signal.SIGTERM)
        _, judged = judge.communicate(timeout=60)
        assert judge.returncode == 0, judged[-2000:]
        assert '"train_step":1' in outputs[-1]
        assert not list(admin.scan_iter(match="rq:*"))  # nothing of the run outside its prefix
        assert list(admin.scan_iter(match=f"rs:{{{run_name}}}:rq:*"))
        assert all(PASSWORD not in out for out in outputs)
        # INFO is not allowed to this user: check got the version another way
        assert "answers at" in outputs[0] and f"{user}:***@" in outputs[0]
    finally:
        admin.execute_command("ACL", "DELUSER", user)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://user:{PASSWORD}@127.0.0.1:{free_port()}/0",  # nothing listens there
        f"redis://user:{PASSWORD}@127.0.0.1:99999/0",  # a port out of range
        f"http://user:{PASSWORD}@127.0.0.1:6379/0",  # a wrong scheme
        f"redis://user:{PASSWORD}@127.0.0.1:6379/abc",  # a db that is no number
    ],
    # stable ids: the free port differs in each pytest-xdist worker's collection
    ids=["nothing-listens", "port-out-of-range", "wrong-scheme", "db-not-a-number"],
)
def test_no_error_path_prints_the_password(url: str, run_name: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(ROLLSTREAM_RUN=run_name, ROLLSTREAM_PROCESS__WAIT_TIMEOUT_S="1")
    for source in ("env", "flag"):
        e = {**env, "ROLLSTREAM_REDIS__URL": url} if source == "env" else env
        flag = [] if source == "env" else ["--redis-url", url]
        for args in (["check"], ["status"], ["train", "--steps", "1"]):
            done = cli(e, *flag, *args)
            assert done.returncode != 0
            assert PASSWORD not in done.stdout + done.stderr, (source, args, done.stderr[-1500:])
