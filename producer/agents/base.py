"""The agent protocol, and what every agent loop is built from: the engine handle a
group's attempt hands its agent (Rollout), and the trajectory it builds (Trajectory).

Token in, token out. A trajectory is one token sequence: the prompt's ids, then each
model turn's ids exactly as the engine sampled them (with their logprobs and
versions), then each environment or tool turn's ids as tokenised once, when it was
said (text.py). The engine is given that sequence as it stands, never a text to
tokenise again, so that the ids a trainer reads are the ids the policy sampled.
The loss mask is 1 on the model's tokens and 0 on the others.

An agent takes the samples of one group that still need generating (a fresh one has
no response token; one handed back by an abort keeps its complete turns) and runs
each to the end of its trajectory, calling the engine as often as it needs. It
returns them as samples: COMPLETED, or ABORTED when an abort reached the group (the
producer hands them back to the aborted pool, in partial mode with what they kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from rollstream.producer.engines.base import FINISH_ABORT, Generation
from rollstream.producer.tokenizer import Tokenizer
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import (
    ID_DTYPE,
    LOGPROB_DTYPE,
    MASK_DTYPE,
    MODEL,
    IdArray,
    Prompt,
    Sample,
    Status,
    Turn,
)
from rollstream.shared.settings import ProducerSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

# How a trajectory ended: the agent status a sample carries (Sample.agent_status).
DONE = "done"  # the environment said done, or the model answered without calling a tool
MAX_TURNS = "max_turns"  # producer.max_turns model turns were taken
MAX_TOKENS = "max_tokens"  # producer.max_trajectory_tokens left no room for another turn
ENV_ERROR = "env_error"  # the environment raised (its message is the last turn's text)

OPTION_ERROR = "invalid setting producer.agent_options (ROLLSTREAM_PRODUCER__AGENT_OPTIONS)"

# The engine call an attempt makes: (token ids, n, max_tokens, request id, stop strings)
# -> n generations; it raises when the attempt must be retried on another engine.
Request = Callable[[list[int], int, int, str, Sequence[str]], Awaitable[list[Generation]]]


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """What an agent is built from: the producer's budgets and the agent's own options
    (``producer.agent_options``)."""

    max_tokens: int = 1024  # per model turn (producer.max_tokens)
    max_turns: int = 8  # model turns per trajectory (producer.max_turns)
    max_trajectory_tokens: int = 0  # response tokens per trajectory, 0 = no bound
    on_weight_sync: str = "partial"  # rollout.on_weight_sync: drain, abort or partial
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, producer: ProducerSettings, on_weight_sync: str) -> AgentConfig:
        return cls(
            max_tokens=producer.max_tokens,
            max_turns=producer.max_turns,
            max_trajectory_tokens=producer.max_trajectory_tokens,
            on_weight_sync=on_weight_sync,
            options=dict(producer.agent_options),
        )

    def check_options(self, agent: str, known: Sequence[str], required: Sequence[str] = ()) -> None:
        """SettingsError naming producer.agent_options for an option the agent does not
        take or one it needs and lacks."""
        unknown = sorted(set(self.options) - set(known))
        if unknown:
            raise SettingsError(
                f"{OPTION_ERROR}: agent {agent!r} has no option {unknown[0]!r}; "
                f"its options are {', '.join(known) or 'none'}"
            )
        missing = [name for name in required if name not in self.options]
        if missing:
            raise SettingsError(f"{OPTION_ERROR}: agent {agent!r} needs the option {missing[0]!r}")


class Rollout:
    """One attempt at one group, as its agent sees it: the prompt, its ids, the
    tokenizer, and ``generate``, which calls the engine pool.

    Once any request of the attempt comes back aborted (a weight sync in abort mode, a
    pause, a stop, a sync-mode leftover), the group is going back to the aborted pool:
    later requests return at once, aborted with no token, so that no trajectory of the
    group starts another turn.
    """

    def __init__(
        self,
        prompt: Prompt,
        prompt_ids: list[int],
        tokenizer: Tokenizer,
        request: Request,
        request_id: str,
        on_weight_sync: str = "partial",
    ) -> None:
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.on_weight_sync = on_weight_sync
        self.aborted = asyncio.Event()  # set with ``aborting``: for agents that wait on it
        self.issued: list[str] = []  # the request ids of the attempt, in order
        self._request = request

    @property
    def aborting(self) -> bool:
        return self.aborted.is_set()

    @aborting.setter
    def aborting(self, value: bool) -> None:
        if value:
            self.aborted.set()
        else:
            self.aborted.clear()

    async def generate(
        self, ids: list[int], n: int, max_tokens: int, key: str = "", stop: Sequence[str] = ()
    ) -> list[Generation]:
        """n generations from ``ids``; the request id is the attempt's plus ``key``."""
        if self.aborting:
            return [_aborted() for _ in range(n)]
        self.issued.append(self.request_id + key)
        generations = await self._request(ids, n, max_tokens, self.request_id + key, stop)
        if any(g.finish_reason == FINISH_ABORT for g in generations):
            self.aborting = True
        return generations


def _aborted() -> Generation:
    empty = np.zeros(0, dtype=ID_DTYPE)
    return Generation(empty, np.zeros(0, dtype=LOGPROB_DTYPE), empty, FINISH_ABORT)


@runtime_checkable
class Agent(Protocol):
    """What every agent implements (``producer.agent``)."""

    async def run_group(self, rollout: Rollout, samples: list[Sample]) -> list[Sample]:
        """Each sample taken on to the end of its trajectory (or until an abort), in order."""
        ...


class Trajectory:
    """A trajectory as it is built: the prompt's ids, then turn after turn of token ids.
    A model turn keeps the engine's ids, logprobs and versions as they are; another
    turn's ids are the ones tokenised when it was said.

    Versions: every token carries one, so a turn of the environment carries the
    version of the model turn before it (the first model turn's, before any): the
    version runs stay few, and the group's model step, the oldest version, is the
    oldest model token's. Logprobs: 0 on tokens the model did not sample (outside the
    loss mask), NaN on a model turn whose engine gave none.
    """

    def __init__(self, prompt_ids: IdArray | list[int]) -> None:
        self.prompt_ids = np.asarray(prompt_ids, dtype=ID_DTYPE)
        self.turns: list[Turn] = []
        self.status: str | None = None  # the agent status once it ended
        self.aborted = False
        self.finish_reason: str | None = None  # the last model turn's
        self._ids: list[IdArray] = []  # one per turn
        self._logprobs: list[np.ndarray | None] = []  # None: a turn without logprobs
        self._versions: list[IdArray | None] = []  # None: not the model's (filled in to_sample)
        self._context: list[int] = self.prompt_ids.tolist()

    @property
    def length(self) -> int:
        """Response tokens so far, the model's and the others'."""
        return len(self._context) - len(self.prompt_ids)

    @property
    def model_turns(self) -> int:
        return sum(1 for t in self.turns if t.role == MODEL)

    @property
    def ended(self) -> bool:
        return self.status is not None or self.aborted

    def context(self) -> list[int]:
        """The whole sequence so far: what the engine continues."""
        return list(self._context)

    def max_version(self) -> int:
        return max((int(v.max()) for v in self._versions if v is not None and len(v)), default=-1)

    def add_model(self, generation: Generation, text: str | None = None) -> Turn:
        ids = generation.response_ids
        turn = Turn(MODEL, len(ids), generation.text if text is None else text)
        self._add(turn, ids, generation.logprobs if len(generation.logprobs) == len(ids) else None)
        self._versions[-1] = generation.versions
        self.finish_reason = generation.finish_reason
        return turn

    def add_turn(
        self, role: str, ids: list[int], text: str, *, status: str | None = None, name: str | None = None
    ) -> Turn:
        """A turn the model did not say (``role`` not MODEL), tokenised once by the caller."""
        turn = Turn(role, len(ids), text, status=status, name=name)
        self._add(turn, np.asarray(ids, dtype=ID_DTYPE), np.zeros(len(ids), dtype=LOGPROB_DTYPE))
        return turn

    def note(self, role: str, text: str, *, status: str | None = None, name: str | None = None) -> Turn:
        """A turn of no tokens: recorded, never seen by the model (an environment error
        that ends the trajectory)."""
        return self.add_turn(role, [], text, status=status, name=name)

    def _add(self, turn: Turn, ids: IdArray, logprobs: np.ndarray | None) -> None:
        self.turns.append(turn)
        self._ids.append(ids)
        self._logprobs.append(logprobs)
        self._versions.append(None)
        self._context.extend(ids.tolist())

    def end(self, status: str) -> None:
        if self.status is None:
            self.status = status

    def to_sample(self) -> Sample:
        """The trajectory as a sample: COMPLETED with its agent status, or ABORTED with
        its complete turns (for the producer to hand back). A trajectory in which the
        model never spoke keeps its turns' texts but no token: nothing in it trains,
        and nothing gives its other tokens a version."""
        if not any(v is not None and len(v) for v in self._versions):
            turns = [replace(t, length=0) for t in self.turns]
            ids: np.ndarray = np.zeros(0, dtype=ID_DTYPE)
            logprobs: np.ndarray = np.zeros(0, dtype=LOGPROB_DTYPE)
            versions: np.ndarray = np.zeros(0, dtype=ID_DTYPE)
            mask: np.ndarray = np.zeros(0, dtype=MASK_DTYPE)
        else:
            turns = self.turns
            ids = np.concatenate(self._ids)
            versions = np.concatenate(self._filled_versions())
            mask = np.concatenate(
                [
                    np.full(len(i), t.role == MODEL, dtype=MASK_DTYPE)
                    for t, i in zip(turns, self._ids, strict=True)
                ]
            )
            if any(lp is not None for t, lp in zip(turns, self._logprobs, strict=True) if t.role == MODEL):
                logprobs = np.concatenate(
                    [
                        lp if lp is not None else np.full(len(i), np.nan, dtype=LOGPROB_DTYPE)
                        for i, lp in zip(self._ids, self._logprobs, strict=True)
                    ]
                )
            else:
                logprobs = np.zeros(0, dtype=LOGPROB_DTYPE)
        last_model = next((t for t in reversed(turns) if t.role == MODEL), None)
        return Sample(
            self.prompt_ids,
            ids,
            logprobs,
            versions,
            finish_reason=FINISH_ABORT if self.aborted else self.finish_reason,
            status=Status.ABORTED if self.aborted else Status.COMPLETED,
            # the final answer, for the judge; every turn's text is in turns
            text=last_model.text if last_model is not None else "",
            loss_mask=mask,
            turns=list(turns),
            agent_status=None if self.aborted else self.status,
        )

    def _filled_versions(self) -> list[IdArray]:
        filled: list[IdArray | None] = list(self._versions)
        previous: int | None = None
        for i, versions in enumerate(filled):
            if versions is not None and len(versions):
                previous = int(versions[-1])
            elif versions is None and previous is not None:
                filled[i] = np.full(len(self._ids[i]), previous, dtype=ID_DTYPE)
        following: int | None = None
        for i in range(len(filled) - 1, -1, -1):  # before any model turn: the first one's
            versions = filled[i]
            if versions is not None and len(versions):
                following = int(versions[0])
            elif versions is None:
                filled[i] = np.full(len(self._ids[i]), following, dtype=ID_DTYPE)
        return [v for v in filled if v is not None]

    @classmethod
    def resume(cls, sample: Sample) -> Trajectory:
        """A trajectory handed back aborted, from its complete turns: the tokens, logprobs
        and versions it kept, turn by turn. One without a model turn starts afresh."""
        trajectory = cls(sample.prompt_ids)
        turns = sample.turns or []
        if not any(t.role == MODEL and t.length for t in turns):
            return trajectory
        has_logprobs = len(sample.logprobs) == len(sample.response_ids)
        start = 0
        for turn in turns:
            end = start + turn.length
            ids = sample.response_ids[start:end]
            logprobs: np.ndarray | None = np.zeros(turn.length, dtype=LOGPROB_DTYPE)
            versions: IdArray | None = None
            if turn.role == MODEL:
                logprobs = sample.logprobs[start:end] if has_logprobs else None
                if logprobs is not None and len(logprobs) and np.isnan(logprobs).all():
                    logprobs = None  # the engine gave none for this turn
                versions = sample.response_versions[start:end]
            trajectory.turns.append(replace(turn))
            trajectory._ids.append(ids)
            trajectory._logprobs.append(logprobs)
            trajectory._versions.append(versions)
            trajectory._context.extend(ids.tolist())
            start = end
        trajectory.finish_reason = sample.finish_reason
        return trajectory


async def call(function: Callable[..., Any], *args: Any) -> Any:
    """A plug-in's method, a coroutine function or a plain one: a plain one runs in a
    thread, so that a slow environment never stalls the producer's event loop (its
    heartbeats, its other groups). The thread is a daemon of its own, not the loop's
    executor's, which asyncio.run waits for at its end: an environment call that never
    returns kept a stopped producer from exiting, its group handed back long before."""
    if asyncio.iscoroutinefunction(function):
        return await function(*args)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # given up (its group was cancelled)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = function(*args), None
        except BaseException as exc:
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone
            loop.call_soon_threadsafe(settle, result, error)

    name = getattr(function, "__qualname__", "call")
    threading.Thread(target=run, name=f"plug-in {name}", daemon=True).start()
    return await future


async def gather_or_fail(coroutines: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Every coroutine's result, in order; on the first exception the others are
    cancelled (and awaited) and it is raised, so that a failed attempt stops its
    whole group at once instead of letting the other trajectories run on."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise failed.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]
