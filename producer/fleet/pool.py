"""The engine pool: where a producer sends each group's requests. ``EnginePool``: engines
in the run's named, detached Ray actors (producer/fleet/actors.py), that any producer process
attaches to by name; ``LocalPool``: engines in this process.

``rollstream engines`` starts them (on a running Ray cluster) and exits; a
producer on any machine attaches with ``EnginePool.attach``; a one-process
run (tests, the demo) starts a local Ray and the actors itself. All n samples
of a group go to one engine, so its prefix cache serves them; the engine is
the one with the fewest requests outstanding from this pool. A dead actor is
restarted by Ray (``max_restarts``); what it held comes back as a failed
result with the reason, for the producer to retry elsewhere.

Calls carry orjson bytes (producer/engines/base.py ``dumps``), not pickled
objects of ours.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from rollstream.producer.engines import make_engine
from rollstream.producer.engines.base import Engine, EngineHealth, Generation, SamplingParams, dumps, loads
from rollstream.producer.fleet.actors import (
    PoolError,
    actor_name,
    create_engine,
    engine_indices,
    first_line,
    namespace,
    remove_engine,
    wait_for_engines,
)
from rollstream.producer.fleet.host import EngineHost, StaleWeights
from rollstream.shared.engine_settings import EngineSettings
from rollstream.shared.waiting import NotYet, wait_until

# the actors' names, re-exported: callers import them from here
__all__ = ["BasePool", "EnginePool", "LocalPool", "PoolResult"]

ANSWER_TIMEOUT_S = 5.0  # an engine that takes longer to report its health is not answering
COOLDOWN_S = 2.0  # an engine whose call failed gets no new work this long (doubling in a row)
COOLDOWN_MAX_S = 30.0
SYNC_PROBE_S = 3.0  # a weight sync not confirmed by then asks whether the engine answers at all
PROBE_ANSWER_S = 3.0  # ... and gives it up when it does not answer that in this time
CONTROL_TIMEOUT_S = 30.0  # pause, resume, abort: an engine that does not confirm by then failed
log = logging.getLogger(__name__)


@dataclass(slots=True)
class PoolResult:
    """What one engine made of one group: its generations, or why it failed."""

    engine: int
    generations: list[Generation] = field(default_factory=list)
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error)


class BasePool:
    """What every pool does: placement, failed results instead of exceptions, broadcast
    control with the engines that did not confirm. Subclasses say how to call engine i."""

    def __init__(self, size: int) -> None:
        self.outstanding = [0] * size
        # engines that left the run (scaled in): no new work; their calls in flight finish
        self.retired: set[int] = set()
        # engines whose last call failed (dead, restarting, on a node that went away): no
        # new work until the time here (monotonic) unless no other engine is left; the
        # wait doubles with each failure in a row, up to COOLDOWN_MAX_S
        self.cooling: dict[int, tuple[float, float]] = {}  # index -> (until, wait)
        self._left: set[asyncio.Future[int]] = set()  # weight syncs given up on, still running
        # the weights every engine must hold before it serves: (model step, path, mode) of
        # the last sync_weights; an engine behind it (restarted by Ray) is synced first
        self.target: tuple[int, str | None, str] = (0, None, "abort")

    def pick(self, avoid: Iterable[int] = ()) -> int:
        """The engine with the fewest requests outstanding from this pool, not in ``avoid``
        unless every engine is."""
        avoided = set(avoid)
        everyone = self.serving()
        now = time.monotonic()
        avoided_too = avoided | {i for i, (until, _) in self.cooling.items() if until > now}
        candidates = (
            [i for i in everyone if i not in avoided_too]
            or [i for i in everyone if i not in avoided]
            or everyone
        )
        return min(candidates, key=lambda i: (self.outstanding[i], i))

    def _failed_on(self, index: int) -> None:
        _, wait = self.cooling.get(index, (0.0, COOLDOWN_S / 2))
        wait = min(COOLDOWN_MAX_S, wait * 2)
        self.cooling[index] = (time.monotonic() + wait, wait)

    def all_down(self) -> float | None:
        """When the last call to every serving engine found it unreachable (its node gone,
        restarting; none has served since), the seconds until the first one's cool-down ends
        (0 when one has ended), else None: a group that failed then was not at fault, and
        waits instead of spending attempts."""
        ends = [self.cooling[i][0] for i in self.serving() if i in self.cooling]
        if not ends or len(ends) < len(self.serving()):
            return None
        return max(0.0, min(ends) - time.monotonic())

    def serving(self) -> list[int]:
        """The engines that take work: all but those retired."""
        return [i for i in range(len(self.outstanding)) if i not in self.retired]

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        request_id: str,
        avoid: Iterable[int] = (),
        engine: int | None = None,
    ) -> PoolResult:
        """The n samples of one group, all on one engine: ``engine``, or else the one
        ``pick`` chooses."""
        index = self.pick(avoid) if engine is None else engine
        self.outstanding[index] += 1
        try:
            try:
                generations = await self._generate(index, prompt_ids, params, n, request_id)
            except StaleWeights:
                # a restarted engine: bring it to the run's weights, then ask once more
                step, path, mode = self.target
                if await self._sync_one(index, step, path, mode) < step:
                    raise
                generations = await self._generate(index, prompt_ids, params, n, request_id)
        except Exception as exc:
            if self._unreachable(exc):
                self._failed_on(index)
            return PoolResult(index, error=self._describe(index, exc))
        finally:
            self.outstanding[index] -= 1
        self.cooling.pop(index, None)
        return PoolResult(index, generations)

    async def abort(self, request_ids: list[str] | None = None) -> int:
        counts = await self._each(lambda i: self._abort(i, request_ids), CONTROL_TIMEOUT_S)
        return sum(c for c in counts if isinstance(c, int))

    async def pause(self) -> list[int]:
        """Pause every engine; returns the engines that did not confirm."""
        return _failed(await self._each(lambda i: self._call(i, "pause"), CONTROL_TIMEOUT_S))

    async def resume(self) -> list[int]:
        return _failed(await self._each(lambda i: self._call(i, "resume"), CONTROL_TIMEOUT_S))

    async def update_weights(self, model_step: int, path: str | None = None) -> list[int]:
        """Load ``model_step`` on every engine; returns the engines that did not confirm."""
        return _failed(await self._each(lambda i: self._call(i, "update_weights", model_step, path)))

    async def sync_weights(
        self, model_step: int, path: str | None = None, mode: str = "abort", timeout_s: float = 30.0
    ) -> list[int]:
        """Bring every engine to ``model_step``, re-sending to those whose call failed (an
        engine restarting, a call lost) until ``timeout_s``; returns the engines that never
        confirmed. An engine that has not confirmed after SYNC_PROBE_S and does not answer
        a health probe either (its node is gone, it waits for one) is given up, not
        waited for, and so is one known gone (cooling) at the start: it is brought to the
        run's weights before its next group anyway (``target``), and gets no new work
        meanwhile. The call to an engine given up is left to finish, never cancelled (it
        may be loading the weights)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        probe_at = loop.time() + SYNC_PROBE_S
        if model_step >= self.target[0]:
            self.target = (model_step, path, mode)

        def send(i: int) -> asyncio.Future[int]:
            return asyncio.ensure_future(self._sync_one(i, model_step, path, mode))

        now = time.monotonic()
        gone = [i for i in self.serving() if self.cooling.get(i, (0.0, 0.0))[0] > now]
        calls = {i: send(i) for i in self.serving() if i not in gone}
        try:
            while True:
                waiting = [c for c in calls.values() if not c.done()]
                if waiting:
                    until = min(deadline, probe_at) if probe_at > loop.time() else deadline
                    await asyncio.wait(waiting, timeout=max(0.0, min(until - loop.time(), 1.0)))
                confirmed = {i for i, c in calls.items() if c.done() and c.result() >= model_step}
                if len(confirmed) == len(calls) or loop.time() >= deadline:
                    return sorted([i for i in calls if i not in confirmed] + gone)
                if loop.time() >= probe_at:
                    probe_at = loop.time() + SYNC_PROBE_S
                    silent = [i for i, c in calls.items() if not c.done()]
                    answers = await asyncio.gather(*(self._answers(i) for i in silent))
                    for i, answered in zip(silent, answers, strict=True):
                        if not answered:
                            call = calls.pop(i)
                            self._left.add(call)  # referenced while it runs
                            call.add_done_callback(self._left.discard)
                            gone.append(i)
                            self._failed_on(i)
                failed = [i for i, c in calls.items() if c.done() and c.result() < model_step]
                if failed:
                    await asyncio.sleep(0.2)
                    for i in failed:
                        calls[i] = send(i)
        finally:
            for call in calls.values():
                call.cancel()  # the engine may still finish it; a later sync is a no-op then

    async def _answers(self, index: int) -> bool:
        try:
            await asyncio.wait_for(self._health(index), PROBE_ANSWER_S)
        except Exception:
            return False
        return True

    async def _sync_one(self, index: int, model_step: int, path: str | None, mode: str) -> int:
        try:
            return int(await self._call(index, "sync_weights", model_step, path, mode))
        except Exception:
            return -1

    async def health(self) -> list[EngineHealth | None]:
        """Each engine's health, None for one that does not answer."""
        replies = await self._each(self._health)
        return [r if isinstance(r, EngineHealth) else None for r in replies]

    async def _each(self, call: Callable[[int], Awaitable[Any]], timeout_s: float | None = None) -> list[Any]:
        """``call`` on every serving engine, by index: None for a retired one, the
        exception for one that failed or (with ``timeout_s``: an engine whose node is
        gone never answers) did not answer in time."""

        async def nothing() -> None:
            return None

        calls = (
            nothing() if i in self.retired else asyncio.wait_for(call(i), timeout_s)
            for i in range(len(self.outstanding))
        )
        return list(await asyncio.gather(*calls, return_exceptions=True))

    # --- how to reach engine i -----------------------------------------------------------

    async def _generate(
        self, index: int, prompt_ids: list[int], params: SamplingParams, n: int, request_id: str
    ) -> list[Generation]:
        raise NotImplementedError

    async def _abort(self, index: int, request_ids: list[str] | None) -> int:
        raise NotImplementedError

    async def _health(self, index: int) -> EngineHealth:
        raise NotImplementedError

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def _describe(self, index: int, exc: Exception) -> str:
        return f"engine {index}: {first_line(exc)}"

    def _unreachable(self, exc: Exception) -> bool:
        """Whether ``exc`` says the engine is gone (not that it refused the request)."""
        return False


class EnginePool(BasePool):
    """Engines in the run's named Ray actors."""

    def __init__(self, run: str, handles: list[Any]) -> None:
        super().__init__(len(handles))
        self.run = run
        self.handles = handles

    def resize(self, handles: list[Any]) -> None:
        """Serve with the engines ``handles`` (indices 0 .. len-1, as the run's engine count
        says now): new ones join (a new engine is brought to the run's weights before its
        first group, as a restarted one), those above retire. Called on the event loop."""
        for i, handle in enumerate(handles):
            if i < len(self.handles):
                self.handles[i] = handle
            else:
                self.handles.append(handle)
                self.outstanding.append(0)
        self.retired = set(range(len(handles), len(self.handles)))

    def forget_retired(self) -> None:
        """Drop the retired engines (removed from the cluster) from the pool."""
        keep = len(self.handles) - len(self.retired)
        del self.handles[keep:], self.outstanding[keep:]
        self.retired = set()

    @classmethod
    def start(cls, run: str, engines: EngineSettings, *, detached: bool = True) -> EnginePool:
        """Create run ``run``'s engine actors (or find those already there) and wait until
        each answers."""
        handles = [create_engine(run, engines, i, detached=detached) for i in range(engines.count)]
        pool = cls(run, handles)
        wait_for_engines(engines, [h.health.remote() for h in handles])
        return pool

    @classmethod
    def attach(
        cls, run: str, count: int, timeout_s: float | None = None, stop: threading.Event | None = None
    ) -> EnginePool | None:
        """The ``count`` engine actors of run ``run`` that another process started
        (engines.count as the run's engines process says now). Without ``timeout_s``
        one look, raising PoolError when one is missing; with it, wait (0: for ever)
        until every engine is registered and answers, warning every few seconds; None
        when ``stop`` is set first."""
        what = f"the {count} engines of run {run!r}"

        def probe() -> EnginePool:
            handles = []
            for i in range(count):
                name = actor_name(run, i)
                try:
                    handles.append(ray.get_actor(name, namespace=namespace(run)))
                except ValueError:
                    raise NotYet(
                        f"no engine actor {name} in namespace {namespace(run)}: "
                        "is `rollstream engines` running for this run?"
                    ) from None
            if timeout_s is not None:
                try:
                    ray.get([h.health.remote() for h in handles], timeout=ANSWER_TIMEOUT_S)
                except (RayError, TimeoutError) as exc:
                    raise NotYet(f"not every engine answers yet: {first_line(exc)}") from None
            return cls(run, handles)

        if timeout_s is None:
            try:
                return probe()
            except NotYet as exc:
                raise PoolError(str(exc)) from None
        return wait_until(probe, what, timeout_s, stop)

    def probe(self, timeout_s: float = ANSWER_TIMEOUT_S) -> list[EngineHealth | None]:
        """Each engine's health, None for one that does not answer within ``timeout_s``:
        for `rollstream check --engines` and the engines process's heartbeat."""
        calls = [h.health.remote() for h in self.handles]
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        out: list[EngineHealth | None] = []
        for call in calls:
            try:
                out.append(EngineHealth(**loads(ray.get(call))) if call in ready else None)
            except RayError:
                out.append(None)
        return out

    def locate(self, timeout_s: float = ANSWER_TIMEOUT_S) -> list[dict[str, Any] | None]:
        """Where each engine runs (EngineActor.where), None for one that does not answer."""
        calls = [h.where.remote() for h in self.handles]
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        out: list[dict[str, Any] | None] = []
        for call in calls:
            try:
                out.append(loads(ray.get(call)) if call in ready else None)
            except RayError:
                out.append(None)
        return out

    @staticmethod
    def stop(run: str, count: int) -> int:
        """Kill run ``run``'s engine actors, those registered and the first ``count``
        (engines.count), and free their placement groups; returns how many there were."""
        killed = 0
        for i in engine_indices(run) | set(range(count)):
            if remove_engine(run, i):
                killed += 1
        return killed

    async def _generate(
        self, index: int, prompt_ids: list[int], params: SamplingParams, n: int, request_id: str
    ) -> list[Generation]:
        request = dumps(
            {
                "prompt_ids": prompt_ids,
                "params": params.to_dict(),
                "n": n,
                "request_id": request_id,
                "min_step": self.target[0],
            }
        )
        reply = await self.handles[index].generate.remote(request)
        return [Generation.from_dict(g) for g in loads(reply)]

    async def _abort(self, index: int, request_ids: list[str] | None) -> int:
        return int(await self.handles[index].abort.remote(dumps(request_ids)))

    async def _health(self, index: int) -> EngineHealth:
        return EngineHealth(**loads(await self.handles[index].health.remote()))

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        return await getattr(self.handles[index], method).remote(*args)

    def _unreachable(self, exc: Exception) -> bool:
        return isinstance(exc, RayError) and not isinstance(exc, RayTaskError)

    def _describe(self, index: int, exc: Exception) -> str:
        if isinstance(exc, RayTaskError):  # the engine raised: its message says why
            return f"engine {index}: {exc.cause if exc.cause else first_line(exc)}"
        if isinstance(exc, RayActorError):  # the actor died (and is being restarted)
            return f"engine {index} died: {first_line(exc)}"
        if isinstance(exc, RayError):
            return f"engine {index} unreachable: {first_line(exc)}"
        return super()._describe(index, exc)


class LocalPool(BasePool):
    """Engines in this process: one-process runs and tests of the producer logic."""

    def __init__(self, engines: list[Engine]) -> None:
        super().__init__(len(engines))
        self.hosts = [EngineHost(e) for e in engines]

    @classmethod
    def start(cls, engines: EngineSettings) -> LocalPool:
        """engines.count engines of engines.kind, in this process."""
        return cls([make_engine(engines) for _ in range(engines.count)])

    async def _generate(
        self, index: int, prompt_ids: list[int], params: SamplingParams, n: int, request_id: str
    ) -> list[Generation]:
        return await self.hosts[index].generate(prompt_ids, params, n, request_id, self.target[0])

    async def _abort(self, index: int, request_ids: list[str] | None) -> int:
        return await self.hosts[index].abort(request_ids)

    async def _health(self, index: int) -> EngineHealth:
        return await self.hosts[index].health()

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        return await getattr(self.hosts[index], method)(*args)


def _failed(replies: list[Any]) -> list[int]:
    return [i for i, reply in enumerate(replies) if isinstance(reply, BaseException)]
