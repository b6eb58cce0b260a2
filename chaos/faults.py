"""The chaos run's faults (chaos/run.py): which there are, in what rotation, and how each
is done to the processes the supervisor (chaos/supervisor.py) runs."""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from chaos.constants import CLAIM_IDLE_MS, TASK
from rollstream.shared.keys import TRAINER, Keys

if TYPE_CHECKING:
    from chaos.supervisor import Child

FIRST_FAULT_STEP = 2  # let the run get going first
STEPS_BETWEEN_FAULTS = (2, 4)  # train steps from one fault to the next, at random
FAULTS = (
    "kill_producer", "kill_trainer", "kill_feeder", "kill_judge", "kill_engine_actor",
    "stop_producer", "kill_redis", "kill_trainer_repeatedly", "kill_archive",
)  # fmt: skip
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

ENGINE_ACTOR = "ray::EngineActor"  # Ray's process title for an actor of that class


class Faults:
    """The faults of the supervisor (chaos/supervisor.py ``Chaos``) this is part of: what
    it has and does that a fault uses is named here."""

    if TYPE_CHECKING:
        out: Path
        faults: tuple[str, ...]
        env: dict[str, str]
        keys: Keys
        rng: random.Random
        children: dict[str, Child]
        lock: threading.Lock
        lost_at: float | None
        _order: list[str]

        def client(self) -> redis.Redis: ...

        def _train_step(self) -> int: ...

        def note(self, kind: str, detail: str = "") -> None: ...

    def _next_fault(self) -> str:
        """Every fault once, in a shuffled order, then again: a short run still sees each."""
        if not self._order:
            self._order = list(self.faults)
            self.rng.shuffle(self._order)
        return self._order.pop()

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
