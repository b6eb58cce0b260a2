"""Record builders, waiting helpers and a hand-moved clock shared by the tests."""

from __future__ import annotations

import asyncio
import heapq
import importlib
import importlib.util
import inspect
import itertools
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from rollstream.shared.records import Group, Prompt, Sample

T = TypeVar("T")


def require(module: str, extra: str, *, load: bool = True) -> Any:
    """An optional dependency a test module needs, from the extra that installs it.

    In CI (CI set) every extra is installed and a missing one fails the run, never skips
    it; elsewhere the test module is skipped. ``load=False`` only looks for the module
    without importing it (vllm is imported only inside the engine actors, never by a test
    process); it then returns None."""
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        if os.environ.get("CI"):
            raise ImportError(f"{module} is not installed: CI runs these tests (pip install -e '.[{extra}]')")
        pytest.skip(f"{module} is not installed (extra {extra})", allow_module_level=True)
    return importlib.import_module(module) if load else None


def prompts(task: str, count: int, start: int = 0) -> list[Prompt]:
    return [
        Prompt(uid=f"u{i}", task=task, prompt=f"What is {i} + 1?", meta={"answer": str(i + 1)})
        for i in range(start, start + count)
    ]


def group_for(prompt: Prompt, n: int = 4, tokens: int = 8, step: int = 0) -> Group:
    samples = [
        Sample(
            prompt_ids=[1, 2, 3],
            response_ids=list(range(i, i + tokens)),
            logprobs=[-0.5] * tokens,
            response_versions=[step] * tokens,
            finish_reason="stop",
            reward={"score": float(i % 2)},
        )
        for i in range(n)
    ]
    return Group.for_prompt(prompt, samples=samples)


def unshared_port() -> int:
    """A free port below the kernel's ephemeral range (32768-60999 by default), for a set of
    servers whose ports must all be known before any of them starts (a Sentinel's config
    names its peers): no outgoing connection is ever given such a port, so it stays free
    between this choice and the server's bind unless someone binds it by number."""
    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    while True:
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


# A condition wait's deadline is there to end a hang, never to time anything: a test that
# passes on a quiet machine must pass on a busy one (make test beside two CPU hogs, a CI
# machine running other jobs), where starting a Python process or a Ray actor takes many
# times as long. So no wait gives up before this, whatever deadline its caller names; the
# names stay as the expected time on a quiet machine. Speed goes in bench/.
MIN_DEADLINE_S = 60.0


def _deadline(timeout: float) -> float:
    return time.monotonic() + max(timeout, MIN_DEADLINE_S)


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Poll until predicate() is truthy; fail with a clear message at the deadline (at
    least MIN_DEADLINE_S)."""
    deadline = _deadline(timeout)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {max(timeout, MIN_DEADLINE_S)} s")
        time.sleep(interval)


def wait_idle(client: redis.Redis, stream: str, group: str, idle_ms: int, timeout: float = 10.0) -> None:
    """Wait until the entries pending in a consumer group (at least one) have all been idle
    ``idle_ms``: claims that another consumer may now reclaim as abandoned."""

    def idle() -> bool:
        pending = client.xpending_range(stream, group, "-", "+", 1000)
        return bool(pending) and all(int(p["time_since_delivered"]) >= idle_ms for p in pending)

    wait_for(idle, timeout)


async def wait_for_async(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> Any:
    """wait_for inside an event loop: the predicate may be a coroutine function, and the
    loop runs on between polls. The deadline is at least MIN_DEADLINE_S, as wait_for's."""
    deadline = _deadline(timeout)
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {max(timeout, MIN_DEADLINE_S)} s")
        await asyncio.sleep(interval)


def still_running(task: asyncio.Task[Any]) -> bool:
    """True while ``task`` runs; once it has ended, its exception (or an AssertionError):
    in a wait on a condition, a crash is reported as the crash, not as a timeout."""
    if task.done():
        task.result()
        raise AssertionError(f"{task.get_name()} ended")
    return True


class _Timer:
    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock for the sim engine (``SimEngine(..., clock=)``) that moves only on
    ``advance``: the timers due on the way fire in order, each at its own time, so a
    test sees every event exactly when the model says, however busy the machine is."""

    def __init__(self) -> None:
        self.time = 0.0
        self._timers: list[tuple[float, int, _Timer]] = []
        self._order = itertools.count()  # ties fire in the order they were set

    def now(self) -> float:
        return self.time

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(callback)
        heapq.heappush(self._timers, (self.time + delay, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        end = self.time + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                self.time = max(self.time, when)
                timer.callback()
        self.time = end


def rollstream(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollstream.cli.main", *args]


class ProducerProcess:
    """`rollstream produce` with its output in files: a pipe nobody reads while the test
    waits would fill up and stall the producer."""

    def __init__(
        self,
        env: dict[str, str],
        folder: Path,
        name: str,
        command: Sequence[str] = ("produce", "--local-engines"),
    ) -> None:
        self.out, self.err = folder / f"{name}.out", folder / f"{name}.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(rollstream(*command), env=env, stdout=out, stderr=err)

    def running(self) -> bool:
        """True while it runs; a producer that exited fails the test with its output."""
        code = self.proc.poll()
        assert code is None, f"the producer exited with {code}: {self.err.read_text()[-2000:]}"
        return True

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        code = self.proc.wait(timeout=timeout)
        return code, self.out.read_text(), self.err.read_text()


DOCS_PAGES = ("README.md", *(f"docs/{page}" for page in (
    "index.md", "getting-started.md", "processes.md", "cluster.md", "engines.md", "trainers.md",
    "integrations.md", "metrics.md", "archive.md", "faults.md", "performance.md", "stream-format.md",
)))  # fmt: skip


def documentation() -> str:
    """The project's documentation as one text: the README and the site's pages (docs/,
    mkdocs.yml), in the site's order. Tests that check what the documentation says read
    this, wherever a section lives."""
    root = Path(__file__).resolve().parents[1]
    return "\n\n".join((root / page).read_text(encoding="utf-8") for page in DOCS_PAGES)
