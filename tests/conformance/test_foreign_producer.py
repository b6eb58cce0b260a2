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
import re
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
LIVENESS_TTL_S = 8  # longer than claim_idle_ms: a live producer reclaims before the trainer may
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


def prompts_file(folder: Path, count: int, special: bool = True) -> Path:
    """With ``special``, q0 is filtered by the page producers' filter and q1 fails its
    generation for good."""
    path = folder / "prompts.jsonl"
    rows = [{"uid": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(count)]
    if special:
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


def shown_groups(env: dict[str, str]) -> list[dict[str, Any]]:
    """`rollstream show groups --json`: the replay buffer as rollstream's reader decodes it."""
    out = cli(env, "show", "groups", "--json", "--count", "1000")
    return [orjson.loads(line) for line in out.splitlines()]


def foreign_groups_shown(env: dict[str, str]) -> list[dict[str, Any]]:
    """Waits until the page's producers have groups waiting in the replay buffer, and
    checks that rollstream decodes each group there as a completed group of n samples."""
    shown = wait_for(
        lambda: [g for g in shown_groups(env) if g["producer"].startswith("page-")], timeout=60, interval=0.5
    )
    assert all(g["kind"] == "group" and g["status"] == "completed" and len(g["samples"]) == N for g in shown)
    return shown


def check_the_run(
    client: redis.Redis,
    env: dict[str, str],
    base: str,
    record: Path,
    steps: int,
    junk: bytes,
    fed: int,
    clean: list[str],
    special: bool = True,
) -> dict[str, Any]:
    """What every run of this module must show once its processes have stopped;
    ``clean``: the producers that stopped on the stop event (the others were killed)."""
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
    # the dead letters put in on purpose, and nothing else
    dead = {f[b"source_id"]: f for _, f in client.xrange(f"{base}:dead")}
    assert len(dead) == 1 + special and junk in dead, dead
    assert dead.pop(junk)[b"reason"].startswith(b"undecodable prompt entry")
    assert [f[b"uid"] for _, f in client.xrange(f"{base}:filtered")] == ([b"q0@0"] if special else [])
    if not special:
        return check_the_account(client, env, base, steps, fed, clean, dead=1, filtered=0)
    ((poisoned),) = dead.values()
    assert poisoned[b"uid"] == b"q1@0"  # the feeder's uid of q1 in its epoch 0
    assert (
        poisoned[b"reason"].startswith(b"generation failed")
        and poisoned[b"source"] == f"{base}:prompts:math".encode()
    )
    return check_the_account(client, env, base, steps, fed, clean, dead=2, filtered=1)


def check_the_account(
    client: redis.Redis,
    env: dict[str, str],
    base: str,
    steps: int,
    fed: int,
    clean: list[str],
    *,
    dead: int,
    filtered: int,
) -> dict[str, Any]:
    """No claim left, the clean stops' heartbeats gone, and `rollstream status`'s account."""
    # nothing left claimed: the stops handed everything back; their heartbeats are gone
    for kind in ("aborted", "expired", "prompts"):
        assert client.xpending(f"{base}:{kind}:math", "producers")["pending"] == 0, kind
    state = client.hgetall(f"{base}:state")
    for name in clean:
        assert f"producer:{name}".encode() not in state
        assert not client.exists(f"{base}:alive:producer:{name}")
    # `rollstream status` accounts every fed prompt
    status = orjson.loads(cli(env, "status", "--json"))
    account = status["accounts"]["math"]
    # (the feeder keeps a few prompts ahead: the run stops before it has fed them all)
    assert account["lost"] == 0 and steps * BATCH + 3 <= account["fed"] <= fed + 1, account
    assert (account["trained"], account["dead"], account["filtered"]) == (steps * BATCH, dead, filtered), (
        account
    )
    return account


@pytest.mark.timeout(300)  # about 15 s on a quiet 2-core machine
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
        foreign_groups_shown(env)
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
    check_the_run(client, env, base, record, steps, junk, fed, ["page-1", "page-2"])
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


def paused(client: redis.Redis, base: str, name: str) -> bool:
    """The producer's liveness key says it is paused."""
    raw = client.get(f"{base}:alive:producer:{name}")
    return raw is not None and orjson.loads(raw)["detail"]["paused"] is True


def claims_while_paused(log: str) -> list[str]:
    """The claims a producer's log shows between a pause (or its start on a paused run)
    and the resume after it."""
    out, paused_now = [], False
    for line in log.splitlines():
        if line.startswith(("paused (", "foreign producer")):
            paused_now = line.startswith("paused (") or "paused" in line
        elif line == "resumed":
            paused_now = False
        elif paused_now and line.startswith(("claimed ", "reclaimed ")):
            out.append(line)
    return out


def train_step(client: redis.Redis, base: str) -> int:
    return int(client.hget(f"{base}:state", "train_step") or 0)


def kill_holding(proc: Proc, client: redis.Redis, base: str) -> list[str]:
    """SIGKILL a page producer at a moment it holds claims; the claims it left pending."""
    wait_for(lambda: proc.running() and pending_of(client, base, proc.name), timeout=60, interval=0.01)
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait()
    left = pending_of(client, base, proc.name)
    assert left, "killed between a settle and its next claim: nothing left pending"
    return left


@pytest.mark.heavy
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["drain", "abort", "partial"])
def test_the_page_producers_killed_synced_and_stopped(
    redis_server: Any, run_name: str, tmp_path: Path, mode: str
) -> None:
    steps, fed = 20, 160
    env = env_for(redis_server.url, run_name, mode)
    base = f"rs:{{{run_name}}}"
    client = redis.Redis.from_url(redis_server.url)
    record = tmp_path / "record.jsonl"
    path = prompts_file(tmp_path, fed)
    observer = Observer(redis_server.url, run_name)
    feed = ["feed", str(path), "--task", "math", "--epochs", "1", "--keep-ahead", "12", "--until-stopped"]
    procs = [Proc("feeder", rollstream(*feed), env, tmp_path)]
    try:
        wait_for(lambda: procs[0].running() and client.hexists(f"{base}:state", "settings"), timeout=60)
        junk = inject_junk(client, base)
        first, second = (foreign(f"page-{i}", redis_server.url, run_name, tmp_path) for i in (1, 2))
        procs += [first, second]
        observer.start()
        train = ["train", "--steps", str(steps), "--step-time", "0.3", "--stop-run", "--record", str(record)]
        trainer = Proc("trainer", rollstream(*train), env, tmp_path)
        procs.append(trainer)

        # Given a run at step 3, a page producer killed with claims pending while the other lives
        wait_for(lambda: trainer.running() and train_step(client, base) >= 3, timeout=120)
        left = kill_holding(first, client, base)
        # Then the live one takes them back (§11.9.4: every producer, at each claim), before
        # the dead one's liveness key has expired (the trainer would then hand them back)
        wait_for(lambda: second.running() and not pending_of(client, base, "page-1"), timeout=60)
        reclaimed = {line.split()[1] for line in second.text().splitlines() if line.startswith("reclaimed ")}
        assert {entry.split()[1] for entry in left} <= reclaimed, (left, second.text()[-3000:])

        # When the last page producer is killed with claims pending, and none runs for a while
        left = kill_holding(second, client, base)
        model_step = int(client.hget(f"{base}:state", "model_step") or 0)
        # Then the trainer, waiting for groups, hands them back to their pools (§11.9.4),
        # each with the deliveries it had, once the dead producer's liveness key is gone
        wait_for(lambda: trainer.running() and not pending_of(client, base, "page-2"), timeout=90)
        assert "handed back" in trainer.text() and "held by producers that are gone" in trainer.text()
        back = [
            f
            for kind in ("aborted", "expired", "prompts")
            for _, f in client.xrange(f"{base}:{kind}:math")
            if b"attempts" in f
        ]
        assert len(back) >= len(left) and all(int(f[b"attempts"]) >= 1 for f in back)
        # no producer: the trainer trains what was made, which admission bounds, and waits
        at = train_step(client, base)
        assert at <= model_step + THRESHOLD and at < steps

        # And two more page producers start on a paused run: they claim nothing until it resumes
        cli(env, "pause")
        later = [foreign(f"page-{i}", redis_server.url, run_name, tmp_path) for i in (3, 4)]
        procs += later
        wait_for(lambda: all(p.running() and paused(client, base, p.name) for p in later), timeout=60)
        cli(env, "resume")
        foreign_groups_shown(env)
        # and paused again while they generate: abort and partial hand back what runs at
        # once (partial with its tokens), drain lets it finish; then nothing is claimed
        wait_for(lambda: trainer.running() and train_step(client, base) >= at + 3, timeout=120)
        assert train_step(client, base) < steps - 4, "the run is too near its end to pause it"
        cli(env, "pause")
        wait_for(
            lambda: all(
                p.running() and "paused (" in p.text() and not pending_of(client, base, p.name) for p in later
            ),
            timeout=60,
        )
        cli(env, "resume")
        # and the run's last steps, ended by the trainer's stop event
        wait_for(lambda: all(p.proc.poll() is not None for p in procs), timeout=240)
    finally:
        observer.done.set()
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
    codes = {p.name: p.proc.returncode for p in procs}
    expected = {"feeder": 0, "page-1": -9, "page-2": -9, "trainer": 0, "page-3": 0, "page-4": 0}
    assert codes == expected, {p.name: p.text()[-2000:] for p in procs}
    observer.join(timeout=10)
    assert observer.errors == []
    check_the_run(client, env, base, record, steps, junk, fed, ["page-3", "page-4"])
    logs = {p.name: p.text() for p in procs}
    for name in ("page-3", "page-4"):
        assert "stop event" in logs[name] and "stopped:" in logs[name], logs[name][-2000:]
        assert claims_while_paused(logs[name]) == [], logs[name][-3000:]
        (pause,) = [line for line in logs[name].splitlines() if line.startswith("paused (")]
        assert pause.endswith(", 0 left to finish") or mode == "drain", pause
    # What a weight sync did to the groups in flight, by on_weight_sync
    syncs = [line for name in ("page-1", "page-2", "page-3", "page-4") for line in logs[name].splitlines()]
    handed = [
        int(m[1])
        for line in syncs
        if (m := re.fullmatch(r"weight sync to \d+ \(\w+\): (\d+) handed back", line))
    ]
    multi = [s["versions"] for g in observer.groups("groups") for s in g["samples"] if len(s["versions"]) > 1]
    aborted = observer.groups("aborted")
    if mode == "drain":  # finished on the weights they started with: one version per sample
        assert any("draining" in line for line in syncs) and not any(handed) and multi == []
    elif mode == "abort":  # handed back with nothing, made again on the new weights
        assert any(handed) and multi == [] and aborted and all(g["n"] == 0 for g in aborted)
    else:  # partial: handed back with their tokens, continued on the new weights
        assert any(handed) and multi and any(g["n"] > 0 for g in aborted)
    client.close()


@pytest.mark.timeout(300)  # about 15 s on a quiet 2-core machine
def test_a_page_producer_and_a_bundled_one_share_a_run(
    redis_server: Any, run_name: str, tmp_path: Path
) -> None:
    """The page's producer beside `rollstream produce`: each claims what the other handed
    back (the aborted pool in partial mode), the trainer takes groups of both."""
    steps, fed = 10, 70
    env = {
        **env_for(redis_server.url, run_name, "partial"),
        "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "20",
        "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "100",
        "ROLLSTREAM_PRODUCER__IS_VALID": "keep_all",
    }
    base = f"rs:{{{run_name}}}"
    client = redis.Redis.from_url(redis_server.url)
    record = tmp_path / "record.jsonl"
    path = prompts_file(tmp_path, fed, special=False)
    observer = Observer(redis_server.url, run_name)
    feed = ["feed", str(path), "--task", "math", "--epochs", "1", "--keep-ahead", "12", "--until-stopped"]
    procs = [Proc("feeder", rollstream(*feed), env, tmp_path)]
    try:
        wait_for(lambda: procs[0].running() and client.hexists(f"{base}:state", "settings"), timeout=60)
        junk = inject_junk(client, base)
        procs.append(foreign("page-1", redis_server.url, run_name, tmp_path))
        procs.append(Proc("bundled", rollstream("produce", "--local-engines"), env, tmp_path))
        observer.start()
        train = ["train", "--steps", str(steps), "--step-time", "0.3", "--stop-run", "--record", str(record)]
        procs.append(Proc("trainer", rollstream(*train), env, tmp_path))
        foreign_groups_shown(env)
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
    check_the_run(client, env, base, record, steps, junk, fed, ["page-1"], special=False)
    made = observer.groups("groups")
    assert all(g["n"] == N for g in made)
    makers = {g["producer"] for g in made}
    assert "page-1" in makers and any(m.startswith("producer-") for m in makers), makers
    # the bundled producer continued groups the page's producer handed back with their tokens
    handed = {g["group_id"] for g in observer.groups("aborted") if g["producer"] == "page-1" and g["n"] > 0}
    continued = {g["group_id"] for g in made if g["producer"].startswith("producer-")} & handed
    assert continued, (len(handed), makers)
    client.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mark", ["rewound", "run_id"])
def test_the_page_producer_stops_on_a_run_that_went_backwards_or_was_lost(
    redis_server: Any, run_name: str, tmp_path: Path, mark: str
) -> None:
    """§6: a run marked rewound (its latest committed steps lost), or whose run_id
    changed (Redis came back without the run), stops the page's producer (exit 5)."""
    env = env_for(redis_server.url, run_name, "partial")
    base = f"rs:{{{run_name}}}"
    client = redis.Redis.from_url(redis_server.url)
    cli(env, "feed", str(prompts_file(tmp_path, 8, special=False)), "--task", "math")
    producer = foreign("page-1", redis_server.url, run_name, tmp_path)
    try:
        wait_for(lambda: producer.running() and pending_of(client, base, "page-1"), timeout=60)
        if mark == "rewound":
            client.hsetnx(f"{base}:state", "rewound", orjson.dumps({"what": "a test", "train_step": 0}))
        else:
            client.hset(f"{base}:state", "run_id", "another")
        assert producer.proc.wait(timeout=60) == 5, producer.text()[-2000:]
    finally:
        if producer.proc.poll() is None:
            producer.proc.kill()
            producer.proc.wait()
    assert "the run is lost or rewound" in producer.text()
    client.close()
