"""A producer's heartbeat: the one heartbeat thread of the process (liveness.Heartbeat)
beats, every producer.heartbeat_s, the producer's status in the run's state
(events.ProducerStatus: model step, groups in flight), its liveness key, and the idle
time of the claims it holds, so that none is reclaimed while its group takes long. The
beats come from a thread of their own: nothing that holds the event loop (a slow judge,
a Redis call riding out an outage) lets the producer's status or liveness expire or its
claims be taken over by another producer. ``keep_beating`` watches that thread from the
event loop: it fails when a beat does (the producer stops rather than go on without
liveness), and every few beats has the engines checked (one that Ray restarted at step
0 is brought back to the run's step).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import Claim
from rollstream.shared.events import RunControl
from rollstream.shared.liveness import Heartbeat, Liveness
from rollstream.shared.streams import Entry

ENGINE_CHECK_EVERY = 5  # heartbeats between checks that every engine is on the model step
BEAT_JOIN_S = 5.0  # at a stop, how long a beat under way may take before the stop goes on


def held(inflight: Mapping[Any, Claim]) -> list[Entry]:
    """The entries of the claims in flight, read from the heartbeat thread while the
    event loop may add or remove one."""
    while True:
        try:
            return [claim.entry for claim in list(inflight.values())]
        except RuntimeError:  # the dict changed size while it was copied: again
            continue


class ClaimTouches:
    """Which held claims a beat renews: each once it has been held ``every_s`` since the
    beat first saw it or last renewed it, not every claim at every beat. A claim's idle
    time then stays below ``every_s`` + 2 beats (the claim came at most a beat before the
    beat that first saw it): under claim_idle_ms when ``every_s`` is a third of it and a
    beat under a sixth. A group that finishes within ``every_s`` costs Redis no renewal at
    all, where renewing every claim at every beat cost an XPENDING and an XCLAIM per claim
    and beat (2 s by default: 30 of each for a one-minute group).

    With a claim_idle_ms under six beats, every claim is renewed at every beat."""

    def __init__(
        self, claim_idle_ms: int, beat_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        idle_s = claim_idle_ms / 1000
        self.every_s = idle_s / 3 if idle_s / 3 >= 2 * beat_s else 0.0
        self.clock = clock
        self._since: dict[tuple[str, str], float] = {}  # (stream, id): first seen or last renewed

    def due(self, entries: list[Entry]) -> list[Entry]:
        """The entries to renew now, of those held now; forgets the ones no longer held."""
        if self.every_s <= 0:
            return entries
        now = self.clock()
        since: dict[tuple[str, str], float] = {}
        due: list[Entry] = []
        for entry in entries:
            key = (entry.stream, entry.id)
            at = self._since.get(key, now)
            if now - at >= self.every_s:
                due.append(entry)
                at = now
            since[key] = at
        self._since = since
        return due


def producer_heartbeat(
    name: str,
    control: RunControl,
    buffer: ReplayBuffer,
    liveness: Liveness | None,
    every_s: float,
    state: Callable[[], tuple[int, Mapping[Any, Claim], bool]],
    on_failure: Callable[[BaseException], None],
) -> Heartbeat:
    """The heartbeat of producer ``name``, not started. ``state``: its model step, its
    claims in flight and whether the run is paused, read at each beat."""
    touches = ClaimTouches(buffer.buffer_settings.claim_idle_ms, every_s)

    def detail() -> dict[str, Any]:
        model_step, inflight, paused = state()
        return {"model_step": model_step, "inflight": len(inflight), "paused": paused}

    def status_and_claims() -> None:
        model_step, inflight, _ = state()
        control.publish_status(name, model_step, len(inflight))
        due = touches.due(held(inflight))
        if due:
            buffer.touch(due)

    return Heartbeat(
        liveness, detail, every_s=every_s, also=status_and_claims, on_failure=on_failure, name=name
    )


async def keep_beating(
    start: Callable[[Callable[[BaseException], None]], Heartbeat],
    every_s: float,
    check_engines: Callable[[], Awaitable[object] | None],
) -> None:
    """Start the heartbeat that ``start`` makes (handing it what to call when a beat
    fails), then wait: raise what failed a beat; every ENGINE_CHECK_EVERY beats, await
    ``check_engines`` (which may return None: nothing to check now). A cancellation (the
    producer's stop) leaves the thread beating, for the stop to end (``stop_beating``)."""
    loop = asyncio.get_running_loop()
    failed: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException) -> None:
        if not failed.done():
            failed.set_exception(exc)

    def fail(exc: BaseException) -> None:  # in the heartbeat thread
        with contextlib.suppress(RuntimeError):  # the loop is gone already
            loop.call_soon_threadsafe(settle, exc)

    heart = start(fail)
    try:
        await asyncio.to_thread(heart.start)  # its first beat, off the loop
        while True:
            await asyncio.wait([failed], timeout=every_s * ENGINE_CHECK_EVERY)
            if failed.done():
                failed.result()
            check = check_engines()
            if check is not None:
                await check
    except asyncio.CancelledError:
        raise  # the stop: the thread beats on while in-flight groups finish
    except BaseException:
        heart.stop(clear=False, wait_s=0)
        raise


async def stop_beating(heart: Heartbeat | None) -> None:
    """Stop the heartbeat thread and wait (bounded) for a beat under way, so that no beat
    lands after the stop has removed the producer's status. The liveness key is the
    process's to clear."""
    if heart is not None:
        await asyncio.to_thread(heart.stop, clear=False, wait_s=BEAT_JOIN_S)
