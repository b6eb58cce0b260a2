"""The chaos suite: a fed run as processes under a small supervisor that restarts
whatever exits (as systemd's Restart=always would), with faults injected at random,
and an account of every prompt taken from the trainer's own record.

    python -m chaos.run            # the full suite (make chaos): every fault, a few minutes
    python -m chaos.run --smoke    # a short mixed-fault run (CI)

Processes: redis-server (deploy/redis.conf, append-only file, appendfsync always: see
"Durability" in the README), the engines process (2 simulated engines in Ray actors),
the feeder, 2 producers, the rq judge worker, the archiver (archive.keep set: the
trainer's commit logs each trained group for it), and the reference trainer with
``--record``, which appends each step's groups before its commit and the commit after
it. Faults: kill -9 of a producer, the trainer, the feeder, the judge worker, the
archiver, an engine actor; SIGSTOP of a producer past claim_idle_ms, then SIGCONT; kill -9 of redis-server,
restarted from its append-only file; kill -9 of the trainer 4 times within one step
(each time it has read its batch again), which must dead-letter no group.

Every fed prompt ends up in exactly one row of the table: trained once, trained again
after a step that was never committed, trained twice with both steps committed (a
failure), dead-lettered (with the reason), still pending (and where), or lost (a
failure). Every group the trainer committed is in the archive's Parquet files exactly
once (read back with pyarrow): one archived twice, or not at all, is a failure.
Staleness violations come from the versions the trainer decoded, not from
tags in Redis. Writes report.json and timeline.png to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from rollstream.shared.embedded import find_redis_server, free_port
from rollstream.shared.events import STOP, RunControl
from rollstream.shared.keys import GROUPS, POOLS, TRAINER, Count, Keys, progress_field

ROOT = Path(__file__).resolve().parents[1]
TASK = "math"
BATCH = 8
MAX_STALENESS = 1
THRESHOLD = MAX_STALENESS + 1  # sync_weights_interval 1
FIRST_FAULT_STEP = 2  # let the run get going first
STEPS_BETWEEN_FAULTS = (2, 4)  # train steps from one fault to the next, at random
CLAIM_IDLE_MS = 3000
FAULTS = (
    "kill_producer", "kill_trainer", "kill_feeder", "kill_judge", "kill_engine_actor",
    "stop_producer", "kill_redis", "kill_trainer_repeatedly", "kill_archive",
)  # fmt: skip
# The archive: the trained log holds at most this many unarchived groups (more than a run
# trains, so none is trimmed and every trained group must be archived), files are closed
# every FLUSH_S so that a kill -9 of the archiver lands between its writes and its acks.
ARCHIVE_KEEP = 100_000
ARCHIVE_FLUSH_S = 1.0
# kill_trainer_repeatedly: kill -9 the trainer each time it has read its batch again, before
# its commit, this many times within one step: more than buffer.max_attempts (3). A kill
# from outside is not a poison group: the step is redone on the same groups, none
# dead-lettered.
TRAINER_KILLS = 4
# redis_restarted_empty: Redis killed and started again without its data (no append-only
# file), as a server whose AOF was lost or that could not load it. It ends the run: the
# expected outcome is that every process stops with one clear error, exit 5 (RunLost), and
# is not restarted (systemd's RestartPreventExitStatus=5); none starts the run at step 0.
# Only by name (--faults redis_restarted_empty), never in the default rotation.
LOST = "redis_restarted_empty"
RET_LOST = 5


@dataclass
class Child:
    """One supervised process: restarted 0.5 s after it exits, until the run ends."""

    name: str
    argv: Callable[[], list[str]]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    exited_at: float | None = None
    exits: list[int] = field(default_factory=list)  # the exit status of each run of it

    def start(self, env: dict[str, str]) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv(), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.exited_at = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Chaos:
    out: Path
    prompts: int
    steps: int
    seconds_between_faults: float  # at least this long from one fault to the next
    faults: tuple[str, ...]
    seed: int
    port: int = field(default_factory=free_port)
    timeline: list[tuple[float, str, str]] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.run = f"chaos{self.seed}"
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.keys = Keys(self.run)
        self.record = self.out / "trainer.record.jsonl"
        self.archive_dir = self.out / "archive"
        self.rng = random.Random(self.seed)
        self.env = self._env()
        self.children: dict[str, Child] = {}
        self.lock = threading.Lock()
        self._order: list[str] = []
        self._client: redis.Redis | None = None
        self.lost_at: float | None = None  # when Redis came back empty (redis_restarted_empty)

    # --- set-up ----------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(
            ROLLSTREAM_RUN=self.run,
            ROLLSTREAM_REDIS__URL=self.url,
            ROLLSTREAM_TASKS=f'[{{"name": "{TASK}", "n": 4}}]',
            ROLLSTREAM_ROLLOUT__BATCH_SIZE=str(BATCH),
            ROLLSTREAM_ROLLOUT__MAX_STALENESS=str(MAX_STALENESS),
            ROLLSTREAM_ENGINES__COUNT="2",
            ROLLSTREAM_ENGINES__NUM_CPUS="0",
            ROLLSTREAM_ENGINES__MAX_RESTARTS="-1",
            ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="10",
            ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS="200",
            ROLLSTREAM_ENGINES__SIM__MAX_CONCURRENCY="16",
            ROLLSTREAM_BUFFER__CLAIM_IDLE_MS=str(CLAIM_IDLE_MS),
            ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
            ROLLSTREAM_PRODUCER__JUDGE_ON_QUEUE="true",
            ROLLSTREAM_PRODUCER__JUDGE_TIMEOUT_S="5",
            ROLLSTREAM_PRODUCER__HEARTBEAT_S="0.5",
            ROLLSTREAM_PRODUCER__MAX_INFLIGHT="16",
            ROLLSTREAM_PROCESS__STOP_TIMEOUT_S="5",
            ROLLSTREAM_PROCESS__WAIT_TIMEOUT_S="300",
            ROLLSTREAM_ARCHIVE__KEEP=str(ARCHIVE_KEEP),
            ROLLSTREAM_ARCHIVE__DIR=str(self.archive_dir),
            ROLLSTREAM_ARCHIVE__FLUSH_S=str(ARCHIVE_FLUSH_S),
        )
        return env

    def prompt_file(self) -> Path:
        path = self.out / "prompts.jsonl"
        rows = (
            orjson.dumps({"uid": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)})
            for i in range(self.prompts)
        )
        path.write_bytes(b"\n".join(rows) + b"\n")
        return path

    def children_spec(self) -> list[Child]:
        rs = [sys.executable, "-m", "rollstream.cli.main"]
        prompts = str(self.prompt_file())
        redis_dir = self.out / "redis"
        redis_dir.mkdir(exist_ok=True)
        redis_argv = [
            find_redis_server(), str(ROOT / "deploy" / "redis.conf"), "--port", str(self.port),
            "--dir", str(redis_dir), "--appendfsync", "always",
        ]  # fmt: skip
        specs: list[tuple[str, Callable[[], list[str]]]] = [
            ("redis", lambda: redis_argv),
            ("engines", lambda: [*rs, "engines", "--foreground"]),
            (
                "feeder",
                lambda: [
                    *rs,
                    "feed",
                    prompts,
                    "--task",
                    TASK,
                    "--epochs",
                    "1",
                    "--keep-ahead",
                    "48",
                    "--until-stopped",
                ],
            ),
            ("producer-0", lambda: [*rs, "produce"]),
            ("producer-1", lambda: [*rs, "produce"]),
            ("judge", lambda: [*rs, "judge"]),
            ("archive", lambda: [*rs, "archive"]),
            ("trainer", self._trainer_argv),
        ]
        return [Child(name, argv, self.out / f"{name}.log") for name, argv in specs]

    def _trainer_argv(self) -> list[str]:
        left = max(1, self.steps - self._train_step())
        return [sys.executable, "-m", "rollstream.cli.main", "train", "--steps", str(left),
                "--step-time", "0.2", "--record", str(self.record),
                "--state-file", str(self.out / "trainer.json")]  # fmt: skip

    # --- running ---------------------------------------------------------------------

    def client(self) -> redis.Redis:
        """One client for the supervisor (it reconnects by itself after a Redis restart)."""
        if self._client is None:
            self._client = redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)
        return self._client

    def _train_step(self) -> int:
        try:
            return RunControl(self.client(), self.keys).train_step()
        except redis.RedisError:
            return 0

    def note(self, kind: str, detail: str = "") -> None:
        self.timeline.append((time.monotonic() - self.started, kind, detail))
        print(f"{time.monotonic() - self.started:7.1f}s  {kind:18} {detail}", flush=True)

    def supervise(self, deadline_s: float) -> bool:
        """Run until the trainer has committed every step; True when it did in time."""
        for child in self.children_spec():
            self.children[child.name] = child
            child.start(self.env)
        # Faults come by train step, not by the clock: a run that goes faster (a quieter
        # machine, a faster build) sees as many faults as a slow one, and a short run sees
        # each kind. They are spaced in time too, so that what was killed can restart.
        next_fault_step, last_fault = FIRST_FAULT_STEP, -math.inf
        next_sample = time.monotonic()
        while time.monotonic() - self.started < deadline_s:
            now = time.monotonic()
            with self.lock:
                for child in self.children.values():
                    if child.alive or child.name == "redis":
                        continue
                    if child.exited_at is None:
                        child.exited_at = now
                        if child.proc is not None:
                            child.exits.append(child.proc.returncode)
                    if child.exits and child.exits[-1] == RET_LOST:
                        continue  # the run is lost: restarting it would start it again at step 0
                    elif now - child.exited_at >= 0.5:  # RestartSec
                        child.restarts += 1
                        child.start(self.env)
                        self.note("restart", child.name)
            if now >= next_sample:
                self._sample()
                next_sample = now + 1.0
            if self.lost_at is not None:
                if not any(c.alive for c in self.children.values() if c.name != "redis"):
                    self.note("stopped", "every process, the run being lost")
                    return True
                if now - self.lost_at > 60:
                    return False
                time.sleep(0.2)
                continue
            step = self._train_step()
            if step >= self.steps:
                self.note("done", f"train step {self.steps}")
                return True
            if self.faults and step >= next_fault_step and now - last_fault >= self.seconds_between_faults:
                self.inject(self._next_fault())
                next_fault_step = step + self.rng.randint(*STEPS_BETWEEN_FAULTS)
                last_fault = now
            time.sleep(0.2)
        return False

    def _next_fault(self) -> str:
        """Every fault once, in a shuffled order, then again: a short run still sees each."""
        if not self._order:
            self._order = list(self.faults)
            self.rng.shuffle(self._order)
        return self._order.pop()

    def _sample(self) -> None:
        try:
            c: Any = self.client()
            progress = {k.decode(): float(v) for k, v in c.hgetall(self.keys.progress).items()}
            step = RunControl(c, self.keys).train_step()
        except redis.RedisError:
            return
        self.samples.append(
            {
                "t": time.monotonic() - self.started,
                "train_step": step,
                "completed": progress.get(progress_field(TASK, Count.COMPLETED), 0.0),
                "expired": progress.get(progress_field(TASK, Count.EXPIRED), 0.0),
            }
        )

    # --- faults ----------------------------------------------------------------------

    def inject(self, fault: str) -> None:
        if fault == LOST:
            self._kill_redis(empty=True)
        elif fault == "kill_redis":
            self._kill_redis()
        elif fault == "kill_engine_actor":
            self._kill_engine_actor()
        elif fault == "kill_trainer_repeatedly":  # in the background: the supervisor restarts it
            threading.Thread(target=self._kill_trainer_repeatedly, daemon=True).start()
        elif fault == "stop_producer":
            child = self.children[self.rng.choice(["producer-0", "producer-1"])]
            if child.alive and child.proc is not None:
                child.proc.send_signal(signal.SIGSTOP)
                self.note("SIGSTOP", f"{child.name} for {CLAIM_IDLE_MS * 1.5 / 1000:.1f} s")
                proc = child.proc
                threading.Timer(CLAIM_IDLE_MS * 1.5 / 1000, lambda: _cont(proc)).start()
        else:
            name = {
                "kill_trainer": "trainer", "kill_feeder": "feeder", "kill_judge": "judge",
                "kill_archive": "archive",
            }.get(fault, self.rng.choice(["producer-0", "producer-1"]))  # fmt: skip
            child = self.children[name]
            if child.alive and child.proc is not None:
                child.proc.kill()
                self.note("kill -9", name)

    def _kill_trainer_repeatedly(self) -> None:
        """kill -9 of the trainer, TRAINER_KILLS times within one train step: each time it
        holds its batch again (read, or re-read after the last kill: every pending group
        delivered or touched since then), before its commit."""
        step = self._train_step()
        stream = self.keys.groups(TASK)
        last_kill = -math.inf
        kills = 0
        deadline = time.monotonic() + 120
        while kills < TRAINER_KILLS and time.monotonic() < deadline and self._train_step() == step:
            try:
                pending = self.client().xpending_range(stream, TRAINER, "-", "+", 1000)
            except redis.RedisError:
                pending = []
            since_ms = (time.monotonic() - last_kill) * 1000
            child = self.children["trainer"]
            if pending and all(int(p["time_since_delivered"]) < since_ms for p in pending):
                with self.lock:
                    if child.alive and child.proc is not None:
                        child.proc.kill()
                        kills += 1
                        last_kill = time.monotonic()
                        self.note(
                            "kill -9",
                            f"trainer within one step ({kills} of {TRAINER_KILLS}, step {step + 1})",
                        )
            time.sleep(0.01)

    def _kill_redis(self, empty: bool = False) -> None:
        with self.lock:
            child = self.children["redis"]
            if child.proc is not None:
                child.proc.kill()
                child.proc.wait()
            self.note("kill -9", "redis-server")
            if empty:  # its append-only file lost: it comes back without the run's data
                shutil.rmtree(self.out / "redis")
                (self.out / "redis").mkdir()
            time.sleep(1.0)
            child.restarts += 1
            child.start(self.env)
            if empty:
                self.lost_at = time.monotonic()
            self.note("restart", "redis-server, empty" if empty else "redis-server from its append-only file")

    def _kill_engine_actor(self) -> None:
        """kill -9 of one engine actor of this run's Ray cluster: the one that the engines
        process it started owns (``--foreground``: a local cluster whose raylet forks the
        actors), never an actor of another cluster on the same machine."""
        engines = self.children.get("engines")
        if engines is None or engines.proc is None or not engines.alive:
            return
        pids = engine_actor_pids(engines.proc.pid)
        if pids:
            pid = self.rng.choice(pids)
            os.kill(pid, signal.SIGKILL)
            self.note("kill -9", f"engine actor (pid {pid})")

    # --- the end ---------------------------------------------------------------------

    def drain_archive(self, timeout_s: float = 60.0) -> bool:
        """Before the run's stop: the archiver (restarted if a fault left it down, the
        supervisor no longer running) until the trained log is empty, every trained group
        archived; True when it was in time."""
        deadline = time.monotonic() + timeout_s
        child = self.children.get("archive")
        while time.monotonic() < deadline:
            if child is not None and not child.alive:
                if child.proc is not None and child.exited_at is None:
                    child.exits.append(child.proc.returncode)
                child.restarts += 1
                child.start(self.env)
                self.note("restart", "archive, to archive the run's last steps")
            try:
                if self.client().xlen(self.keys.trained(TASK)) == 0:
                    return True
            except redis.RedisError:
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        """The run's stop event, then SIGTERM and SIGKILL for whatever is left."""
        with contextlib.suppress(redis.RedisError):
            RunControl(self.client(), self.keys).publish(STOP)
        deadline = time.monotonic() + 30
        for child in self.children.values():
            if child.name == "redis" or child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.terminate()
                try:
                    child.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()

    def shutdown_redis(self) -> None:
        child = self.children.get("redis")
        if child is not None and child.proc is not None and child.proc.poll() is None:
            child.proc.terminate()
            child.proc.wait(timeout=30)


ENGINE_ACTOR = "ray::EngineActor"  # Ray's process title for an actor of that class


def engine_actor_pids(root: int) -> list[int]:
    """PIDs of the engine actors among the descendants of process ``root`` (the engines
    process the suite started: its Ray cluster's processes are its children, the actors
    its grandchildren). Processes elsewhere on the machine, another run's engine actors
    included, are never in it."""
    table = subprocess.run(
        ["ps", "-A", "-o", "pid=", "-o", "ppid=", "-o", "args="], capture_output=True, text=True, check=True
    ).stdout
    children: defaultdict[int, list[int]] = defaultdict(list)
    title: dict[int, str] = {}
    for line in table.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            children[int(parts[1])].append(int(parts[0]))
            title[int(parts[0])] = parts[2] if len(parts) == 3 else ""
    found, todo, seen = [], [root], {root}
    while todo:
        for pid in children.get(todo.pop(), []):
            if pid not in seen:
                seen.add(pid)
                todo.append(pid)
                if title[pid].startswith(ENGINE_ACTOR):
                    found.append(pid)
    return sorted(found)


def _cont(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)


# --- the account ---------------------------------------------------------------------


def account(chaos: Chaos, finished: bool) -> dict[str, Any]:
    """Every fed prompt in exactly one row, from the trainer's record and Redis."""
    client: Any = chaos.client()
    progress = {k.decode(): float(v) for k, v in client.hgetall(chaos.keys.progress).items()}
    # the feeder goes through the file in order (no shuffle): what it fed is a prefix
    fed = int(progress.get(progress_field(TASK, Count.FED), 0))
    expected = {f"{TASK}:q{i}@0" for i in range(fed)}
    reads: dict[int, list[list[Any]]] = {}
    committed: list[tuple[int, list[list[Any]]]] = []
    uncommitted_reads: Counter[str] = Counter()
    if chaos.record.exists():
        for line in chaos.record.read_bytes().splitlines():
            entry = orjson.loads(line)
            if entry["event"] == "read":
                if entry["step"] in reads:  # read again: the earlier read was never committed
                    uncommitted_reads.update(g for g, _ in reads[entry["step"]])
                reads[entry["step"]] = entry["groups"]
            else:
                committed.append((entry["step"], reads.pop(entry["step"], [])))
    for groups in reads.values():  # read, never committed
        uncommitted_reads.update(g for g, _ in groups)
    times: Counter[str] = Counter(g for _, groups in committed for g, _ in groups)
    violations = [
        (step, g, version)
        for step, groups in committed
        for g, version in groups
        if step - version - 1 >= THRESHOLD
    ]
    dead: dict[str, str] = {}
    groups_dead_for_deliveries = 0  # trained groups given up for deliveries: trainer kills charged to them
    for _, fields in client.xrange(chaos.keys.dead):
        gid = _group_id(fields)
        if gid:
            dead[gid] = fields.get(b"reason", b"").decode("utf-8", "replace")
            if fields.get(b"source") == chaos.keys.groups(TASK).encode() and dead[gid].startswith(
                "delivered"
            ):
                groups_dead_for_deliveries += 1
    pending: dict[str, str] = {}
    for kind in (*POOLS, GROUPS):
        for _, fields in client.xrange(chaos.keys.stream(kind, TASK)):
            gid = _group_id(fields)
            if gid:
                pending[gid] = kind
    rows: Counter[str] = Counter()
    where: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for gid in expected:
        n = times[gid]
        if n >= 2:
            rows["trained twice, both committed"] += 1
        elif n == 1:
            rows["trained again after an uncommitted step" if uncommitted_reads[gid] else "trained once"] += 1
        elif gid in dead:
            rows["dead-lettered"] += 1
            where["dead-lettered"][dead[gid].split(":")[0]] += 1
        elif gid in pending:
            rows["still pending"] += 1
            where["still pending"][pending[gid]] += 1
        else:
            rows["lost"] += 1
    completed = progress.get(progress_field(TASK, Count.COMPLETED), 0.0)
    expired = progress.get(progress_field(TASK, Count.EXPIRED), 0.0)
    archive = archived(chaos.archive_dir / "trained", {g for g, n in times.items() if n >= 1})
    faults = Counter(
        _fault_name(kind, detail) for _, kind, detail in chaos.timeline if kind in ("kill -9", "SIGSTOP")
    )
    return {
        "finished": finished,
        "steps": len(committed),
        "prompts": fed,
        "rows": dict(rows),
        "where": {k: dict(v) for k, v in where.items()},
        "lost": rows["lost"],
        "trained_twice_both_committed": rows["trained twice, both committed"],
        "groups_dead_for_deliveries": groups_dead_for_deliveries,
        "staleness_violations": len(violations),
        "expired_per_completed": round(expired / completed, 4) if completed else 0.0,
        "faults": dict(faults),
        "restarts": {c.name: c.restarts for c in chaos.children.values()},
        "archive": archive,
    }


def archived(folder: Path, trained: set[str]) -> dict[str, int]:
    """The archive's trained file set against the groups the trainer committed: each one
    archived exactly once (every sample in one row), none missing."""
    import pyarrow.dataset as ds

    rows: Counter[tuple[str, int]] = Counter()
    if folder.exists():
        table = ds.dataset(str(folder), format="parquet").to_table(columns=["group_id", "sample_index"])
        rows.update(
            zip(table.column("group_id").to_pylist(), table.column("sample_index").to_pylist(), strict=True)
        )
    groups = {g for g, _ in rows}
    return {
        "trained_groups": len(trained),
        "archived_groups": len(groups),
        "archived_once": len(trained & groups)
        - len({g for (g, _), n in rows.items() if n > 1 and g in trained}),
        "archived_twice": len({g for (g, _), n in rows.items() if n > 1}),
        "trained_not_archived": len(trained - groups),
        # archived, and not in the trainer's record as committed: a commit that landed
        # while the trainer was killed before it recorded it (not a failure of the archive)
        "archived_not_in_record": len(groups - trained),
    }


def lost_run(chaos: Chaos, deadline: float) -> int:
    """The redis_restarted_empty fault: once, after a few steps; the run passes when every
    process stopped with exit 5 and one clear error, none restarted, and the run is marked
    lost in Redis (so that a process started later refuses it too)."""
    chaos.faults = (LOST,)
    try:
        stopped = chaos.supervise(deadline)
    finally:
        chaos.stop()
    try:
        raw: Any = chaos.client().hgetall(chaos.keys.state)
        state = {k.decode(): v for k, v in raw.items()}
    finally:
        chaos.shutdown_redis()
    children = [c for c in chaos.children.values() if c.name != "redis"]
    errors = {c.name: [ln for ln in c.log.read_text(errors="replace").splitlines() if " is lost: " in ln]
              for c in children}  # fmt: skip
    result: dict[str, Any] = {
        "fault": LOST,
        "stopped": stopped,
        "exits": {c.name: c.exits for c in children},
        "clear_errors": {name: len(lines) for name, lines in errors.items()},
        "marked_lost": "lost" in state,
        "train_step_in_redis_after": state.get("train_step", b"").decode() or None,
    }
    (chaos.out / "report.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    ok = stopped and result["marked_lost"]
    ok = ok and all(c.exits and c.exits[-1] == RET_LOST for c in children)
    return 0 if ok and all(n >= 1 for n in result["clear_errors"].values()) else 1


def _fault_name(kind: str, detail: str) -> str:
    """ "kill -9 producer", "SIGSTOP producer", "kill -9 engine actor", ... without numbers."""
    what = detail.split(" (")[0].split(" for ")[0].rstrip("-0123456789")
    return f"{kind} {what}"


def _group_id(fields: Any) -> str:
    if b"group_id" in fields:
        return str(fields[b"group_id"].decode())
    if b"uid" in fields and b"task" in fields:
        return f"{fields[b'task'].decode()}:{fields[b'uid'].decode()}"
    return ""


def report(result: dict[str, Any]) -> str:
    lines = [
        f"finished: {'yes' if result['finished'] else 'NO'} ({result['steps']} steps committed)",
        "faults: " + ", ".join(f"{k} {v}x" for k, v in sorted(result["faults"].items())),
        "restarts: " + ", ".join(f"{k} {v}" for k, v in sorted(result["restarts"].items()) if v),
        f"{'prompts fed':42} {result['prompts']:>6}",
    ]
    for row in ("trained once", "trained again after an uncommitted step", "trained twice, both committed",
                "dead-lettered", "still pending", "lost"):  # fmt: skip
        detail = result["where"].get(row)
        extra = f"  ({', '.join(f'{k} {v}' for k, v in detail.items())})" if detail else ""
        lines.append(f"  {row:40} {result['rows'].get(row, 0):>6}{extra}")
    lines.append(f"{'staleness violations':42} {result['staleness_violations']:>6}")
    lines.append(f"{'expired per completed group':42} {result['expired_per_completed']:>6.3f}")
    archive = result["archive"]
    lines.append(f"{'trained groups archived exactly once':42} {archive['archived_once']:>6}")
    lines.append(f"  {'archived twice':40} {archive['archived_twice']:>6}")
    lines.append(f"  {'trained, not archived':40} {archive['trained_not_archived']:>6}")
    lines.append(f"  {'archived, not in the trainer record':40} {archive['archived_not_in_record']:>6}")
    return "\n".join(lines)


def plot(chaos: Chaos, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    t = [s["t"] for s in chaos.samples]
    ax.plot(t, [s["train_step"] for s in chaos.samples], label="train step")
    ax.plot(t, [s["completed"] / BATCH for s in chaos.samples], label="groups completed / batch")
    ax.plot(t, [s["expired"] for s in chaos.samples], label="groups expired")
    for at, kind, detail in chaos.timeline:
        if kind in ("kill -9", "SIGSTOP"):
            ax.axvline(at, color="red", alpha=0.3, linewidth=1)
            ax.text(at, 0, detail.split(" ")[0], rotation=90, fontsize=6, va="bottom")
    ax.set_xlabel("seconds")
    ax.legend(loc="upper left")
    ax.set_title("chaos run: faults (red), steps, throughput and expiries")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short mixed-fault run (CI)")
    parser.add_argument("--out", default="bench/results/chaos", help="where report.json, logs and the PNG go")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", help=f"comma-separated subset of {','.join(FAULTS)}, or {LOST} alone")
    parser.add_argument("--no-faults", action="store_true", help="a fault-free run, for comparison")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    faults = () if args.no_faults else tuple(args.faults.split(",")) if args.faults else FAULTS
    prompts, steps, every, deadline = (600, 40, 1.0, 300.0) if args.smoke else (2000, 150, 1.0, 1200.0)
    chaos = Chaos(out, prompts, steps, every, faults, args.seed)
    if LOST in faults:
        return lost_run(chaos, deadline)
    try:
        finished = chaos.supervise(deadline)
        drained = chaos.drain_archive()
        chaos.stop()
        result = account(chaos, finished)
        result["archive"]["drained"] = drained
    finally:
        chaos.stop()
        chaos.shutdown_redis()
    (out / "report.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    plot(chaos, out / "timeline.png")
    print(report(result))
    ok = result["finished"] and result["lost"] == 0 and result["trained_twice_both_committed"] == 0
    ok = ok and result["groups_dead_for_deliveries"] == 0
    archive = result["archive"]
    ok = ok and archive["drained"] and archive["archived_twice"] == 0 and archive["trained_not_archived"] == 0
    ok = ok and archive["archived_once"] == archive["trained_groups"]
    return 0 if ok and result["staleness_violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
