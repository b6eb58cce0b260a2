"""Produce progress with XTuner's ProduceProgress meaning, kept in Redis.

The cumulative counters live in rs:{run}:progress (``{task}:{counter}``), where
the buffer operations update them in the same transaction as the entries they
count; the steps live in rs:{run}:state. ``state_dict()`` snapshots them for a
checkpoint; ``load_state_dict()`` puts them back after a restart and never moves a
count backwards (a Redis that kept running has newer counts than the checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from rollstream.shared.keys import MODEL_STEP, TRAIN_STEP, Count, Keys, progress_field
from rollstream.shared.streams import stored_float, stored_int, stored_step


class ProduceProgress:
    """Every counter of the run's tasks (keys.Count), and its steps. A checkpoint holds
    every counter: one that left, say, groups_dead out would bring a run that lost its
    Redis back with admission counting those groups as trainable again."""

    def __init__(self, client: redis.Redis, keys: Keys, quota: Mapping[str, int]) -> None:
        """``quota``: the groups of each of the run's tasks in a train step
        (runconfig.task_quota), what a checkpoint's targets count in."""
        self.client = client
        self.keys = keys
        self.tasks = list(quota)
        self.quota = dict(quota)

    def counts(self, task: str) -> dict[str, float]:
        """The task's counters; CorruptValueError names one that holds something else."""
        names = [progress_field(task, c) for c in Count]
        values: list[Any] = self.client.hmget(self.keys.progress, names)
        key = self.keys.progress
        return {
            c.value: stored_float(v, key, name)
            if c == Count.REWARD_SUM
            else stored_int(v, key, name, "a count")
            for c, name, v in zip(Count, names, values, strict=True)
        }

    def _steps(self) -> tuple[int, int]:
        train, model = self.client.hmget(self.keys.state, [TRAIN_STEP, MODEL_STEP])
        key = self.keys.state
        return stored_step(train, key, TRAIN_STEP), stored_step(model, key, MODEL_STEP)

    def state_dict(self) -> dict[str, Any]:
        train_step, model_step = self._steps()
        return {
            "next_consumer_step": train_step + 1,
            "model_step": model_step,
            "tasks": {
                task: {**self.counts(task), "target": train_step * self.quota[task]} for task in self.tasks
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's counts; each counter becomes max(now, saved)."""
        for task, counts in state["tasks"].items():
            now = self.counts(task)
            for counter in Count:
                saved = counts.get(counter.value, 0)
                if saved > now[counter.value]:
                    self.client.hset(self.keys.progress, progress_field(task, counter), saved)
        current_train, current_model = self._steps()
        train_step = max(current_train, int(state["next_consumer_step"]) - 1)
        model_step = max(current_model, int(state.get("model_step", 0)))
        self.client.hset(self.keys.state, mapping={TRAIN_STEP: train_step, MODEL_STEP: model_step})
