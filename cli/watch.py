"""``rollstream status --watch``: the run's status refreshed in place, with rates between
refreshes and the warnings an operator acts on; plain blocks of lines when the output is
not a terminal (a log file, a pipe), the same figures in each.

A refresh reads what ``rollstream status`` reads (cli/status.py); Redis not
answering is a warning line of its own, and the watch goes on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import IO, Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from rollstream.cli.status import RunStatus, run_status
from rollstream.shared.connection import connect
from rollstream.shared.keys import GROUPS, Count, Keys, Role
from rollstream.shared.settings import Settings
from rollstream.shared.settings_errors import redact_url

STUCK_AFTER_S = 120.0  # no train step for this long while groups wait: a warning


@dataclass(slots=True)
class View:
    """One refresh: the status and what moved since the previous one."""

    status: RunStatus | None
    error: str = ""
    steps_per_min: float | None = None
    groups_per_s: float | None = None
    trained_per_s: float | None = None
    warnings: tuple[str, ...] = ()
    at: float = 0.0


class Watcher:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.client = client
        self.keys = Keys(settings.run)
        self._last: tuple[float, RunStatus] | None = None
        self._step_moved = time.monotonic()

    def view(self) -> View:
        now = time.monotonic()
        try:
            status = run_status(self.client, self.keys)
        except redis.RedisError as exc:
            return View(
                None, f"Redis at {redact_url(self.settings.redis.url)} does not answer: {exc}", at=time.time()
            )
        view = View(status, at=time.time())
        if self._last is not None:
            then, before = self._last
            dt = max(1e-9, now - then)
            if status.train_step is not None and before.train_step is not None:
                view.steps_per_min = 60 * (status.train_step - before.train_step) / dt
                if status.train_step != before.train_step:
                    self._step_moved = now
            view.groups_per_s = (_count(status, Count.COMPLETED) - _count(before, Count.COMPLETED)) / dt
            view.trained_per_s = (_count(status, Count.CONSUMED) - _count(before, Count.CONSUMED)) / dt
        view.warnings = tuple(self.warnings(status, now))
        self._last = (now, status)
        return view

    def warnings(self, status: RunStatus, now: float) -> list[str]:
        out = []
        if status.paused:
            out.append("the run is PAUSED: producers claim nothing (`rollstream resume`)")
        threshold = self.settings.rollout.stale_threshold
        model, train = status.model_step, status.train_step
        if model is not None and train is not None and model >= 0 and train - model >= threshold:
            out.append(
                f"STUCK: a group made now is {train - model} steps stale, it expires at {threshold} "
                "(`rollstream steps` says how to repair)"
            )
        waiting = sum(s.length for s in status.streams if s.kind == GROUPS)
        if waiting and now - self._step_moved > STUCK_AFTER_S:
            out.append(f"no train step for {now - self._step_moved:.0f} s while {waiting} groups wait")
        roles = {p.role for p in status.processes}
        for role in (Role.PRODUCER, Role.TRAINER):
            if role not in roles:
                out.append(f"no {role} alive")
        idle_limit = self.settings.buffer.claim_idle_ms
        for s in status.streams:
            if s.oldest_pending_idle_ms is not None and s.oldest_pending_idle_ms > idle_limit:
                out.append(
                    f"{s.key}: a claim idle {s.oldest_pending_idle_ms / 1000:.0f} s (past claim_idle_ms)"
                )
        for task, account in status.accounts.items():
            if account.lost:
                out.append(f"task {task}: {account.lost} prompts unaccounted for (lost)")
        if status.dead_letters:
            out.append(f"{status.dead_letters} dead letters (`rollstream show dead`)")
        return out


def _count(status: RunStatus, counter: Count) -> int:
    return sum(v for k, v in status.progress.items() if k.endswith(f":{counter.value}") and v > 0)


def _rate(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.2f} {unit}"


def eta(view: View) -> str:
    """ ", N steps left, ETA HH:MM" from the trainer's heartbeat and the step rate; "" when
    either is unknown."""
    assert view.status is not None
    left = [p.detail.get("steps_left") for p in view.status.processes if p.role == Role.TRAINER]
    known = [n for n in left if isinstance(n, int)]
    if not known:
        return ""
    steps = max(known)
    if not view.steps_per_min:
        return f", {steps} steps left"
    finish = view.at + 60 * steps / view.steps_per_min
    return f", {steps} steps left, ETA {time.strftime('%H:%M', time.localtime(finish))}"


def headline(view: View) -> str:
    status = view.status
    assert status is not None
    alive: dict[str, int] = {}
    for p in status.processes:
        alive[p.role] = alive.get(p.role, 0) + 1
    processes = ", ".join(f"{n} {role}" for role, n in sorted(alive.items())) or "none"
    return (
        f"run {status.run}: train_step {status.train_step}, model_step {status.model_step}"
        f"{', PAUSED' if status.paused else ''}{eta(view)} | {_rate(view.steps_per_min, 'steps/min')}, "
        f"produced {_rate(view.groups_per_s, 'groups/s')}, trained {_rate(view.trained_per_s, 'groups/s')} "
        f"| alive: {processes}"
    )


def plain(view: View) -> str:
    """The view as lines of text: for a log file or a pipe."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view.at))
    if view.status is None:
        return f"{stamp} WARNING {view.error}"
    lines = [f"{stamp} {headline(view)}"]
    for s in view.status.streams:
        idle = "-" if s.oldest_pending_idle_ms is None else f"{s.oldest_pending_idle_ms / 1000:.1f}s"
        lines.append(f"  {s.kind}:{s.task} length {s.length} pending {s.pending} lag {s.lag} oldest {idle}")
    for p in view.status.processes:
        step = p.detail.get("model_step", p.detail.get("step", ""))
        lines.append(
            f"  {p.role} {p.name} heartbeat {p.age_s:.1f}s ago{f' step {step}' if step != '' else ''}"
        )
    lines += [f"  WARNING {w}" for w in view.warnings]
    return "\n".join(lines)


def rich_view(view: View) -> Any:
    """The view as a rich renderable: for a terminal."""
    if view.status is None:
        return Text(f"WARNING {view.error}", style="bold red")
    streams = Table(title=None, expand=False)
    for column in ("stream", "task", "length", "pending", "lag", "oldest claim"):
        streams.add_column(column, justify="left" if column in ("stream", "task") else "right")
    for s in view.status.streams:
        idle = "-" if s.oldest_pending_idle_ms is None else f"{s.oldest_pending_idle_ms / 1000:.1f}s"
        streams.add_row(s.kind, s.task, str(s.length), str(s.pending), str(s.lag), idle)
    processes = Table(expand=False)
    for column in ("role", "name", "heartbeat", "step", "in flight"):
        processes.add_column(column)
    for p in view.status.processes:
        step = p.detail.get("model_step", p.detail.get("step", "-"))
        processes.add_row(p.role, p.name, f"{p.age_s:.1f}s", str(step), str(p.detail.get("inflight", "-")))
    parts: list[Any] = [Text(headline(view), style="bold"), streams, processes]
    parts += [Text(f"WARNING {w}", style="yellow") for w in view.warnings]
    parts.append(
        Text(time.strftime("%H:%M:%S", time.localtime(view.at)) + "  (Ctrl-C to leave)", style="dim")
    )
    return Group(*parts)


def watch(
    settings: Settings, stop: threading.Event, *, interval_s: float = 2.0, out: IO[str] | None = None
) -> int:
    """Refresh the run's status every ``interval_s`` until ``stop`` (Ctrl-C)."""
    import sys

    out = out or sys.stdout
    client = connect(settings.redis, check=False, ride_out=False)
    watcher = Watcher(settings, client)
    try:
        if out.isatty():
            console = Console(file=out)
            with Live(
                rich_view(watcher.view()), console=console, auto_refresh=False, transient=False
            ) as live:
                while not stop.wait(interval_s):
                    live.update(rich_view(watcher.view()), refresh=True)
        else:
            while True:
                out.write(plain(watcher.view()) + "\n\n")
                out.flush()
                if stop.wait(interval_s):
                    break
    finally:
        client.close()
    return 0
