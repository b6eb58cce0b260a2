"""Evaluation while training: every few train steps, eval batches of held-out prompts
through the batch coordinator, on the weights of that step.

Producers serve eval prompts before any training work and outside the admission
bound, so an eval batch costs the trainer the time its prompts take to generate, not
a place in the queue. Before submitting, the evaluator waits until every live
producer runs on the step's weights (``wait_for_producers``): the results are those of
step t, not of whatever the engines held a moment earlier.

Each eval is one or more named batches (``EvalSet``): typically the held-out prompts
sampled as in training (``mean@k`` of the reward over the n samples of each prompt)
and the same prompts decoded greedily (the task's prompts carry what makes them so:
see ``GREEDY``). The metrics are the coordinator's (``consumer.metrics.eval_metrics``:
``eval/{name}/score/mean@k``, ``std@k``, ``best@n``, ``worst@n``,
``eval/{name}/finished_task_count``) under the set's name, whatever the batch id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rollstream.consumer.coordinator import BatchCoordinator
from rollstream.consumer.weights import SyncTimeout, wait_for_producers
from rollstream.shared.events import RunControl
from rollstream.shared.records import Prompt

log = logging.getLogger(__name__)

# meta of a prompt a producer generates at temperature 0 (greedy decoding)
GREEDY: Mapping[str, Any] = {"sampling": {"temperature": 0.0}}


@dataclass(frozen=True, slots=True)
class EvalSet:
    """Prompts evaluated together under ``name`` (letters, digits, '_', '-')."""

    name: str
    prompts: Sequence[Prompt]

    def greedy(self, name: str, **meta: Any) -> EvalSet:
        """The same prompts decoded greedily, with ``meta`` added to each (what the judge
        needs to score them as accuracy, say)."""
        return EvalSet(name, [replace(p, meta={**p.meta, **GREEDY, **meta}) for p in self.prompts])


class Evaluator:
    """Runs ``sets`` through ``coordinator`` every ``every`` train steps (0: never)."""

    def __init__(
        self,
        coordinator: BatchCoordinator,
        sets: Sequence[EvalSet],
        every: int,
        timeout_s: float = 300.0,
        sync_timeout_s: float = 60.0,
    ) -> None:
        self.coordinator = coordinator
        self.sets = list(sets)
        self.every = every
        self.timeout_s = timeout_s
        self.sync_timeout_s = sync_timeout_s

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def __call__(self, step: int, control: RunControl) -> dict[str, float]:
        """The metrics of every set at train step ``step`` (whose weights are published),
        with ``eval/seconds``: how long the evaluation held the trainer."""
        started = time.monotonic()
        try:
            wait_for_producers(control, step, self.sync_timeout_s)
        except SyncTimeout as exc:  # evaluate all the same; say on which weights it may be
            log.warning("eval at step %d: %s", step, exc)
        batches = {}
        for s in self.sets:
            batch_id = f"{s.name}.{step}"
            self.coordinator.submit_batch(batch_id, list(s.prompts), kind="eval")
            batches[s.name] = batch_id
        metrics: dict[str, float] = {}
        for name, batch_id in batches.items():
            result = self.coordinator.finalize_eval_batch(batch_id, timeout=self.timeout_s)
            prefix = f"eval/{batch_id}/"
            for key, value in result["metrics"].items():
                metrics[f"eval/{name}/{key.removeprefix(prefix)}"] = float(value)
        metrics["eval/seconds"] = time.monotonic() - started
        return metrics
