"""One group's life on the producer: generate (retrying elsewhere on failure or
timeout, continuing partial samples), judge, filter, settle the claim.

Generating is the agent's (producer/agents, ``producer.agent``): it makes each
sample's trajectory, one response or many turns, through the engine calls of one
attempt (``Rollout``). An attempt that fails on an engine is retried on another with
the samples as they were before it.

The outcome of a claim is one of: completed (group appended), filtered (counted,
dropped), aborted (back to the aborted pool, with partial samples when partial
rollout is on), failed (dead-lettered after max_attempts), fenced (the claim
was taken over by another producer meanwhile: nothing written).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from rollstream.producer.agents.base import Agent, AgentConfig, Request, Rollout
from rollstream.producer.agents.single import SingleTurnAgent
from rollstream.producer.engines.base import FINISH_LENGTH, Generation, SamplingParams
from rollstream.producer.judges.base import Judge, JudgeError, apply_rewards
from rollstream.producer.judges.rq import RQJudge
from rollstream.producer.pool import BasePool
from rollstream.producer.tokenizer import Tokenizer
from rollstream.shared.buffer import Claim, ReplayBuffer
from rollstream.shared.keys import EVALS, Keys, Role
from rollstream.shared.records import Group, Prompt, Sample, Status
from rollstream.shared.settings import ProducerSettings, Settings
from rollstream.shared.telemetry import group_completed, group_generated, judge_failed, judged

COMPLETED, FILTERED, ABORTED, FAILED, FENCED = "completed", "filtered", "aborted", "failed", "fenced"
DYNAMIC_TIMEOUT_AFTER = 8  # groups seen before the dynamic per-attempt timeout applies
SAMPLING_META = "sampling"  # a prompt's own temperature / top_p, over the producer's (prompt_sampling)
MAX_CAUSES = 256  # distinct judge-failure causes remembered (each logged once)
T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Window:
    groups: int = 0
    tokens: int = 0
    reward_sum: float = 0.0
    rewards: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, group: Group) -> None:
        self.groups += 1
        self.tokens += group.response_tokens
        scores = [s.score for s in group.samples if s.score is not None]
        self.reward_sum += sum(scores)
        self.rewards += len(scores)


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


class SerialThread:
    """Runs calls one at a time in a daemon thread of its own, off the event loop. A
    daemon, unlike an executor's thread: a call that never returns (a hung judge) cannot
    keep the process from exiting once its group has been handed back at a stop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        self._calls.put((loop, future, fn, args))
        return await future

    def _serve(self) -> None:
        while True:
            loop, future, fn, args = self._calls.get()
            if future.cancelled():  # its group was handed back meanwhile
                continue
            try:
                result, error = fn(*args), None
            except BaseException as exc:
                result, error = None, exc

            def settle(
                future: asyncio.Future[Any] = future, result: Any = result, error: Any = error
            ) -> None:
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            with contextlib.suppress(RuntimeError):  # the loop is gone
                loop.call_soon_threadsafe(settle)


class JudgeFailures:
    """What the producer says when the judge fails groups, which then go to the dead
    letters (each with its reason): one warning per cause, not a line per group, and not
    silence (every prompt of a dataset without ``meta.answer`` fails the same way). On
    the judge queue, no ``rollstream judge`` worker alive (the run's liveness keys) while
    jobs wait is said once, loudly, as soon as a job has waited a whole job timeout for
    a worker (or at the first failure), with the groups it holds; said again only after
    a judge worker was seen alive in between."""

    def __init__(self, client: redis.Redis, keys: Keys, producer: str, queue_key: str | None) -> None:
        self.client = client
        self.judges = keys.alive(Role.JUDGE, "*")
        self.producer = producer
        self.queue_key = queue_key  # the rq queue's key, when the judge runs on the queue
        self.waiting = 0  # groups waiting on the judge queue now (the event loop counts them)
        self.warned = False  # "no judge worker" was said, and no judge worker seen since
        self.judgeless = 0  # groups failed on the queue with no judge worker alive, since the warning
        self.causes: dict[str, int] = {}  # groups failed per cause
        self._lock = threading.Lock()  # the calls come from the loop's worker threads

    def queued_long(self, group_id: str, waited_s: float, dead_after_s: float) -> None:
        """A group's judge job still waits for a worker after a whole job timeout."""
        with self._lock:
            if self.warned or self._judge_alive() is not False:
                return
            self.warned = True
        log.warning(
            "producer %s: no `rollstream judge` worker is alive (no %s key) to run the jobs on the "
            "judge queue %s (producer.judge_on_queue is set): group %s has waited %.0f s for one, "
            "with %d other groups waiting on the queue; each is dead-lettered after %.0f s unless a "
            "judge worker runs: start `rollstream judge` (said once, not per group)",
            self.producer, self.judges, self.queue_key, group_id, waited_s, max(0, self.waiting - 1),
            dead_after_s,
        )  # fmt: skip

    def judged(self) -> None:
        """A job on the queue was judged after the warning: a judge worker runs again."""
        with self._lock:
            if not self.warned or not self._judge_alive():
                return
            self.warned, lost = False, self.judgeless
            self.judgeless = 0
        log.warning(
            "producer %s: a judge worker is alive again; %d groups were dead-lettered while none was",
            self.producer, lost,
        )  # fmt: skip

    def failed(self, group_id: str, exc: JudgeError) -> None:
        """One group failed for ``exc`` (called off the event loop: it may ask Redis)."""
        if self.queue_key is not None:
            alive = self._judge_alive()
            if alive is False:
                with self._lock:
                    self.judgeless += 1
                    said, self.warned = self.warned, True
                if not said:
                    log.warning(
                        "producer %s: no `rollstream judge` worker is alive (no %s key) to run the jobs "
                        "on the judge queue %s (producer.judge_on_queue is set): group %s is dead-lettered "
                        "(%s) and so will be the %d other groups waiting on the queue and every group "
                        "after them until a judge worker runs; start `rollstream judge` "
                        "(said once, not per group)",
                        self.producer, self.judges, self.queue_key, group_id, exc, self.waiting,
                    )  # fmt: skip
                return
            if alive and self.warned:
                self.judged()
        cause = str(exc).replace(group_id, "{group}")
        if exc.job_id:
            cause = cause.replace(exc.job_id, "{job}")
        seen = self.causes.get(cause)
        if seen is not None:
            self.causes[cause] = seen + 1
            return
        if len(self.causes) == MAX_CAUSES:
            log.warning("producer %s: the judge failed group %s: %s", self.producer, group_id, exc)
            return
        self.causes[cause] = 1
        log.warning(
            "producer %s: the judge failed group %s: %s; it is dead-lettered, and so is every group "
            "that fails this way (said once per cause: `rollstream show dead` lists them)",
            self.producer, group_id, exc,
        )  # fmt: skip

    def _judge_alive(self) -> bool | None:
        """Whether a judge worker keeps a liveness key; None when Redis does not say."""
        try:
            return next(iter(self.client.scan_iter(match=self.judges, count=1000)), None) is not None
        except redis.RedisError:
            return None


class GroupFailed(Exception):
    """Every attempt at a group failed; the message says why the last one did."""


class GroupRunner:
    def __init__(
        self,
        settings: Settings,
        buffer: ReplayBuffer,
        pool: BasePool,
        tokenizer: Tokenizer,
        judge: Judge,
        is_valid: Callable[[Group], bool],
        rq_judge: RQJudge | None = None,
        agent: Agent | None = None,
    ) -> None:
        self.settings = settings
        self.buffer = buffer
        self.pool = pool
        self.tokenizer = tokenizer
        self.judge = judge
        self.is_valid = is_valid
        self.rq_judge = rq_judge
        mode = settings.rollout.on_weight_sync
        self.agent = agent or SingleTurnAgent(AgentConfig.from_settings(settings.producer, mode))
        self.recent_s: deque[float] = deque(maxlen=64)
        self.inflight: set[str] = set()  # request ids, for aborts
        self.rollouts: set[Rollout] = set()  # the attempts generating now
        self.completions = Completions(buffer)
        # an in-process judge runs here, one group at a time as it did inline, never on the
        # event loop: a slow one would freeze the producer (its weight syncs, the proxy's
        # HTTP server, every other group)
        self._judging = SerialThread("judge")
        queue_key = rq_judge.queue.key if rq_judge is not None else None
        self.judge_failures = JudgeFailures(buffer.client, buffer.keys, buffer.consumer, queue_key)
        self.retries = 0
        self.window = Window()  # what completed groups brought since the last metrics record

    async def run(self, claim: Claim, start_step: int | None = None) -> str:
        """claim -> generate -> judge -> filter -> complete. ``start_step``: the model step
        the engines hold as it starts, the group's step when every response is empty."""
        started = time.monotonic()
        try:
            samples = await self.generate(claim)
            generated = time.monotonic()
            group_generated(claim.task, generated - started)
        except asyncio.CancelledError:
            self.buffer.abort(claim, [])  # the producer stops: the claim goes back now
            raise
        except GroupFailed as exc:
            await settle_off_loop(self.buffer.dead_letter, claim.entry, f"generation failed: {exc}")
            return FAILED
        # the settles below run off the event loop (a Redis riding out an outage holds this
        # group, not the producer); those of a stop, in the CancelledError paths, stay on it
        if any(s.status is Status.ABORTED for s in samples):
            keep = samples if self.settings.rollout.on_weight_sync == "partial" else []
            return ABORTED if await settle_off_loop(self.buffer.abort, claim, keep) is not None else FENCED
        group = Group.for_prompt(
            claim.prompt, samples=samples, attempt=claim.entry.deliveries, producer=self.buffer.consumer,
            start_step=start_step,
        )  # fmt: skip
        try:
            await self.score(group)
        except JudgeError as exc:
            judge_failed(claim.task)
            # the dead letter first: a stop that cancels the group while the failure is said
            # then leaves no claim pending
            await settle_off_loop(self.buffer.dead_letter, claim.entry, f"judge failed: {exc}")
            await asyncio.to_thread(self.judge_failures.failed, claim.group_id, exc)
            return FAILED
        except asyncio.CancelledError:
            # the producer stops: hand the claim back now (with the generated samples, in
            # partial mode) instead of leaving it pending until claim_idle_ms
            keep = samples if self.settings.rollout.on_weight_sync == "partial" else []
            self.buffer.abort(claim, keep)
            raise
        group.timings.update(generate_s=generated - started, judge_s=time.monotonic() - generated)
        judged(claim.task, group.timings["judge_s"])
        if claim.source != EVALS and not self.is_valid(group):  # eval results are all kept
            return FILTERED if await settle_off_loop(self.buffer.drop, claim, group) else FENCED
        self.recent_s.append(time.monotonic() - started)
        if await self.completions.complete(claim, group) is None:
            return FENCED
        self.window.add(group)
        group_completed(claim.task, group.response_tokens)
        return COMPLETED

    # --- generate ----------------------------------------------------------------------

    async def generate(self, claim: Claim) -> list[Sample]:
        """The group's n samples: fresh, or the partial ones continued, by the agent.
        Retries a failed or timed-out attempt on another engine, up to max_attempts."""
        n = self.settings.task(claim.task).n
        prompt_ids = self.tokenizer.encode(claim.prompt.prompt)
        max_tokens = self.settings.producer.max_tokens
        for s in claim.partial:  # interrupted with nothing left to generate: it is complete
            if s.status is Status.ABORTED and s.turns is None and len(s.response_ids) >= max_tokens:
                s.status, s.finish_reason = Status.COMPLETED, FINISH_LENGTH
        kept = [s for s in claim.partial if s.status is not Status.ABORTED]
        to_continue = [s for s in claim.partial if s.status is Status.ABORTED]
        if not claim.partial:
            to_continue = [_empty(prompt_ids) for _ in range(n)]
        if not to_continue:
            return kept
        sampling = prompt_sampling(claim.prompt, self.settings.producer)
        avoid: list[int] = []
        last_error = ""
        for attempt in range(1, self.settings.buffer.max_attempts + 1):
            request_id = f"{claim.group_id}#{claim.entry.id}#{attempt}"
            rollout = Rollout(
                claim.prompt,
                prompt_ids,
                self.tokenizer,
                self._attempt(avoid, sampling),
                request_id,
                self.settings.rollout.on_weight_sync,
            )
            self.rollouts.add(rollout)
            try:
                continued = await self.agent.run_group(rollout, to_continue)
                return kept + continued
            except _AttemptFailed as exc:
                last_error = str(exc)
                avoid.append(exc.engine)
                self.retries += 1
                # the attempt's other requests were cancelled here, but an engine in another
                # process goes on with them until it is told (a request it finished ignores it)
                if len(rollout.issued) > 1:
                    await self.pool.abort(rollout.issued)
            finally:
                self.rollouts.discard(rollout)
        raise GroupFailed(f"{self.settings.buffer.max_attempts} attempts, last: {last_error}")

    async def abort_all(self) -> None:
        """Stop what this runner generates (a pause, a stop): every attempt starts no new
        engine request, so that an agent's trajectory between two turns ends at its last
        complete one too, and the requests in flight are aborted."""
        for rollout in self.rollouts:
            rollout.aborting = True
        if self.inflight:
            await self.pool.abort(list(self.inflight))

    def _attempt(self, avoid: list[int], sampling: tuple[float, float]) -> Request:
        """The engine calls of one attempt. Its later requests (an agent's next turns) go
        to the engine that served its first: that engine's prefix cache holds their
        history, as it holds the prompt of a group's n samples."""
        pinned: list[int] = []

        async def request(
            ids: list[int], n: int, max_tokens: int, request_id: str, stop: Sequence[str]
        ) -> list[Generation]:
            engine = pinned[0] if pinned else self.pool.pick(avoid)
            generations = await self._request(ids, n, max_tokens, request_id, avoid, stop, sampling, engine)
            pinned[:] = pinned or [engine]
            return generations

        return request

    async def _request(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        request_id: str,
        avoid: list[int],
        stop: Sequence[str] = (),
        sampling: tuple[float, float] | None = None,
        engine: int | None = None,
    ) -> list[Generation]:
        p = self.settings.producer
        temperature, top_p = sampling or (p.temperature, p.top_p)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=list(stop))
        self.inflight.add(request_id)
        try:
            # placed here, not in the pool, so that a timeout is blamed on the engine that ran it
            engine = self.pool.pick(avoid) if engine is None else engine
            call = self.pool.generate(prompt_ids, params, n, request_id, engine=engine)
            timeout = self.timeout_s()
            try:
                async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancellation
                    result = await call
            except TimeoutError:
                await self.pool.abort([request_id])
                raise _AttemptFailed(engine, f"engine {engine}: timed out after {timeout:.1f} s") from None
        finally:
            self.inflight.discard(request_id)
        if result.failed:
            raise _AttemptFailed(result.engine, result.error)
        return result.generations

    def timeout_s(self) -> float | None:
        """Per-attempt timeout: fixed, or ratio x the mean time of recent groups."""
        fixed = self.settings.producer.group_timeout_s
        if fixed > 0:
            return fixed
        if len(self.recent_s) < DYNAMIC_TIMEOUT_AFTER:
            return None
        p = self.settings.producer
        # never below the floor: groups of a few ms made it a few ms, and the first outage
        # or busy moment then failed every group in flight ("timed out after 0.0 s")
        return max(p.min_timeout_s, p.timeout_ratio * statistics.fmean(self.recent_s))

    # --- judge -------------------------------------------------------------------------

    async def score(self, group: Group) -> None:
        if self.rq_judge is None:
            rewards = await self._judging.call(self.judge, group.prompt, group.samples)
        else:
            job = await asyncio.to_thread(self.rq_judge.submit, group.prompt, group.samples)
            # rq retries a failed or killed job itself: wait for every try
            tries = self.settings.buffer.max_attempts
            wait_s = tries * (self.settings.producer.judge_timeout_s + 5)
            # a cancelled group (a stop) ends the thread's wait too: the interpreter waits
            # for that thread at exit, for as long as wait_s when the judge is gone
            given_up = threading.Event()
            failures = self.judge_failures
            failures.waiting += 1
            try:
                rewards = await asyncio.to_thread(
                    self.rq_judge.result, job, wait_s, given_up,
                    lambda waited: failures.queued_long(group.group_id, waited, wait_s),
                )  # fmt: skip
            except asyncio.CancelledError:
                given_up.set()
                self.rq_judge.cancel([job])
                raise
            finally:
                failures.waiting -= 1
            if failures.warned:
                await asyncio.to_thread(failures.judged)
        apply_rewards(group.samples, rewards)


def prompt_sampling(prompt: Prompt, producer: ProducerSettings) -> tuple[float, float]:
    """(temperature, top_p) for the prompt: producer.temperature and .top_p, or what its
    ``meta["sampling"]`` sets (an eval prompt decoded greedily has
    ``{"sampling": {"temperature": 0}}``). A bad one fails the group, naming it."""
    own = prompt.meta.get(SAMPLING_META)
    if own is None:
        return producer.temperature, producer.top_p
    where = f"prompt {prompt.group_id}: meta[{SAMPLING_META!r}]"
    if not isinstance(own, dict) or set(own) - {"temperature", "top_p"}:
        raise GroupFailed(f"{where} must be an object of temperature and top_p, got {own!r}")
    temperature, top_p = own.get("temperature", producer.temperature), own.get("top_p", producer.top_p)
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (temperature, top_p))
    if not numbers or not (temperature >= 0 and 0 < top_p <= 1):
        raise GroupFailed(f"{where} needs temperature >= 0 and 0 < top_p <= 1, got {own!r}")
    return float(temperature), float(top_p)


class _AttemptFailed(Exception):
    def __init__(self, engine: int, reason: str) -> None:
        super().__init__(reason)
        self.engine = engine


def _empty(prompt_ids: list[int]) -> Sample:
    return Sample(prompt_ids, [], [], [], status=Status.ABORTED)
