"""Settling a group's claim off the event loop: a settle that a stop's cancellation never
drops (``settle_off_loop``), and the completed groups of one turn of the loop written
together (``Completions``), so that a Redis riding out an outage holds the settles,
not the producer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import Claim
from rollstream.shared.records import Group

T = TypeVar("T")


Pending = tuple[Claim, Group, "asyncio.Future[str | None]"]


async def settle_off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, a settle, in the loop's default executor; a cancellation of the
    caller (a stop) never cancels the settle: it waits for it to land, then goes on. A
    cancelled ``asyncio.to_thread`` drops a call that no worker thread has taken up yet
    (every thread busy, a loaded machine): the claim stayed pending after a cold stop."""
    future = asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])  # never cancels it; a second cancellation ends the wait
        raise


class Completions:
    """Completed groups written together: the groups that finish in one turn of the
    event loop share one fenced settle per pool (ReplayBuffer.complete_many) instead
    of a round trip each. Each caller still gets its own group's entry id, or None
    when its claim was reclaimed by another producer. The writes run in a thread, off
    the event loop: a Redis riding out an outage holds the settles, not the producer."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer
        self._pending: list[Pending] = []
        self._writing: set[asyncio.Task[None]] = set()
        self.flushes = 0

    async def complete(self, claim: Claim, group: Group) -> str | None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str | None] = loop.create_future()
        self._pending.append((claim, group, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)  # after the others finishing in this turn
        return await future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        self.flushes += 1
        task = asyncio.ensure_future(self._write_off_loop(pending))
        self._writing.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._writing.discard)

    async def _write_off_loop(self, pending: list[Pending]) -> None:
        try:
            # shielded: a cancelled call that no worker thread had taken up yet would be dropped
            writing = asyncio.get_running_loop().run_in_executor(None, self._write, pending)
            outcomes = await asyncio.shield(writing)
        except asyncio.CancelledError:  # the loop goes away: the write still lands (asyncio.run waits for it)
            for _, _, future in pending:
                future.cancel()
            raise
        for items, outcome in outcomes:  # futures are the loop's: resolved here, not in the thread
            self._resolve(items, outcome)

    def _write(self, pending: list[Pending]) -> list[tuple[list[Pending], list[str | None] | Exception]]:
        """The settles, in a thread: each pool's outcome, for the loop to resolve."""
        by_stream: dict[str, list[Pending]] = {}
        for item in pending:
            by_stream.setdefault(item[0].entry.stream, []).append(item)
        outcomes: list[tuple[list[Pending], list[str | None] | Exception]] = []
        for items in by_stream.values():  # one settle each: all of it lands or none
            try:
                outcomes.append((items, self.buffer.complete_many([(c, g) for c, g, _ in items])))
                continue
            except Exception as exc:
                # Redis itself failing fails them all; anything else, try one by one
                if len(items) == 1 or isinstance(exc, redis.ConnectionError | redis.TimeoutError):
                    outcomes.append((items, exc))
                    continue
            for item in items:  # one by one, so that one group's error is that group's alone
                try:
                    outcomes.append(([item], self.buffer.complete_many([item[:2]])))
                except Exception as exc:
                    outcomes.append(([item], exc))
        return outcomes

    @staticmethod
    def _resolve(items: list[Pending], outcome: list[str | None] | Exception) -> None:
        for i, (_, _, future) in enumerate(items):
            if future.done():  # a cancelled waiter: its group was written all the same
                continue
            if isinstance(outcome, Exception):
                future.set_exception(outcome)  # its claim stays pending: reclaimed later
            else:
                future.set_result(outcome[i])
