"""The produce loop: admit claims within the staleness bound, generate each group on the
engine pool, follow weight syncs. Any number of producers run it, on any machines;
they coordinate only through Redis.

Admission (docs/stream-format.md, section 7, "Producers' admission reads these counters",
and 11.3, "Staleness and expiry"): per task, a producer claims new work only while
accepted + running < limit, checked atomically in Redis, with

    async: limit = (model_step + stale_threshold) x batch + over_sample_budget
    sync:  limit = (model_step + sync_weights_interval) x batch + over_sample_budget

(accepted: completed groups less those that left the groups stream untrained,
keys.UNTRAINABLE), and in sync mode the groups still in flight once the batches up to
the next weight sync are complete are aborted
into the aborted pool. On a weight sync the producer stops claiming, has the engines
move to the new step (drain, abort or partial: see EngineActor.sync_weights), and
claims again.

The producer takes its parts ready-made and a ProducerPlan of the numbers it needs:
producer/assembly.py, the producer's composition root, builds both from the settings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from rollstream.producer.failures import FailureLog, run_gone, why
from rollstream.producer.filters import ShouldContinue
from rollstream.producer.fleet.pool import BasePool
from rollstream.producer.group import GroupRunner, Window
from rollstream.producer.heartbeat import keep_beating, producer_heartbeat, stop_beating
from rollstream.producer.progress import METRICS_CAP, ProducerStats, metrics_record, report_progress
from rollstream.shared.allocation import over_sample_budget
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import Claim
from rollstream.shared.errors import CorruptValueError, RollstreamError
from rollstream.shared.events import PAUSE, RESUME, STOP, WEIGHT_SYNC, RunControl
from rollstream.shared.keys import EVALS
from rollstream.shared.liveness import Heartbeat, Liveness
from rollstream.shared.telemetry import admission_wait, group_finished, track_inflight, weight_synced

POLL_S = 0.05  # after an empty look; doubled per empty look in a row up to producer.idle_poll_max_s
# At the admission bound only a weight sync (the events task wakes the loop), a group of this
# producer settling (it wakes the loop too) or another process's settle or expiry can make
# room: the loop looks again on those, else at this pace, not every POLL_S.
ADMIT_POLL_S = 1.0
SETTLE_S = 2.0  # at a stop, how long aborted groups get to settle before they are cancelled
log = logging.getLogger(__name__)
__all__ = ["BackgroundTaskFailed", "Producer", "ProducerPlan"]


class BackgroundTaskFailed(RollstreamError):
    """A background task of the producer (events, heartbeat) died: the producer stops
    rather than go on without weight syncs or liveness."""


@dataclass(frozen=True, slots=True)
class ProducerPlan:
    """The numbers and names the produce loop reads, picked out of the settings by the
    composition root (producer/assembly.py: producer_plan). ``batch``: each task's groups
    per train step (the batch size split by the tasks' weights), in the tasks' order;
    ``group_sizes``: each task's n."""

    run: str
    mode: Literal["sync", "async"]
    on_weight_sync: Literal["drain", "abort", "partial"]
    batch: Mapping[str, int]
    group_sizes: Mapping[str, int]
    over_sample_threshold: float
    stale_threshold: int
    sync_weights_interval: int
    tail_batch_trigger_size: int
    max_inflight: int
    heartbeat_s: float
    idle_poll_max_s: float
    sync_timeout_s: float
    stop_timeout_s: float
    progress_s: float


def _raise_if_failed(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            raise BackgroundTaskFailed(f"the producer's {task.get_name()} task failed: {why(exc)}") from exc


class Producer:
    """The produce loop over parts built elsewhere (producer/assembly.py: build_producer):
    ``buffer`` the run's replay buffer as consumer ``name``, ``control`` the run's state and
    events, ``pool`` the engines, ``runner`` what makes one group of a claim on them,
    ``should_continue`` the sync-mode plug-in, ``plan`` the numbers it needs."""

    def __init__(
        self,
        plan: ProducerPlan,
        *,
        name: str,
        buffer: ReplayBuffer,
        control: RunControl,
        pool: BasePool,
        runner: GroupRunner,
        should_continue: ShouldContinue,
        liveness: Liveness | None = None,
    ) -> None:
        self.plan = plan
        self.name = name
        self.buffer = buffer
        self.control = control
        self.pool = pool
        self.runner = runner
        self.batch = dict(plan.batch)
        self._should_continue = should_continue
        self.model_step = 0
        self.stats = ProducerStats()
        self.failures = FailureLog(log, quiet=run_gone(buffer.client, buffer.keys))  # said once, then counted
        self.inflight: dict[asyncio.Task[str], Claim] = {}
        self._open = asyncio.Event()  # claiming allowed (cleared during a weight sync)
        self.cold = asyncio.Event()  # a cold stop: in-flight work is handed back at once
        self.paused = False  # the run is paused: claim nothing until it resumes
        self.run_stopped = False  # the run's stop event ended run()
        self.liveness = liveness
        self._wake = asyncio.Event()  # something moved the admission bound: look again now
        self._next_admit = 0.0  # the loop's time of the next look at admission without a wake-up
        self._at_bound = False  # the last admission found every task at its bound
        self._idle_poll = POLL_S  # the wait after the next empty look (doubles while idle)
        self._beats: Heartbeat | None = None  # the heartbeat of a run() under way
        self._tail: dict[str, bool] = {task: False for task in plan.batch}

    async def run(
        self, stop: asyncio.Event | None = None, *, burst: bool = False, cold: asyncio.Event | None = None
    ) -> ProducerStats:
        """Produce until ``stop`` is set or the run is stopped, or, with ``burst``, until
        there is no work this producer may take. ``cold`` set while stopping (a second
        SIGTERM) cuts the stop's grace short: what is in flight is handed back at once."""
        stop = stop or asyncio.Event()
        self.cold = cold or asyncio.Event()
        # The newest event's id before the state: a weight sync or pause published while
        # this producer starts is then either in the state it reads or in the events it follows.
        after = self.control.last_event_id()
        # a progress counter that a settle would fail on is the run's fault, not the prompts':
        # stop now, naming the repair, before claiming (and charging a delivery to) any of them
        for name in self.batch:
            self.buffer.check_settle_counters(name)
        self.model_step = self.control.model_step()  # a late starter joins at the current step
        self.paused = self.control.paused()
        plan = self.plan
        await self.pool.sync_weights(self.model_step, mode=plan.on_weight_sync, timeout_s=plan.sync_timeout_s)
        # an agent with resources of its own (the proxy's HTTP server) starts and stops them
        # in these optional hooks: async startup() and shutdown()
        agent_startup, agent_shutdown = (getattr(self.runner.agent, h, None) for h in ("startup", "shutdown"))
        if agent_startup is not None:
            await agent_startup()
        self._open.set()
        track_inflight(lambda: len(self.inflight), lambda: self.pool.outstanding)
        log.info(
            "producer %s joins run %r at model step %d%s",
            self.name, self.plan.run, self.model_step, " (paused)" if self.paused else "",
        )  # fmt: skip
        background = [
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._follow_events(after, stop), name="events"),
            asyncio.create_task(self._report(), name="progress"),
        ]
        try:
            while not stop.is_set():
                _raise_if_failed(background)
                if not self.paused and self._open.is_set() and self._admission_due():
                    # in a thread: a Redis riding out an outage holds the admission, not the loop
                    # (the weight syncs, the proxy's HTTP server, the groups in flight go on)
                    claims = await asyncio.to_thread(self.admit)
                    if self.paused:  # the run paused meanwhile: claim nothing, hand them back
                        await asyncio.to_thread(self._hand_back, claims)
                        claims = []
                    for claim in claims:
                        self.inflight[asyncio.create_task(self.runner.run(claim, self.model_step))] = claim
                    await self.abort_leftovers()
                    self._next_admit = asyncio.get_running_loop().time() + self._poll_wait(claims)
                if burst and not self.inflight and (self.paused or self.no_work_left() or self.blocked()):
                    break
                await self._settled(stop)
        finally:
            for task in background:
                task.cancel()  # the heartbeat thread beats on through the stop (see _shutdown)
            await self._shutdown(self.plan.stop_timeout_s / 2)
            if agent_shutdown is not None:
                await agent_shutdown()
            await self.record_metrics()
        self.stats.retries = self.runner.retries
        return self.stats

    # --- admission ---------------------------------------------------------------------

    def limit(self, task: str) -> int:
        plan = self.plan
        batch = self.batch[task]
        budget = 0 if self._tail[task] else over_sample_budget(batch, plan.over_sample_threshold)
        # sync: the batches of the steps until the next weight sync (one, at interval 1)
        ahead = plan.stale_threshold if plan.mode == "async" else plan.sync_weights_interval
        return (self.model_step + ahead) * batch + budget

    def admit(self) -> list[Claim]:
        """Claim what the admission bound lets in. Sets ``_at_bound`` when nothing came
        because every task is at its bound (or has its sync batch), not for want of work."""
        room = self.plan.max_inflight - len(self.inflight)
        claims: list[Claim] = []
        at_bound = room > 0
        for task in self.batch:
            if room - len(claims) <= 0:
                break
            if not self.should_continue(task):
                # sync mode with the batch done: eval prompts (and claims of dead producers,
                # admitted already) are still served; limit 0 admits nothing new
                claims += self.buffer.claim(task, room - len(claims), limit=0)
                continue
            got = self.buffer.claim(
                task, room - len(claims), include_expired=self._expired_first(task), limit=self.limit(task)
            )
            if not got and self.buffer.unclaimed(task) > 0:
                self.stats.admission_waits += 1
                admission_wait(task)
            else:
                at_bound = False  # work came, or none waits: new prompts are looked for at POLL_S
            claims += got
        self.stats.claims += len(claims)
        self._at_bound = at_bound and not claims
        return claims

    def _poll_wait(self, claims: list[Claim]) -> float:
        """The wait until the next look: ADMIT_POLL_S at the bound, POLL_S after a claim, and
        after an empty look (no work) the last wait doubled, up to producer.idle_poll_max_s."""
        if claims or self._at_bound:
            self._idle_poll = POLL_S
            return ADMIT_POLL_S if self._at_bound else POLL_S
        wait = self._idle_poll
        self._idle_poll = min(2 * wait, max(POLL_S, self.plan.idle_poll_max_s))
        return wait

    def _hand_back(self, claims: list[Claim]) -> None:
        for claim in claims:
            self.buffer.abort(claim, [])

    def _admission_due(self) -> bool:
        """Whether the loop looks at admission now: woken (a weight sync, a resume, a group
        of this producer settled), or its next look is due."""
        if self._wake.is_set():
            self._wake.clear()
            self._idle_poll = POLL_S  # something changed: look quickly again if this look is empty
            return True
        return asyncio.get_running_loop().time() >= self._next_admit

    def should_continue(self, task: str) -> bool:
        """sync mode asks the should_continue plug-in (default: accepted < the batch's
        target); async mode keeps going within the admission bound."""
        if self.plan.mode != "sync":
            return True
        return self._should_continue(self.buffer.accepted(task), self._sync_target(task))

    def _sync_target(self, task: str) -> int:
        """sync mode: groups accepted once every step up to the next weight sync has its
        batch (the trainer publishes only every sync_weights_interval steps)."""
        return (self.model_step + self.plan.sync_weights_interval) * self.batch[task]

    def _expired_first(self, task: str) -> bool:
        """Tail-batch mode: -1 never re-rolls expired prompts, 0 at once, N once N wait;
        then the expired pool goes first, without over-sampling, until it is empty."""
        trigger = self.plan.tail_batch_trigger_size
        if trigger <= 0:
            return trigger == 0
        waiting = int(self.buffer.client.xlen(self.buffer.keys.expired(task)))
        self._tail[task] = waiting >= trigger or (self._tail[task] and waiting > 0)
        return self._tail[task]

    async def abort_leftovers(self) -> None:
        """sync mode: once a task's batch is complete, what is still in flight goes back
        to the aborted pool (its partial tokens with it, in partial mode)."""
        if self.plan.mode != "sync" or not self.runner.inflight:
            return
        evals = tuple(f"{c.group_id}#{c.entry.id}#" for c in self.inflight.values() if c.source == EVALS)
        accepted = await asyncio.to_thread(lambda: {t: self.buffer.accepted(t) for t in self.batch})
        for task in self.batch:
            if accepted[task] >= self._sync_target(task):
                ids = [
                    rid
                    for rid in self.runner.inflight
                    if rid.startswith(f"{task}:") and not rid.startswith(evals)  # evals are no leftovers
                ]
                if ids:
                    await self.pool.abort(ids)

    def blocked(self) -> bool:
        """No task may take more work now: sync mode has its batches, or async mode is at
        the admission bound (only a newer model step moves it)."""
        return all(
            not self.should_continue(t) or self.buffer.accepted(t) + self.buffer.running(t) >= self.limit(t)
            for t in self.batch
        )

    def no_work_left(self) -> bool:
        """Nothing to claim, and nothing claimed by anyone: a dead producer's claims are
        work that comes back once they are idle long enough to reclaim."""
        return all(
            self.buffer.unclaimed(t) == 0
            and self.buffer.client.xlen(self.buffer.keys.aborted(t)) == 0
            and self.buffer.running(t) == 0
            for t in self.batch
        )

    def _count(self, claim: Claim, outcome: str) -> None:
        self.stats.count(outcome)
        group_finished(claim.task, outcome, self.plan.group_sizes[claim.task])

    async def _settled(self, stop: asyncio.Event) -> None:
        """Wait for a group to finish, a wake-up (weight sync, resume), the stop, or the
        next look at admission: POLL_S for new work (backing off to producer.idle_poll_max_s
        while looks come back empty), ADMIT_POLL_S at the bound."""
        loop = asyncio.get_running_loop()
        timeout = max(POLL_S, self._next_admit - loop.time())
        if self.paused or not self._open.is_set():
            self._wake.clear()  # set again when claiming may go on (a resume, a sync's end)
        woken = asyncio.ensure_future(self._wake.wait())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait(
                {*self.inflight, woken, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            woken.cancel()
            stopped.cancel()
        for task in [t for t in self.inflight if t.done()]:
            claim = self.inflight.pop(task)
            self._next_admit = 0.0  # a settle frees room (and may move the bound): look now
            self._idle_poll = POLL_S
            failure = task.exception()
            if isinstance(failure, CorruptValueError):
                raise failure  # a counter every settle fails on: stop, naming it (once)
            if task.exception() is not None:
                # unsettled: the claim stays pending and is reclaimed (by this producer too,
                # once idle: it no longer holds it), counted as a delivery
                self.buffer.release([claim.entry])
                self.failures.failed(claim.group_id, task.exception())
                self._count(claim, "error")
            else:
                self._count(claim, task.result())

    # --- weight sync -------------------------------------------------------------------

    async def _follow_events(self, after: str, stop: asyncio.Event) -> None:
        """Weight syncs, pause / resume and stop, in the order they were published."""
        while not stop.is_set():
            events = await asyncio.to_thread(self.control.events, after, 1000)
            for event in events:
                after = event.id
                if event.type == WEIGHT_SYNC and event.model_step > self.model_step:
                    await self.sync_weights(event.model_step, event.uri or None, published=event.id)
                elif event.type == PAUSE and not self.paused:
                    await self.pause()
                elif event.type == RESUME and self.paused:
                    self.paused = False
                    self._wake.set()
                    log.info("run resumed: producer %s claims again", self.name)
                elif event.type == STOP:
                    self.run_stopped = True
                    log.info("run stopped (event %s): producer %s stops", event.id, self.name)
                    stop.set()

    async def pause(self) -> None:
        """Stop claiming. drain: what runs finishes; abort and partial: it is aborted now,
        back to the aborted pool (with its tokens, in partial mode), so the engines idle."""
        self.paused = True
        mode = self.plan.on_weight_sync
        if mode != "drain":
            await self.runner.abort_all()
        log.info("run paused: producer %s claims nothing (%d groups in flight, %s)",
                 self.name, len(self.inflight), mode)  # fmt: skip

    async def sync_weights(self, model_step: int, uri: str | None, published: str | None = None) -> None:
        """Stop claiming, move the engines to ``model_step`` the configured way, go on.
        ``published``: the id of the sync's event, whose time (Redis' clock) the sync's
        latency is measured from."""
        self._open.clear()
        try:
            started = time.monotonic()
            stuck = await self.pool.sync_weights(
                model_step, uri, self.plan.on_weight_sync, self.plan.sync_timeout_s
            )
            reload_s = time.monotonic() - started
            if stuck:
                # engines that never confirmed: cancel what this producer has on them, so
                # those groups come back aborted and are produced again on another engine
                await self.pool.abort(list(self.runner.inflight))
            await self.record_metrics()
            self.model_step = model_step
            self.stats.weight_syncs += 1
            since = None
            if published:  # a stream id: milliseconds of Redis' clock, then a sequence
                now = await asyncio.to_thread(self.control.server_time)
                since = now - int(published.partition("-")[0]) / 1000
            weight_synced(model_step, reload_s, since)
            # say so now, not at the next heartbeat: trainers wait on it (wait_for_producers)
            await asyncio.to_thread(
                self.control.publish_status, self.name, self.model_step, len(self.inflight)
            )
        finally:
            self._open.set()
            self._wake.set()  # the bound moved with the step: admit now, not at the next look

    async def record_metrics(self) -> None:
        """One record per model step in the run's metrics stream (capped)."""
        window, self.runner.window = self.runner.window, Window()
        ended = time.monotonic()
        busy = [h.busy_fraction for h in await self.pool.health() if h is not None]
        record = metrics_record(
            self.name, self.model_step, window, ended, self.stats, self.runner.retries, busy
        )
        await asyncio.to_thread(
            self.buffer.client.xadd, self.buffer.keys.metrics, record, maxlen=METRICS_CAP, approximate=True
        )

    # --- liveness ----------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        """Tell the run who is alive and on which step; keep held claims from being
        reclaimed while their groups take long (producer/heartbeat.py: the beats come from
        a thread of their own). Fails when a beat does; every few beats brings back an
        engine that Ray restarted at step 0 (a no-op for engines already on the step)."""
        every_s = self.plan.heartbeat_s

        def start(on_failure: Callable[[BaseException], None]) -> Heartbeat:
            self._beats = producer_heartbeat(
                self.name, self.control, self.buffer, self.liveness, every_s,
                lambda: (self.model_step, self.inflight, self.paused), on_failure,
            )  # fmt: skip
            return self._beats

        def check_engines() -> Awaitable[list[int]] | None:
            if not self._open.is_set():
                return None
            return self.pool.sync_weights(self.model_step, mode=self.plan.on_weight_sync)

        await keep_beating(start, every_s, check_engines)

    async def _report(self) -> None:
        """A progress line every process.progress_s."""
        await report_progress(
            self.name, self.stats, self.plan.progress_s,
            lambda: (len(self.inflight), self.model_step, self.paused),
        )  # fmt: skip

    async def _until_cold(self, tasks: Iterable[asyncio.Task[str]], timeout: float) -> set[asyncio.Task[str]]:
        """Wait up to ``timeout`` for ``tasks``, less if a cold stop comes; the ones not done."""
        waiting = set(tasks)
        if not self.cold.is_set() and waiting:
            everything = asyncio.ensure_future(asyncio.wait(waiting, timeout=timeout))
            cold = asyncio.ensure_future(self.cold.wait())
            await asyncio.wait({everything, cold}, return_when=asyncio.FIRST_COMPLETED)
            for future in (everything, cold):
                future.cancel()
            await asyncio.gather(everything, cold, return_exceptions=True)
        return {t for t in waiting if not t.done()}

    async def _shutdown(self, grace_s: float = 10.0) -> None:
        """Stop without leaving claims pending for claim_idle_ms: in drain and abort mode
        in-flight groups may finish for ``grace_s``; then what still generates is aborted
        (partial mode keeps its tokens) and settles into the aborted pool; whatever is
        left after that (a group waiting on its judge) is cancelled, which hands its
        claim back too. Nothing is lost either way: an unsettled claim stays pending and
        is reclaimed by another producer. The heartbeat thread beats until the end: while
        a warm stop waits for its groups, this producer stays alive and its claims held."""
        try:
            await self._drain(grace_s)
        finally:
            await stop_beating(self._beats)
        self.control.forget(self.name)  # the liveness key is its owner's to clear

    async def _drain(self, grace_s: float) -> None:
        if self.inflight and self.plan.on_weight_sync != "partial":
            await self._until_cold(self.inflight, grace_s)
        pending = [t for t in self.inflight if not t.done()]
        if pending:
            if self.cold.is_set():
                log.warning("producer %s: cold stop, handing back %d groups now", self.name, len(pending))
            await self.runner.abort_all()
            still = await self._until_cold(pending, min(grace_s, SETTLE_S))
            for task in still:
                task.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        for task, claim in list(self.inflight.items()):
            if not task.cancelled() and task.exception() is None:
                self._count(claim, task.result())
            elif not task.cancelled():
                self.failures.failed(claim.group_id, task.exception())
            self.inflight.pop(task)
        self.failures.flush()
