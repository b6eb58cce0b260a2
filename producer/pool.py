"""The Ray engine pool: engines in named, detached actors that any producer process
attaches to by name.

    rollstream:{run}:engine:{i}    actor names, in the Ray namespace rollstream-{run}

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
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from producer.engines import make_engine
from producer.engines.base import EngineHealth, Generation, SamplingParams, dumps, loads
from shared.errors import RollstreamError
from shared.settings import EngineSettings, Settings


class PoolError(RollstreamError):
    """The engine actors cannot be started, found or reached."""


def namespace(run: str) -> str:
    return f"rollstream-{run}"


def actor_name(run: str, index: int) -> str:
    return f"rollstream:{run}:engine:{index}"


def init_ray(address: str | None = None, *, local: bool = False) -> None:
    """Join the Ray cluster at ``address`` (or RAY_ADDRESS, or "auto"); with ``local``
    start a one-machine Ray when there is none. Once per process."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None and local:
        ray.init(include_dashboard=False, log_to_driver=False)
        return
    try:
        ray.init(address=address or "auto", log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise PoolError(
            f"no Ray cluster at {address or 'auto'}: start one with `ray start --head`, "
            f"or run with --foreground to start a local Ray ({exc})"
        ) from None


@ray.remote
class EngineActor:
    """One engine in a Ray actor. Async methods: the actor serves many requests at once."""

    def __init__(self, engine_settings: bytes, index: int) -> None:
        self.index = index
        self.engine = make_engine(EngineSettings.model_validate_json(engine_settings))

    async def generate(self, request: bytes) -> bytes:
        r = loads(request)
        params = SamplingParams.from_dict(r["params"])
        generations = await self.engine.generate(r["prompt_ids"], params, r["n"], r["request_id"])
        return dumps([g.to_dict() for g in generations])

    async def abort(self, request_ids: bytes) -> int:
        return await self.engine.abort(loads(request_ids))

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        await self.engine.update_weights(model_step, path)

    async def health(self) -> bytes:
        return dumps((await self.engine.health()).to_dict())


@dataclass(slots=True)
class PoolResult:
    """What one engine made of one group: its generations, or why it failed."""

    engine: int
    generations: list[Generation] = field(default_factory=list)
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error)


class EnginePool:
    def __init__(self, run: str, handles: list[Any]) -> None:
        self.run = run
        self.handles = handles
        self.outstanding = [0] * len(handles)

    @classmethod
    def start(cls, settings: Settings, *, detached: bool = True) -> EnginePool:
        """Create the run's engine actors (or find those already there) and wait until
        each answers."""
        engines = settings.engines
        payload = engines.model_dump_json().encode()
        handles = []
        for i in range(engines.count):
            options: dict[str, Any] = {
                "name": actor_name(settings.run, i),
                "namespace": namespace(settings.run),
                "num_cpus": engines.num_cpus,
                "num_gpus": engines.num_gpus,
                "max_restarts": engines.max_restarts,
                "max_task_retries": 0,  # a request of a dead engine fails; the producer retries it
                "get_if_exists": True,
            }
            if detached:
                options["lifetime"] = "detached"
            handles.append(EngineActor.options(**options).remote(payload, i))  # type: ignore[attr-defined]
        pool = cls(settings.run, handles)
        ray.get([h.health.remote() for h in handles])
        return pool

    @classmethod
    def attach(cls, settings: Settings) -> EnginePool:
        """The run's engine actors that another process started."""
        handles = []
        for i in range(settings.engines.count):
            name = actor_name(settings.run, i)
            try:
                handles.append(ray.get_actor(name, namespace=namespace(settings.run)))
            except ValueError:
                raise PoolError(
                    f"no engine actor {name} in namespace {namespace(settings.run)}: "
                    "is `rollstream engines` running for this run?"
                ) from None
        return cls(settings.run, handles)

    @staticmethod
    def stop(settings: Settings) -> int:
        """Kill the run's engine actors; returns how many there were."""
        killed = 0
        for i in range(settings.engines.count):
            try:
                handle = ray.get_actor(actor_name(settings.run, i), namespace=namespace(settings.run))
            except ValueError:
                continue
            ray.kill(handle, no_restart=True)
            killed += 1
        return killed

    def pick(self, avoid: Iterable[int] = ()) -> int:
        """The engine with the fewest requests outstanding from this pool, not in ``avoid``
        unless every engine is."""
        avoided = set(avoid)
        candidates = [i for i in range(len(self.handles)) if i not in avoided] or list(
            range(len(self.handles))
        )
        return min(candidates, key=lambda i: (self.outstanding[i], i))

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        request_id: str,
        avoid: Iterable[int] = (),
    ) -> PoolResult:
        """The n samples of one group, all on one engine."""
        index = self.pick(avoid)
        request = dumps(
            {"prompt_ids": prompt_ids, "params": params.to_dict(), "n": n, "request_id": request_id}
        )
        self.outstanding[index] += 1
        try:
            reply = await self.handles[index].generate.remote(request)
        except RayTaskError as exc:  # the engine raised: its message says why
            return PoolResult(index, error=f"engine {index}: {exc.cause if exc.cause else exc}")
        except RayActorError as exc:  # the actor died (and is being restarted)
            return PoolResult(index, error=f"engine {index} died: {_first_line(exc)}")
        except RayError as exc:
            return PoolResult(index, error=f"engine {index} unreachable: {_first_line(exc)}")
        finally:
            self.outstanding[index] -= 1
        return PoolResult(index, [Generation.from_dict(g) for g in loads(reply)])

    async def abort(self, request_ids: list[str] | None = None) -> int:
        counts = await self._each(lambda h: h.abort.remote(dumps(request_ids)))
        return sum(c for c in counts if isinstance(c, int))

    async def pause(self) -> list[int]:
        """Pause every engine; returns the engines that did not confirm."""
        return _failed(await self._each(lambda h: h.pause.remote()))

    async def resume(self) -> list[int]:
        return _failed(await self._each(lambda h: h.resume.remote()))

    async def update_weights(self, model_step: int, path: str | None = None) -> list[int]:
        """Load ``model_step`` on every engine; returns the engines that did not confirm."""
        return _failed(await self._each(lambda h: h.update_weights.remote(model_step, path)))

    async def health(self) -> list[EngineHealth | None]:
        """Each engine's health, None for one that does not answer."""
        replies = await self._each(lambda h: h.health.remote())
        return [EngineHealth(**loads(r)) if isinstance(r, bytes) else None for r in replies]

    async def _each(self, call: Any) -> list[Any]:
        return list(await asyncio.gather(*(call(h) for h in self.handles), return_exceptions=True))


def _failed(replies: list[Any]) -> list[int]:
    return [i for i, reply in enumerate(replies) if isinstance(reply, BaseException)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
