"""Conformance of docs/stream-format.md, the producer's side: producers written from that
page alone (tests/conformance/foreign_producer.py: redis-py, numpy and orjson, nothing of
rollstream) make the groups of a run whose other processes are rollstream's own, as
processes: `rollstream feed` in feeder mode, `rollstream train` (the reference trainer,
--record: what each step trained, with its groups' decoded token versions) and
`rollstream stop`, `status`, `show`.

The run then holds what the bundled producers' runs hold: nothing lost, nothing trained
twice, staleness within the bound by the decoded token versions, no dead letter but the
two the test puts in on purpose (an entry that breaks §5.1, a prompt the engine refuses),
the filtered group accounted, every foreign group decoded by rollstream's own reader
without a warning, and a clean stop. The faults test kills the page's producers with
claims pending (one while another lives: it reclaims them, §11.9.4; then the last one:
the trainer hands them back to their pools) and runs each on_weight_sync mode.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from tests.helpers import rollstream, wait_for

pytestmark = pytest.mark.integration

PRODUCER = Path(__file__).resolve().parent / "foreign_producer.py"
N, BATCH = 4, 4
CLAIM_IDLE_MS = 1500
LIVENESS_TTL_S = 6  # longer than claim_idle_ms: a live producer reclaims before the trainer may
MAX_STALENESS = 2
THRESHOLD = MAX_STALENESS + 1  # a sync every step


def env_for(url: str, run: str, mode: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS"))}
    return {
        **base,
        "ROLLSTREAM_REDIS__URL": url,
        "ROLLSTREAM_RUN": run,
        "ROLLSTREAM_TASKS": f'[{{"name": "math", "n": {N}}}]',
        "ROLLSTREAM_ROLLOUT__BATCH_SIZE": str(BATCH),
        "ROLLSTREAM_ROLLOUT__MAX_STALENESS": str(MAX_STALENESS),
        "ROLLSTREAM_ROLLOUT__ON_WEIGHT_SYNC": mode,
        "ROLLSTREAM_BUFFER__CLAIM_IDLE_MS": str(CLAIM_IDLE_MS),
        "ROLLSTREAM_PROCESS__LIVENESS_TTL_S": str(LIVENESS_TTL_S),
        "ROLLSTREAM_PROCESS__STOP_TIMEOUT_S": "3",
        "ROLLSTREAM_PRODUCER__HEARTBEAT_S": "0.2",
    }


class Proc:
    """A process of the run with its output in a file (a pipe nobody reads would stall it)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], folder: Path) -> None:
        self.name, self.log = name, folder / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def running(self) -> bool:
        code = self.proc.poll()
        assert code is None, f"{self.name} exited with {code}: {self.text()[-3000:]}"
        return True


def foreign(name: str, url: str, run: str, folder: Path) -> Proc:
    return Proc(
        name, [sys.executable, str(PRODUCER), url, run, name, "--inflight", "3"], dict(os.environ), folder
    )


class Observer(threading.Thread):
    """Reads the replay buffer and the aborted pool while the run goes and decodes every
    entry with rollstream's own reader (a warning on a plain field fails the test)."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.base = f"rs:{{{run}}}"
        self.seen: dict[str, dict[str, Any]] = {}  # "kind id" -> decoded
        self.errors: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        from rollstream.cli.show import describe

        while not self.done.is_set():
            for kind in ("groups", "aborted"):
                for entry_id, fields in self.client.xrange(f"{self.base}:{kind}:math"):
                    key = f"{kind} {entry_id.decode()}"
                    if key not in self.seen and b"group_id" in fields:
                        record = describe(kind, entry_id.decode(), fields)
                        if record["kind"] != "group":
                            self.errors.append(f"{key}: {record}")
                        self.seen[key] = record
            time.sleep(0.02)
        self.client.close()

    def groups(self, kind: str) -> list[dict[str, Any]]:
        return [g for key, g in self.seen.items() if key.startswith(kind) and g["kind"] == "group"]


def prompts_file(folder: Path, count: int) -> Path:
    """q0 is filtered by the producers' filter, q1 fails its generation for good."""
    path = folder / "prompts.jsonl"
    rows = [{"uid": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(count)]
    rows[0]["filter"], rows[1]["poison"] = True, True
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def inject_junk(client: redis.Redis, base: str) -> bytes:
    """A prompt entry that breaks §5.1 (its data is not JSON), counted as fed as a feed
    script would count it, so that `rollstream status` accounts it."""
    with client.pipeline() as pipe:
        pipe.xadd(f"{base}:prompts:math", {"uid": "junk", "task": "math", "data": b"{", "format": "1.0"})
        pipe.hincrby(f"{base}:progress", "math:fed", 1)
        entry_id, _ = pipe.execute()
    return entry_id  # type: ignore[no-any-return]


def pending_of(client: redis.Redis, base: str, consumer: str) -> list[str]:
    out = []
    for kind in ("aborted", "expired", "prompts"):
        rows = client.xpending_range(f"{base}:{kind}:math", "producers", "-", "+", 1000, consumer)
        out += [f"{kind} {row['message_id'].decode()}" for row in rows]
    return out


def cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(rollstream(*args), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (args, done.stderr[-3000:])
    return done.stdout


def check_the_run(
    client: redis.Redis, env: dict[str, str], base: str, record: Path, steps: int, junk: bytes, fed: int
) -> dict[str, Any]:
    """What every run of this module must show once its processes have stopped."""
    reads = [e for e in map(orjson.loads, record.read_bytes().splitlines()) if e["event"] == "read"]
    commits = [
        e["step"] for e in map(orjson.loads, record.read_bytes().splitlines()) if e["event"] == "commit"
    ]
    assert [r["step"] for r in reads] == commits == list(range(1, steps + 1))
    # nothing trained twice; staleness by the decoded token versions below the bound
    trained = Counter(gid for r in reads for gid, _ in r["groups"])
    assert len(trained) == steps * BATCH and max(trained.values()) == 1
    for r in reads:
        for gid, oldest in r["groups"]:
            assert 0 <= r["step"] - oldest - 1 < THRESHOLD, (r["step"], gid, oldest)
    # the two dead letters put in on purpose, and nothing else
    dead = {f[b"source_id"]: f for _, f in client.xrange(f"{base}:dead")}
    assert len(dead) == 2 and junk in dead, dead
    assert dead.pop(junk)[b"reason"].startswith(b"undecodable pool entry")
    ((poisoned),) = dead.values()
    assert poisoned[b"uid"] == b"q1@0"  # the feeder's uid of q1 in its epoch 0
    assert (
        poisoned[b"reason"].startswith(b"generation failed")
        and poisoned[b"source"] == f"{base}:prompts:math".encode()
    )
    # the filtered prompt's record names it
    assert [f[b"uid"] for _, f in client.xrange(f"{base}:filtered")] == [b"q0@0"]
    # nothing left claimed: the stops handed everything back; their heartbeats are gone
    for kind in ("aborted", "expired", "prompts"):
        assert client.xpending(f"{base}:{kind}:math", "producers")["pending"] == 0, kind
    state = client.hgetall(f"{base}:state")
    assert not any(k.startswith(b"producer:") for k in state)
    assert not list(client.scan_iter(f"{base}:alive:*"))
    # `rollstream status` accounts every fed prompt
    status = orjson.loads(cli(env, "status", "--json"))
    account = status["accounts"]["math"]
    # (the feeder keeps a few prompts ahead: the run stops before it has fed them all)
    assert account["lost"] == 0 and steps * BATCH + 3 <= account["fed"] <= fed + 1, account
    assert (account["trained"], account["dead"], account["filtered"]) == (steps * BATCH, 2, 1), account
    # `rollstream show groups` decodes what the page's producers left in the replay buffer
    shown = [
        orjson.loads(line) for line in cli(env, "show", "groups", "--json", "--count", "1000").splitlines()
    ]
    assert shown and all(g["kind"] == "group" and g["status"] == "completed" for g in shown), shown[:2]
    assert all(g["producer"].startswith("page-") and len(g["samples"]) == N for g in shown)
    return account


def test_the_page_producers_make_the_groups_of_rollstreams_trainer(
    redis_server: Any, run_name: str, tmp_path: Path
) -> None:
    steps, fed = 10, 70
    env = env_for(redis_server.url, run_name, "partial")
    base = f"rs:{{{run_name}}}"
    client = redis.Redis.from_url(redis_server.url)
    record = tmp_path / "record.jsonl"
    path = prompts_file(tmp_path, fed)
    observer = Observer(redis_server.url, run_name)
    procs: list[Proc] = []
    try:
        procs.append(
            Proc(
                "feeder",
                rollstream(
                    "feed",
                    str(path),
                    "--task",
                    "math",
                    "--epochs",
                    "1",
                    "--keep-ahead",
                    "12",
                    "--until-stopped",
                ),
                env,
                tmp_path,
            )
        )
        wait_for(lambda: procs[0].running() and client.hexists(f"{base}:state", "settings"), timeout=60)
        junk = inject_junk(client, base)
        procs += [foreign(f"page-{i}", redis_server.url, run_name, tmp_path) for i in (1, 2)]
        observer.start()
        procs.append(
            Proc(
                "trainer",
                rollstream(
                    "train",
                    "--steps",
                    str(steps),
                    "--step-time",
                    "0.3",
                    "--stop-run",
                    "--record",
                    str(record),
                ),
                env,
                tmp_path,
            )
        )
        wait_for(lambda: all(p.proc.poll() is not None for p in procs), timeout=240)
    finally:
        observer.done.set()
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
    assert [p.proc.returncode for p in procs] == [0] * len(procs), {p.name: p.text()[-2000:] for p in procs}
    observer.join(timeout=10)
    assert observer.errors == []
    check_the_run(client, env, base, record, steps, junk, fed)
    # both page producers made groups, and followed every weight sync (a sync every step)
    logs = {p.name: p.text() for p in procs}
    for name in ("page-1", "page-2"):
        assert "completed q" in logs[name] and f"weight sync to {steps} (partial)" in logs[name], logs[name][
            -2000:
        ]
    # partial: groups interrupted by a sync were handed back with their tokens and continued
    versions = [s["versions"] for g in observer.groups("groups") for s in g["samples"]]
    assert any(len(runs) > 1 for runs in versions), "no sample continued across a weight sync"
    assert any(g["n"] > 0 for g in observer.groups("aborted"))
    client.close()
