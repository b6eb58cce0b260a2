"""The loop every multi-turn agent runs: a model turn, then what answers it, until the
trajectory ends (done, max_turns, max_trajectory_tokens, an environment error) or an
abort reaches its group.

Weight syncs in the middle of a trajectory follow ``rollout.on_weight_sync``:

- ``drain``: the model turn in flight finishes on the old weights; the next turn
  waits for the new ones and runs on them. The trajectory's versions change
  between turns.
- ``partial``: the engine takes the new weights in place; the turn in flight goes
  on with them, so its later tokens carry the new step. Versions change within a turn.
- ``abort``: the turn in flight is aborted, and so is a trajectory whose next turn
  would run on newer weights than its earlier turns (it was between turns at the
  sync): the group goes back to the aborted pool with nothing kept and is made again
  on the new weights, so that in abort mode no trajectory mixes versions.

An aborted trajectory (an abort in partial mode: a pause, a stop, a sync-mode
leftover) keeps its complete turns: every model turn that finished and what answered
it, with their tokens, logprobs and versions. The model turn that the abort cut off
is dropped (its text is not known to be a whole action, and an environment cannot
take half of one). The producer hands the trajectory back to the aborted pool; the
next producer to claim it resumes it there: the agent rebuilds its state from the
kept turns (``start``) and carries on with the next model turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollstream.producer.agents.base import (
    MAX_TOKENS,
    MAX_TURNS,
    AgentConfig,
    Rollout,
    Trajectory,
    gather_or_fail,
)
from rollstream.producer.agents.text import TurnText, check_template
from rollstream.producer.engines.base import FINISH_ABORT, Generation
from rollstream.shared.records import Sample

COMMON_OPTIONS = ("turn_template",)


class TurnLoop:
    """Base of multi-turn agents: subclasses say how a trajectory starts (``start``)
    and what answers a model turn (``respond``)."""

    name = "turn loop"
    stop: Sequence[str] = ()  # stop strings of each model turn

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        template = config.options.get("turn_template")
        self.turn_template = None if template is None else check_template(str(template))

    async def run_group(self, rollout: Rollout, samples: list[Sample]) -> list[Sample]:
        text = TurnText(rollout.tokenizer, rollout.prompt.prompt, self.turn_template)
        trajectories = [Trajectory.resume(s) for s in samples]
        states: list[Any] = []
        try:
            states = await gather_or_fail([self.start(rollout, text, t) for t in trajectories])
            openings = await self._open(rollout, trajectories)
            await gather_or_fail(
                [
                    self._run(rollout, text, t, states[i], i, openings.get(i))
                    for i, t in enumerate(trajectories)
                ]
            )
        finally:
            for state in states:
                await self.finish(state)
        return [t.to_sample() for t in trajectories]

    async def _open(self, rollout: Rollout, trajectories: list[Trajectory]) -> dict[int, Generation]:
        """The first model turn of the fresh trajectories: one request of n for those that
        start alike (the same prompt, the same first observation), so that one engine's
        prefix cache serves them and they are n samples, not n copies of one."""
        alike: dict[tuple[int, ...], list[int]] = {}
        for i, trajectory in enumerate(trajectories):
            if trajectory.model_turns == 0 and not trajectory.ended:
                alike.setdefault(tuple(trajectory.context()), []).append(i)
        openings: dict[int, Generation] = {}

        async def opening(indices: list[int]) -> None:
            first = trajectories[indices[0]]
            max_tokens = self.budget(first)
            if max_tokens > 0:  # else each ends at its first turn, for want of room
                key = f".{indices[0]}.0"
                generations = await rollout.generate(
                    first.context(), len(indices), max_tokens, key, self.stop
                )
                openings.update(zip(indices, generations, strict=True))

        await gather_or_fail([opening(indices) for indices in alike.values()])
        return openings

    async def _run(
        self,
        rollout: Rollout,
        text: TurnText,
        trajectory: Trajectory,
        state: Any,
        index: int,
        opening: Generation | None,
    ) -> None:
        turn = trajectory.model_turns
        while not trajectory.ended:
            if turn >= self.config.max_turns:
                trajectory.end(MAX_TURNS)
                break
            if opening is not None:
                generation = self.take(rollout, trajectory, opening)
                opening = None
            else:
                generation = await self.model_turn(rollout, trajectory, f".{index}.{turn}")
            if generation is None:
                break
            turn += 1
            last = turn >= self.config.max_turns
            await self.respond(rollout, text, trajectory, state, generation, last=last)

    def room(self, trajectory: Trajectory) -> int | None:
        """Response tokens the trajectory may still take, None when unbounded."""
        if not self.config.max_trajectory_tokens:
            return None
        return self.config.max_trajectory_tokens - trajectory.length

    def budget(self, trajectory: Trajectory) -> int:
        """max_tokens of the trajectory's next model turn."""
        room = self.room(trajectory)
        return self.config.max_tokens if room is None else min(self.config.max_tokens, room)

    async def model_turn(self, rollout: Rollout, trajectory: Trajectory, key: str) -> Generation | None:
        """One model turn appended, as sampled; None (the trajectory ended or aborted)
        when there is no room left or the turn was aborted."""
        max_tokens = self.budget(trajectory)
        if max_tokens <= 0:
            trajectory.end(MAX_TOKENS)
            return None
        (generation,) = await rollout.generate(trajectory.context(), 1, max_tokens, key, self.stop)
        return self.take(rollout, trajectory, generation)

    def take(self, rollout: Rollout, trajectory: Trajectory, generation: Generation) -> Generation | None:
        """The model turn appended, unless it was aborted (or must be, in abort mode)."""
        if generation.finish_reason == FINISH_ABORT:
            trajectory.aborted = True  # its cut-off turn is dropped: the complete ones stay
            return None
        if (
            rollout.on_weight_sync == "abort"
            and len(generation.versions)
            and int(generation.versions.min()) > trajectory.max_version() >= 0
        ):
            # abort mode: a trajectory never mixes versions; the group is made again
            rollout.aborting = True
            trajectory.aborted = True
            return None
        trajectory.add_model(generation)
        return generation

    def fits(self, trajectory: Trajectory, ids: list[int]) -> bool:
        """Whether a turn of ``ids`` leaves room for at least one more model token."""
        room = self.room(trajectory)
        return room is None or len(ids) < room

    async def start(self, rollout: Rollout, text: TurnText, trajectory: Trajectory) -> Any:
        """The state the trajectory's turns need (an environment), from its kept turns
        when it is resumed."""
        return None

    async def finish(self, state: Any) -> None:
        """The trajectory is over (or its attempt failed): release what ``start`` made."""

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
        """What answers the model turn just appended: turns added, or the trajectory
        ended. ``last``: no model turn may follow (max_turns), so nothing need be said."""
        raise NotImplementedError
