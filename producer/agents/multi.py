"""``multi_turn``: model turns alternating with an environment's, up to the turn and
token budgets.

The environment is a plug-in (agent option ``env``: a dotted path to a class or
factory, built with the keyword arguments of ``env_options``, one per trajectory)::

    class Environment:
        def reset(self, prompt: Prompt) -> str: ...            # the first observation ("" for none)
        def step(self, action: str) -> tuple[str, float, bool]: ...  # observation, reward, done
        def close(self) -> None: ...                            # optional

Methods may be coroutine functions; plain ones run in a thread, so that a slow
environment does not stall the producer. ``action`` is the text of the model's turn.

The turn's reward is recorded on the model turn that took the action (``Turn.reward``);
the judge sees it (``rollstream.producer.agents.rewards:env_return`` sums them). The
first observation, when there is one, is the first turn after the prompt; each
later one follows the model turn it answers. The observation after the last action
(done, or max_turns reached) is not added: the model would never read it.

An environment that raises, or whose step returns something else than (text,
number, bool), ends the trajectory with agent status ``env_error`` and its message
as a last turn of no tokens (status ``error``): recorded, never a silent zero.

Resuming an aborted trajectory rebuilds the environment by replaying: a new one,
``reset(prompt)``, then ``step`` with each kept model turn's text in order. The kept
observations' tokens stay as they were; an environment that answers the replay
differently (it is not deterministic given the prompt and the actions) gets a
warning, and its replayed answers are ignored.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rollstream.producer.agents.base import (
    DONE,
    ENV_ERROR,
    MAX_TOKENS,
    OPTION_ERROR,
    AgentConfig,
    Rollout,
    Trajectory,
    call,
)
from rollstream.producer.agents.loop import COMMON_OPTIONS, TurnLoop
from rollstream.producer.agents.text import TurnText
from rollstream.producer.engines.base import Generation
from rollstream.producer.plugins import import_object
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import ENV, MODEL, Prompt

log = logging.getLogger(__name__)


@runtime_checkable
class Environment(Protocol):
    def reset(self, prompt: Prompt) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool]: ...


class BadAnswer(Exception):
    """An environment answered with something else than the protocol says."""


def load_factory(spec: object, what: str) -> Callable[..., Any]:
    """The class or factory a dotted path names, as producer.agent_options gives it."""
    if not isinstance(spec, str):
        raise SettingsError(
            f"{OPTION_ERROR}: {what} must be a dotted path 'package.module:attr', got {spec!r}"
        )
    try:
        found = import_object(spec, what)
    except SettingsError as exc:
        raise SettingsError(f"{OPTION_ERROR}: {exc}") from None
    if not callable(found):
        raise SettingsError(
            f"{OPTION_ERROR}: {what} {spec!r} is a {type(found).__name__}, not a class or factory"
        )
    return found


class MultiTurnAgent(TurnLoop):
    name = "multi_turn"
    OPTIONS = ("env", "env_options", "observation_role", *COMMON_OPTIONS)

    def __init__(self, config: AgentConfig) -> None:
        config.check_options(self.name, self.OPTIONS, required=("env",))
        super().__init__(config)
        self.env_spec = config.options["env"]
        self.factory = load_factory(self.env_spec, "env")
        env_options = config.options.get("env_options", {})
        if not isinstance(env_options, dict):
            raise SettingsError(
                f"{OPTION_ERROR}: env_options must be an object of the environment's keyword "
                f"arguments, got {env_options!r}"
            )
        self.env_options = env_options
        self.role = str(config.options.get("observation_role", "user"))

    async def start(self, rollout: Rollout, text: TurnText, trajectory: Trajectory) -> Any:
        try:
            env = self.factory(**self.env_options)
            observation = _text(await call(env.reset, rollout.prompt), "reset")
            if trajectory.turns:
                await self._replay(env, text, trajectory, rollout.prompt.group_id)
            elif observation:
                ids, said = text.encode(self.role, observation)
                if self.fits(trajectory, ids):
                    trajectory.add_turn(ENV, ids, said)
                else:
                    trajectory.end(MAX_TOKENS)
        except Exception as exc:
            self._failed(trajectory, exc)
            return None
        return env

    async def _replay(self, env: Any, text: TurnText, trajectory: Trajectory, group_id: str) -> None:
        turns = trajectory.turns
        for i, turn in enumerate(turns):
            if turn.role != MODEL:
                continue
            observation, _, _ = _step(await call(env.step, turn.text))
            following = turns[i + 1] if i + 1 < len(turns) else None
            if following is None or following.role != ENV:
                continue
            if following.text != text.render(self.role, observation):
                log.warning(
                    "environment %s answered turn %d of a resumed trajectory of %s differently: the "
                    "stored observation is kept (an environment must be deterministic given the "
                    "prompt and the actions to be resumed exactly)",
                    self.env_spec, i, group_id,
                )  # fmt: skip

    async def respond(
        self,
        rollout: Rollout,
        text: TurnText,
        trajectory: Trajectory,
        state: Any,
        generation: Generation,
        *,
        last: bool,
    ) -> None:
        turn = trajectory.turns[-1]
        try:
            observation, reward, done = _step(await call(state.step, turn.text))
        except Exception as exc:
            self._failed(trajectory, exc)
            return
        turn.reward = reward
        if done:
            trajectory.end(DONE)
            return
        if last:
            return
        ids, said = text.encode(self.role, observation)
        if not self.fits(trajectory, ids):
            trajectory.end(MAX_TOKENS)
            return
        trajectory.add_turn(ENV, ids, said)

    async def finish(self, state: Any) -> None:
        close = getattr(state, "close", None)
        if callable(close):
            try:
                await call(close)
            except Exception as exc:  # the trajectory is made: a failing close only gets a warning
                log.warning("environment %s failed to close: %s: %s", self.env_spec, type(exc).__name__, exc)

    def _failed(self, trajectory: Trajectory, exc: Exception) -> None:
        reason = str(exc) if isinstance(exc, BadAnswer) else f"{type(exc).__name__}: {exc}"
        trajectory.note(ENV, f"environment {self.env_spec} failed: {reason}", status="error")
        trajectory.end(ENV_ERROR)


def _text(value: object, method: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadAnswer(f"{method} returned {type(value).__name__} {value!r:.60}, not text")
    return value


def _step(value: object) -> tuple[str, float | None, bool]:
    """What step returned, checked: (observation, reward, done)."""
    if not isinstance(value, tuple | list) or len(value) != 3:
        raise BadAnswer(f"step returned {value!r:.80}, not (observation, reward, done)")
    observation, reward, done = value
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward)
    ):
        raise BadAnswer(f"step returned the reward {reward!r:.40}, not a finite number")
    if not isinstance(done, bool):
        raise BadAnswer(f"step returned done = {done!r:.40}, not true or false")
    return _text(observation, "step"), None if reward is None else float(reward), done
