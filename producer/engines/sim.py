"""The simulated engine: the timing of a continuous-batching GPU server, without one.

What makes RL rollout hard on GPUs is the long tail: one sequence cannot use
the whole engine. The model here: an aggregate decode capacity of T tokens/s,
a per-sequence speed cap v; each decoding request advances at min(v, T / k)
with k requests decoding, so a few long stragglers leave the engine mostly
idle (busy = min(k v, T) / T). Prefill takes prompt tokens / prefill_tps and
holds a KV-cache slot; beyond max_concurrency slots requests queue. Response
lengths come from a seeded lognormal (median, sigma), capped by max_tokens.

Time is simulated exactly between events (a prefill ending, a request
finishing, an arrival, an abort, a pause, a weight update) and runs
``time_compression`` times faster than the wall clock, or on a clock the caller
passes (tests move one by hand, tests/helpers.py ManualClock). Token ids and
logprobs are deterministic for (seed, prompt, sample index); each token is
stamped with the model step the engine held when that token was produced.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineError,
    EngineHealth,
    Generation,
    SamplingParams,
)
from rollstream.shared.engine_settings import EngineSettings, SimEngineSettings

_EPS = 1e-9
_SUM = re.compile(r"What is (-?\d+) \+ (-?\d+)\?")


def _answer(prompt_ids: list[int], rng: np.random.Generator, accuracy: float) -> str:
    """Rewards need answers: to a prompt "What is a + b?" (as bytes, the producer's
    tokenizer for the sim engine) the response says a + b, right with probability
    ``accuracy``. Other prompts get no text."""
    right = rng.random() < accuracy
    # the prompt's bytes, without the tokens of a partial response continued after them
    head = bytes(itertools.takewhile(lambda t: 0 <= int(t) < 256, prompt_ids))
    match = _SUM.search(head.decode("utf-8", "replace"))
    if match is None:
        return ""
    value = int(match[1]) + int(match[2]) + (0 if right else 1 + int(rng.integers(0, 9)))
    return f"Adding the two numbers gives \\boxed{{{value}}}."


@dataclass(slots=True, eq=False)
class _Request:
    group: str
    target: int  # tokens it will produce unless aborted
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    prefill_left: float  # simulated seconds of prefill still to run
    fails: bool
    future: asyncio.Future[Generation]
    text: str = ""  # what the finished response says
    produced: float = 0.0
    runs: list[tuple[int, int]] = field(default_factory=list)  # (first token index, model step)

    def result(self, finish_reason: str) -> Generation:
        count = min(self.target, int(self.produced + _EPS))
        versions = np.empty(count, dtype=np.int32)
        for i, (start, step) in enumerate(self.runs):
            end = self.runs[i + 1][0] if i + 1 < len(self.runs) else count
            versions[min(start, count) : min(end, count)] = step
        text = "" if finish_reason == FINISH_ABORT else self.text
        return Generation(self.token_ids[:count], self.logprobs[:count], versions, finish_reason, text)


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Simulated seconds, and a timer on them."""

    def now(self) -> float: ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer: ...


class WallClock:
    """The default: simulated time runs ``compression`` times faster than the wall clock,
    from its creation on; timers are the running event loop's."""

    def __init__(self, compression: float) -> None:
        self.compression = compression
        self._t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self.compression

    def call_later(self, delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay / self.compression, callback)


class SimEngine:
    def __init__(
        self, settings: SimEngineSettings, model_step: int = 0, *, clock: Clock | None = None
    ) -> None:
        self.settings = settings
        self.model_step = model_step
        self.paused = False
        self.clock: Clock = clock or WallClock(settings.time_compression)
        self._queued: list[_Request] = []
        self._running: list[_Request] = []
        self._groups: dict[str, list[_Request]] = {}
        self._last = self.clock.now()  # simulated time of the last advance
        self._start = self._last
        self._used = 0.0  # decode tokens produced since the last health() (busy numerator)
        self._used_total = 0.0
        self._window_start = self._last
        self._timer: Timer | None = None
        self._failures = np.random.default_rng([settings.seed, 0xFA11])

    # --- the protocol ----------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> list[Generation]:
        group = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        prefill = len(prompt_ids) / self.settings.prefill_tps
        requests = [self._request(group, prompt_ids, params, i, prefill, loop) for i in range(n)]
        self._advance()
        self._groups[group] = requests
        self._queued.extend(requests)
        self._tick()
        try:
            return list(await asyncio.gather(*(r.future for r in requests)))
        except asyncio.CancelledError:
            for request in requests:  # a cancelled caller's requests must not go on decoding
                self._drop(request)
            self._tick()
            raise
        finally:
            self._groups.pop(group, None)

    async def abort(self, request_ids: list[str] | None = None) -> int:
        self._advance()
        groups = list(self._groups) if request_ids is None else [g for g in request_ids if g in self._groups]
        for group in groups:
            for request in self._groups[group]:
                self._finish(request, FINISH_ABORT)
        self._tick()
        return len(groups)

    async def pause(self) -> None:
        self._advance()
        self.paused = True

    async def resume(self) -> None:
        self._advance()
        self.paused = False
        self._tick()

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        self._advance()
        self.model_step = model_step
        for request in self._running + self._queued:
            request.runs.append((int(request.produced + _EPS), model_step))

    async def health(self) -> EngineHealth:
        self._advance()
        window = self._last - self._window_start
        busy = self._used / (self.settings.capacity_tps * window) if window > 0 else self._busy_now()
        self._used, self._window_start = 0.0, self._last
        capacity = self.settings.capacity_tps * (self._last - self._start)
        return EngineHealth(
            healthy=True,
            model_step=self.model_step,
            paused=self.paused,
            outstanding=len(self._running) + len(self._queued),
            running=len(self._running),
            queued=len(self._queued),
            busy_fraction=min(1.0, busy),
            busy_total=min(1.0, self._used_total / capacity) if capacity > 0 else 0.0,
        )

    # --- the model -------------------------------------------------------------------

    def _request(
        self,
        group: str,
        prompt_ids: list[int],
        params: SamplingParams,
        index: int,
        prefill: float,
        loop: asyncio.AbstractEventLoop,
    ) -> _Request:
        s = self.settings
        prompt_key = zlib.crc32(np.asarray(prompt_ids, dtype=np.int32).tobytes())
        rng = np.random.default_rng([s.seed, prompt_key, index, params.seed or 0])
        natural = max(1, round(rng.lognormal(math.log(s.median_tokens), s.sigma)))
        target = params.max_tokens if params.ignore_eos else min(natural, params.max_tokens)
        finish = FINISH_STOP if not params.ignore_eos and natural < params.max_tokens else FINISH_LENGTH
        return _Request(
            group=group,
            target=target,
            token_ids=rng.integers(0, s.vocab_size, target, dtype=np.int32),
            logprobs=(-rng.exponential(0.7, target)).astype(np.float32),
            finish_reason=finish,
            prefill_left=prefill,
            fails=bool(self._failures.random() < s.failure_rate),
            future=loop.create_future(),
            text=_answer(prompt_ids, rng, s.accuracy),
            runs=[(0, self.model_step)],
        )

    def _decoding(self) -> list[_Request]:
        return [r for r in self._running if r.prefill_left <= 0]

    def _rate(self, decoding: int) -> float:
        return min(self.settings.speed_tps, self.settings.capacity_tps / decoding) if decoding else 0.0

    def _busy_now(self) -> float:
        k = 0 if self.paused else len(self._decoding())
        return min(k * self.settings.speed_tps, self.settings.capacity_tps) / self.settings.capacity_tps

    def _advance(self) -> None:
        """Move simulated time to now; between two calls the rates were constant."""
        now = self.clock.now()
        dt, self._last = now - self._last, now
        if self.paused or dt < 0:
            return
        # Requests whose prefill ends inside dt start decoding at the next advance: the
        # timer fires at every prefill end, so what that drops is the timer's latency.
        decoding = self._decoding()
        rate = self._rate(len(decoding))
        for request in decoding:
            request.produced = min(float(request.target), request.produced + rate * dt)
        self._used += rate * len(decoding) * dt
        self._used_total += rate * len(decoding) * dt
        for request in self._running:
            if request.prefill_left > 0:
                # a remainder below _EPS is float rounding, not prefill: a clock that steps
                # exactly to the prefill's end would otherwise never get past it
                left = request.prefill_left - dt
                request.prefill_left = left if left > _EPS else 0.0
        for request in list(self._running):
            if request.fails and request.prefill_left <= 0:
                self._fail(request)
            elif request.produced >= request.target - _EPS:
                self._finish(request, request.finish_reason)
        while self._queued and len(self._running) < self.settings.max_concurrency:
            self._running.append(self._queued.pop(0))

    def _next_event(self) -> float | None:
        """Simulated seconds until the next prefill end or finish, None when idle."""
        if self.paused or not self._running:
            return None
        decoding = self._decoding()
        rate = self._rate(len(decoding))
        waits = [r.prefill_left for r in self._running if r.prefill_left > 0]
        waits += [(r.target - r.produced) / rate for r in decoding]
        return max(0.0, min(waits)) if waits else None

    def _finish(self, request: _Request, reason: str) -> None:
        if not request.future.done():
            request.future.set_result(request.result(reason))
        self._drop(request)

    def _fail(self, request: _Request) -> None:
        if not request.future.done():
            request.future.set_exception(EngineError("simulated engine failure (failure_rate)"))
        self._drop(request)

    def _drop(self, request: _Request) -> None:
        if request in self._running:
            self._running.remove(request)
        elif request in self._queued:
            self._queued.remove(request)

    # --- the clock -------------------------------------------------------------------

    def _schedule(self) -> None:
        """Set the timer to the next event: the model is exact only if time is advanced
        at every event."""
        if self._timer is not None:
            self._timer.cancel()
        delay = self._next_event()
        self._timer = None if delay is None else self.clock.call_later(delay, self._tick)

    def _tick(self) -> None:
        """Advance to now (queued requests take the slots that are free), then set the
        timer to the next event."""
        self._advance()
        self._schedule()


def from_settings(settings: EngineSettings) -> SimEngine:
    """The engine of ``engines.kind = "sim"``."""
    return SimEngine(settings.sim)
