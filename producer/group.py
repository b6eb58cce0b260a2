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
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from rollstream.producer.agents.base import Agent, AgentConfig, Request, Rollout
from rollstream.producer.agents.single import SingleTurnAgent
from rollstream.producer.completions import Completions, settle_off_loop
from rollstream.producer.engines.base import FINISH_LENGTH, Generation, SamplingParams
from rollstream.producer.fleet.pool import BasePool
from rollstream.producer.judges.base import Judge, JudgeError, apply_rewards
from rollstream.producer.judges.rq import RQJudge
from rollstream.producer.judging import JudgeFailures, SerialThread
from rollstream.producer.tokenizer import Tokenizer
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import Claim
from rollstream.shared.errors import SettingsError
from rollstream.shared.keys import EVALS
from rollstream.shared.records import Group, Prompt, Sample, Status
from rollstream.shared.settings import ProducerSettings, TaskSettings
from rollstream.shared.telemetry import group_completed, group_generated, judge_failed, judged

__all__ = [
    "ABORTED",
    "COMPLETED",
    "DYNAMIC_TIMEOUT_AFTER",
    "FAILED",
    "FENCED",
    "FILTERED",
    "SAMPLING_META",
    "GroupFailed",
    "GroupRunner",
    "Window",
    "prompt_sampling",
]

COMPLETED, FILTERED, ABORTED, FAILED, FENCED = "completed", "filtered", "aborted", "failed", "fenced"
DYNAMIC_TIMEOUT_AFTER = 8  # groups seen before the dynamic per-attempt timeout applies
ENGINES_DOWN_SAY_S = 30.0  # while no engine is reachable, a warning this often
log = logging.getLogger(__name__)
SAMPLING_META = "sampling"  # a prompt's own temperature / top_p, over the producer's (prompt_sampling)


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


class GroupFailed(Exception):
    """Every attempt at a group failed; the message says why the last one did."""


class GroupRunner:
    """One group's life, from its claim to its settle. Built from the sections it uses:
    ``producer`` (sampling, timeouts, the judge's), ``tasks`` (each task's group size n),
    ``on_weight_sync`` (rollout.on_weight_sync: whether an aborted group keeps its partial
    samples) and ``max_attempts`` (buffer.max_attempts: attempts at a group, and tries of
    a judge job on the queue)."""

    def __init__(
        self,
        producer: ProducerSettings,
        tasks: Iterable[TaskSettings],
        buffer: ReplayBuffer,
        pool: BasePool,
        tokenizer: Tokenizer,
        judge: Judge,
        is_valid: Callable[[Group], bool],
        rq_judge: RQJudge | None = None,
        agent: Agent | None = None,
        *,
        on_weight_sync: str,
        max_attempts: int,
    ) -> None:
        self.producer = producer
        self.group_sizes = {t.name: t.n for t in tasks}
        self.on_weight_sync = on_weight_sync
        self.max_attempts = max_attempts
        self.buffer = buffer
        self.pool = pool
        self.tokenizer = tokenizer
        self.judge = judge
        self.is_valid = is_valid
        self.rq_judge = rq_judge
        self.agent = agent or SingleTurnAgent(AgentConfig.from_settings(producer, on_weight_sync))
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
        self._down_said = -ENGINES_DOWN_SAY_S  # when "no engine is reachable" was said last
        self._sleep = asyncio.sleep  # the wait for an engine (a test's clock replaces it)
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
            keep = samples if self.on_weight_sync == "partial" else []
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
            keep = samples if self.on_weight_sync == "partial" else []
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
        Retries a failed or timed-out attempt on another engine, up to max_attempts. An
        attempt that failed because no engine is reachable at all (every one cooling down
        after its node went away) is not counted: the group waits for an engine, instead
        of being dead-lettered in milliseconds for what is not its fault."""
        n = self.group_size(claim.task)
        prompt_ids = self.tokenizer.encode(claim.prompt.prompt)
        max_tokens = self.producer.max_tokens
        for s in claim.partial:  # interrupted with nothing left to generate: it is complete
            if s.status is Status.ABORTED and s.turns is None and len(s.response_ids) >= max_tokens:
                s.status, s.finish_reason = Status.COMPLETED, FINISH_LENGTH
        kept = [s for s in claim.partial if s.status is not Status.ABORTED]
        to_continue = [s for s in claim.partial if s.status is Status.ABORTED]
        # an entry handed back with fewer than n samples (docs/stream-format.md §11.9.3 asks
        # for all n; a writer that left out samples not started yet) is made up to n
        to_continue += [_empty(prompt_ids) for _ in range(n - len(claim.partial))]
        if not to_continue:
            return kept
        sampling = prompt_sampling(claim.prompt, self.producer)
        avoid: list[int] = []
        last_error = ""
        attempt, tries = 0, 0
        while attempt < self.max_attempts:
            attempt, tries = attempt + 1, tries + 1
            request_id = f"{claim.group_id}#{claim.entry.id}#{tries}"
            rollout = Rollout(
                claim.prompt,
                prompt_ids,
                self.tokenizer,
                self._attempt(avoid, sampling),
                request_id,
                self.on_weight_sync,
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
                down_s = self.pool.all_down()
                if down_s is not None:  # no engine reachable: wait for one, charging no attempt
                    attempt -= 1
                    avoid.clear()
                    self._engines_down(down_s, last_error)
                    await self._sleep(down_s)
            finally:
                self.rollouts.discard(rollout)
        raise GroupFailed(f"{self.max_attempts} attempts, last: {last_error}")

    def _engines_down(self, wait_s: float, error: str) -> None:
        """Say, at most every ENGINES_DOWN_SAY_S, that groups wait for an engine."""
        now = time.monotonic()
        if now - self._down_said >= ENGINES_DOWN_SAY_S:
            self._down_said = now
            log.warning("no engine is reachable (last: %s): groups wait for one (next try in %.1f s), "
                        "spending none of their buffer.max_attempts", error, wait_s)  # fmt: skip

    def group_size(self, task: str) -> int:
        """Task ``task``'s n, responses per prompt."""
        try:
            return self.group_sizes[task]
        except KeyError:
            known = ", ".join(self.group_sizes)
            raise SettingsError(f"unknown task {task!r}; the settings define: {known}") from None

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
        p = self.producer
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
        fixed = self.producer.group_timeout_s
        if fixed > 0:
            return fixed
        if len(self.recent_s) < DYNAMIC_TIMEOUT_AFTER:
            return None
        p = self.producer
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
            tries = self.max_attempts
            wait_s = tries * (self.producer.judge_timeout_s + 5)
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
