"""One group's life on the producer: generate (retrying elsewhere on failure or
timeout, continuing partial samples), judge, filter, settle the claim.

The outcome of a claim is one of: completed (group appended), filtered (counted,
dropped), aborted (back to the aborted pool, with partial samples when partial
rollout is on), failed (dead-lettered after max_attempts), fenced (the claim
was taken over by another producer meanwhile: nothing written).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import redis

from producer.engines.base import FINISH_ABORT, FINISH_LENGTH, Generation, SamplingParams
from producer.judges.base import Judge, JudgeError, apply_rewards
from producer.judges.rq import RQJudge
from producer.pool import BasePool
from producer.tokenizer import Tokenizer
from shared.buffer import Claim, ReplayBuffer
from shared.keys import EVALS
from shared.records import Group, Sample, Status
from shared.settings import Settings

COMPLETED, FILTERED, ABORTED, FAILED, FENCED = "completed", "filtered", "aborted", "failed", "fenced"
DYNAMIC_TIMEOUT_AFTER = 8  # groups seen before the dynamic per-attempt timeout applies


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


class Completions:
    """Completed groups written together: the groups that finish in one turn of the
    event loop share one fenced settle per pool (ReplayBuffer.complete_many) instead
    of a round trip each. Each caller still gets its own group's entry id, or None
    when its claim was reclaimed by another producer."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer
        self._pending: list[tuple[Claim, Group, asyncio.Future[str | None]]] = []
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
        by_stream: dict[str, list[tuple[Claim, Group, asyncio.Future[str | None]]]] = {}
        for item in pending:
            by_stream.setdefault(item[0].entry.stream, []).append(item)
        for items in by_stream.values():  # one settle each: all of it lands or none
            try:
                self._resolve(items, self.buffer.complete_many([(c, g) for c, g, _ in items]))
                continue
            except Exception as exc:
                # Redis itself failing fails them all; anything else, try one by one
                if len(items) == 1 or isinstance(exc, redis.ConnectionError | redis.TimeoutError):
                    self._resolve(items, exc)
                    continue
            for item in items:  # one by one, so that one group's error is that group's alone
                try:
                    self._resolve([item], self.buffer.complete_many([item[:2]]))
                except Exception as exc:
                    self._resolve([item], exc)

    @staticmethod
    def _resolve(
        items: list[tuple[Claim, Group, asyncio.Future[str | None]]], outcome: list[str | None] | Exception
    ) -> None:
        for i, (_, _, future) in enumerate(items):
            if future.done():  # a cancelled waiter: its group was written all the same
                continue
            if isinstance(outcome, Exception):
                future.set_exception(outcome)  # its claim stays pending: reclaimed later
            else:
                future.set_result(outcome[i])


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
    ) -> None:
        self.settings = settings
        self.buffer = buffer
        self.pool = pool
        self.tokenizer = tokenizer
        self.judge = judge
        self.is_valid = is_valid
        self.rq_judge = rq_judge
        self.recent_s: deque[float] = deque(maxlen=64)
        self.inflight: set[str] = set()  # request ids, for aborts
        self.completions = Completions(buffer)
        self.retries = 0
        self.window = Window()  # what completed groups brought since the last metrics record

    async def run(self, claim: Claim) -> str:
        """claim -> generate -> judge -> filter -> complete."""
        started = time.monotonic()
        try:
            samples = await self.generate(claim)
            generated = time.monotonic()
        except asyncio.CancelledError:
            self.buffer.abort(claim, [])  # the producer stops: the claim goes back now
            raise
        except GroupFailed as exc:
            self.buffer.dead_letter(claim.entry, f"generation failed: {exc}")
            return FAILED
        if any(s.status is Status.ABORTED for s in samples):
            keep = samples if self.settings.rollout.on_weight_sync == "partial" else []
            return ABORTED if self.buffer.abort(claim, keep) is not None else FENCED
        group = Group.for_prompt(
            claim.prompt, samples=samples, attempt=claim.entry.deliveries, producer=self.buffer.consumer
        )
        try:
            await self.score(group)
        except JudgeError as exc:
            self.buffer.dead_letter(claim.entry, f"judge failed: {exc}")
            return FAILED
        except asyncio.CancelledError:
            # the producer stops: hand the claim back now (with the generated samples, in
            # partial mode) instead of leaving it pending until claim_idle_ms
            keep = samples if self.settings.rollout.on_weight_sync == "partial" else []
            self.buffer.abort(claim, keep)
            raise
        group.timings.update(generate_s=generated - started, judge_s=time.monotonic() - generated)
        if claim.source != EVALS and not self.is_valid(group):  # eval results are all kept
            return FILTERED if self.buffer.drop(claim) else FENCED
        self.recent_s.append(time.monotonic() - started)
        if await self.completions.complete(claim, group) is None:
            return FENCED
        self.window.add(group)
        return COMPLETED

    # --- generate ----------------------------------------------------------------------

    async def generate(self, claim: Claim) -> list[Sample]:
        """The group's n samples: fresh, or the partial ones continued. Retries a failed
        or timed-out attempt on another engine, up to max_attempts."""
        n = self.settings.task(claim.task).n
        prompt_ids = self.tokenizer.encode(claim.prompt.prompt)
        max_tokens = self.settings.producer.max_tokens
        for s in claim.partial:  # interrupted with nothing left to generate: it is complete
            if s.status is Status.ABORTED and len(s.response_ids) >= max_tokens:
                s.status, s.finish_reason = Status.COMPLETED, FINISH_LENGTH
        kept = [s for s in claim.partial if s.status is not Status.ABORTED]
        to_continue = [s for s in claim.partial if s.status is Status.ABORTED]
        if not claim.partial:
            to_continue = [_empty(prompt_ids) for _ in range(n)]
        if not to_continue:
            return kept
        avoid: list[int] = []
        last_error = ""
        for attempt in range(1, self.settings.buffer.max_attempts + 1):
            request_id = f"{claim.group_id}#{claim.entry.id}#{attempt}"
            try:
                continued = await self._continue(prompt_ids, to_continue, request_id, avoid)
                return kept + continued
            except _AttemptFailed as exc:
                last_error = str(exc)
                avoid.append(exc.engine)
                self.retries += 1
        raise GroupFailed(f"{self.settings.buffer.max_attempts} attempts, last: {last_error}")

    async def _continue(
        self, prompt_ids: list[int], samples: list[Sample], request_id: str, avoid: list[int]
    ) -> list[Sample]:
        max_tokens = self.settings.producer.max_tokens
        if all(len(s.response_ids) == 0 for s in samples):
            # fresh samples: one request of n, so that one engine's prefix cache serves all
            gens = await self._request(prompt_ids, len(samples), max_tokens, request_id, avoid)
            return [_sample(prompt_ids, g) for g in gens]
        # partial samples: each goes on from its own tokens with what is left of max_tokens
        parts = [
            self._request(
                prompt_ids + s.response_ids.tolist(),
                1,
                max_tokens - len(s.response_ids),
                f"{request_id}.{i}",
                avoid,
            )
            for i, s in enumerate(samples)
        ]
        results = await asyncio.gather(*parts, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [_merge(prompt_ids, s, r[0]) for s, r in zip(samples, results, strict=True)]  # type: ignore[index]

    async def _request(
        self, prompt_ids: list[int], n: int, max_tokens: int, request_id: str, avoid: list[int]
    ) -> list[Generation]:
        p = self.settings.producer
        params = SamplingParams(max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p)
        self.inflight.add(request_id)
        try:
            # placed here, not in the pool, so that a timeout is blamed on the engine that ran it
            engine = self.pool.pick(avoid)
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
        return self.settings.producer.timeout_ratio * statistics.fmean(self.recent_s)

    # --- judge -------------------------------------------------------------------------

    async def score(self, group: Group) -> None:
        if self.rq_judge is None:
            rewards = self.judge(group.prompt, group.samples)
        else:
            job = self.rq_judge.submit(group.prompt, group.samples)
            # rq retries a failed or killed job itself: wait for every try
            tries = self.settings.buffer.max_attempts
            wait_s = tries * (self.settings.producer.judge_timeout_s + 5)
            try:
                rewards = await asyncio.to_thread(self.rq_judge.result, job, wait_s)
            except asyncio.CancelledError:
                self.rq_judge.cancel([job])
                raise
        apply_rewards(group.samples, rewards)


class _AttemptFailed(Exception):
    def __init__(self, engine: int, reason: str) -> None:
        super().__init__(reason)
        self.engine = engine


def _empty(prompt_ids: list[int]) -> Sample:
    return Sample(prompt_ids, [], [], [], status=Status.ABORTED)


def _sample(prompt_ids: list[int], gen: Generation) -> Sample:
    aborted = gen.finish_reason == FINISH_ABORT
    return Sample(
        prompt_ids=prompt_ids,
        response_ids=gen.response_ids,
        logprobs=gen.logprobs,
        response_versions=gen.versions,
        finish_reason=gen.finish_reason,
        status=Status.ABORTED if aborted else Status.COMPLETED,
        text=gen.text,
    )


def _merge(prompt_ids: list[int], before: Sample, gen: Generation) -> Sample:
    """A partial sample continued: its tokens, then the new ones (with their versions)."""
    merged = _sample(prompt_ids, gen)
    merged.response_ids = np.concatenate([before.response_ids, merged.response_ids])
    merged.logprobs = np.concatenate([before.logprobs, merged.logprobs])
    merged.response_versions = np.concatenate([before.response_versions, merged.response_versions])
    merged.text = before.text + merged.text
    return merged
