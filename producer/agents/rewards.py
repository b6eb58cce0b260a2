"""Rewards of agent trajectories, as judges (``producer.judge``).

``env_return`` scores a trajectory with what its environment gave: the sum of its
model turns' rewards (``Turn.reward``). It reads the trajectories themselves, so it
runs in the producer (``producer.judge_on_queue`` off): the judge queue carries only
the final texts.
"""

from __future__ import annotations

from rollstream.producer.judges.base import JudgeError, Reward
from rollstream.shared.records import MODEL, Prompt, Sample


def env_return(prompt: Prompt, samples: list[Sample]) -> list[Reward]:
    """Per sample: ``score``, the sum of the environment's rewards; ``turns``, its model turns."""
    rewards: list[Reward] = []
    for i, sample in enumerate(samples):
        if sample.turns is None:
            raise JudgeError(
                f"env_return judges agent trajectories, and sample {i} of {prompt.group_id} is none: "
                "use it with producer.agent multi_turn (or tool) and producer.judge_on_queue off"
            )
        model = [t for t in sample.turns if t.role == MODEL]
        rewards.append(
            {"score": sum(t.reward for t in model if t.reward is not None), "turns": float(len(model))}
        )
    return rewards
