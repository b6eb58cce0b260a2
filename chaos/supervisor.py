"""The chaos run's supervisor (chaos/run.py): the run's processes, each restarted
0.5 s after it exits (as systemd's Restart=always would), faults injected by train step
(chaos/faults.py), the run's progress sampled each second, and the end: the archive
drained, the stop event, the processes stopped."""

from __future__ import annotations

import contextlib
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from chaos.constants import (
    ARCHIVE_FLUSH_S,
    ARCHIVE_KEEP,
    BATCH,
    CLAIM_IDLE_MS,
    MAX_STALENESS,
    ROOT,
    TASK,
)
from chaos.faults import FIRST_FAULT_STEP, RET_LOST, STEPS_BETWEEN_FAULTS, Faults
from rollstream.shared.embedded import find_redis_server, free_port
from rollstream.shared.events import STOP, RunControl
from rollstream.shared.keys import Count, Keys, progress_field


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
class Chaos(Faults):
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
