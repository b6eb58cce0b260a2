"""Produce progress with XTuner's ProduceProgress meaning, kept in Redis.

The cumulative counters live in rs:{run}:progress (``{task}:{counter}``), where
the buffer operations update them in the same transaction as the entries they
count; the steps live in rs:{run}:state. ``state_dict()`` snapshots them for a
checkpoint; ``load_state_dict()`` puts them back after a restart and never moves a
count backwards (a Redis that kept running has newer counts than the checkpoint).
"""

from __future__ import annotations

from typing import Any

import redis

from shared.allocation import allocate_batch_sizes
from shared.keys import MODEL_STEP, TRAIN_STEP, Keys, progress_field
from shared.settings import Settings
from shared.streams import stored_float, stored_int, stored_step

COUNTERS = (
    "fed", "completed", "consumed", "filtered", "aborted", "expired", "expired_dropped", "dead",
    "produced_samples", "produced_tokens", "reward_count", "reward_sum",
)  # fmt: skip


class ProduceProgress:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client = client
        self.keys = Keys(settings.run)
        self.tasks = [t.name for t in settings.tasks]
        self.quota = allocate_batch_sizes(
            settings.rollout.batch_size, {t.name: t.weight for t in settings.tasks}
        )

    def counts(self, task: str) -> dict[str, float]:
        """The task's counters; CorruptValueError names one that holds something else."""
        names = [progress_field(task, c) for c in COUNTERS]
        values: list[Any] = self.client.hmget(self.keys.progress, names)
        key = self.keys.progress
        return {
            c: stored_float(v, key, name) if c == "reward_sum" else stored_int(v, key, name, "a count")
            for c, name, v in zip(COUNTERS, names, values, strict=True)
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
            for counter in COUNTERS:
                saved = counts.get(counter, 0)
                if saved > now[counter]:
                    self.client.hset(self.keys.progress, progress_field(task, counter), saved)
        current_train, current_model = self._steps()
        train_step = max(current_train, int(state["next_consumer_step"]) - 1)
        model_step = max(current_model, int(state.get("model_step", 0)))
        self.client.hset(self.keys.state, mapping={TRAIN_STEP: train_step, MODEL_STEP: model_step})
