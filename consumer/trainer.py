"""The reference trainer: what a real trainer does with consumer/, and the trainer of
the demo. Its loop reads like slime's train.py: read the step's batch, train, commit,
publish the weights, and every few steps evaluate on held-out prompts
(consumer.evaluation). The training is a real policy-optimisation step of an hf model
(consumer.pg.PolicyGradient) or, without one, a configurable step time.

It takes its reader and the numbers it uses; consumer/assembly.py's ``create_trainer``
builds one from the settings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from rollstream.consumer.batches import BatchReader, TrainBatch
from rollstream.consumer.evaluation import Evaluator
from rollstream.consumer.pg import PolicyGradient
from rollstream.consumer.tracking import step_figures
from rollstream.consumer.weights import publish_weights
from rollstream.shared import telemetry
from rollstream.shared.errors import BatchTimeout

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepLog:
    step: int
    groups: int
    staleness: dict[int, int]
    reward_mean: float | None
    expired: int
    wait_s: float
    train_s: float
    eval: dict[str, float] = field(default_factory=dict)  # the evaluator's metrics at this step
    # the step's learning figures under the trackers' names (consumer.tracking.step_figures)
    figures: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class TrainLog:
    steps: list[StepLog] = field(default_factory=list)

    @property
    def staleness(self) -> Counter[int]:
        total: Counter[int] = Counter()
        for step in self.steps:
            total.update(step.staleness)
        return total


class ReferenceTrainer:
    def __init__(
        self,
        reader: BatchReader,
        sync_weights_interval: int,
        step_time_s: float = 0.5,
        policy: PolicyGradient | None = None,
        evaluator: Evaluator | None = None,
    ) -> None:
        self.reader = reader  # its plan's batch_size is a full batch
        self.sync_weights_interval = sync_weights_interval  # rollout.sync_weights_interval
        self.step_time_s = step_time_s
        self.policy = policy  # a real update of an hf model, else a step of step_time_s
        self.evaluator = evaluator  # eval batches every evaluator.every steps, on synced weights
        # called with (step, batch) after the optimizer step and before the commit, and
        # with (step, None) once the commit is done: an independent record of training
        self.on_commit: Callable[[int, TrainBatch | None], None] | None = None
        # (model_step, uri, event id) of this trainer's last weight sync: see _publish_lost_sync
        self._published: tuple[int, str | None, str] | None = None
        # set by a cold stop (run's ``cold``): the step in training ends now, uncommitted
        self._cold = threading.Event()

    def run(
        self,
        steps: int,
        on_step: Callable[[StepLog], None] | None = None,
        stop: threading.Event | None = None,
        cold: threading.Event | None = None,
    ) -> TrainLog:
        """Train ``steps`` steps. ``stop`` is a warm stop: the step in training finishes and
        is committed, and no other starts. ``cold`` (set with or after ``stop``, by a second
        SIGTERM) stops at once: the step in training is cut short (a configured step time)
        or its update thrown away (a policy's, once it returns), and it is not committed;
        its groups stay pending for this consumer, so that the trainer's restart under the
        same name re-reads them and trains that step number again, as after a kill."""
        if cold is not None:
            self._cold = cold
        try:
            return self._run(steps, on_step, stop)
        finally:
            self.reader.close()  # what stays uncommitted is reclaimable again

    def _run(
        self, steps: int, on_step: Callable[[StepLog], None] | None, stop: threading.Event | None
    ) -> TrainLog:
        done = TrainLog()
        # train_step is the last committed step: a trainer stopped (or killed) before its
        # commit redoes that step number with the groups it had read, never skips it
        first = self.reader.control.train_step() + 1
        interval = self.sync_weights_interval
        self._publish_missed_sync(first - 1, interval)
        for step in range(first, first + steps):
            if stop is not None and stop.is_set():
                break  # between steps: nothing half-committed
            batch = self._next_batch(step, stop)
            if batch is None:
                break
            train_s = self.train(batch)
            if self._cold.is_set():
                log.warning(
                    "trainer: cold stop in step %d: not committed; its %d groups stay pending for "
                    "consumer %s, whose restart trains step %d with them", step, len(batch),
                    self.reader.buffer.consumer, step,
                )  # fmt: skip
                break
            if self.on_commit is not None:
                self.on_commit(step, batch)
            batch.commit()
            if self.on_commit is not None:
                self.on_commit(step, None)
            synced = step % interval == 0
            if synced:
                uri = self.policy.save(step) if self.policy is not None else None
                self._published = (step, uri, publish_weights(self.reader.control, step, uri))
            entry = self.log_step(step, batch, train_s)
            figures = dict(self.policy.metrics) if self.policy is not None else {}
            telemetry.train_step(
                step, train_s, batch.wait_s, {task: len(b) for task, b in batch.batches.items()},
                batch.staleness, batch.expired, {**figures, "reward_mean": entry.reward_mean},
            )  # fmt: skip
            scores = [s.score for g in batch.groups for s in g.samples if s.score is not None]
            entry.figures = step_figures(
                train_s, batch.wait_s, len(batch), scores, batch.staleness, batch.expired, figures
            )
            if synced and self.evaluator is not None and self.evaluator.due(step):
                if self._cold.is_set():
                    log.warning("trainer: cold stop: the eval of step %d is skipped", step)
                else:
                    entry.eval = self.evaluator(step, self.reader.control)
            done.steps.append(entry)
            if on_step:
                on_step(entry)
        return done

    def _publish_missed_sync(self, committed: int, interval: int) -> None:
        """A trainer that died between a commit and its weight sync left model_step one sync
        behind: producers would stay on old weights, and with max_staleness 0 admit nothing
        the trainer can take. Publish that sync now."""
        last_sync = committed - committed % interval
        if last_sync > self.reader.control.model_step():
            uri = self.policy.save(last_sync) if self.policy is not None else None
            self._published = (last_sync, uri, publish_weights(self.reader.control, last_sync, uri))

    def _next_batch(self, step: int, stop: threading.Event | None) -> TrainBatch | None:
        """The full batch of ``step``, or None once ``stop`` is set while waiting for it."""
        full = self.reader.plan.batch_size
        while stop is None or not stop.is_set():
            try:
                return self.reader.get_batch(step, timeout_s=1.0, min_wait_num=full)
            except BatchTimeout:
                self.reader.check_rewind()  # Redis lost a commit of this trainer's: put back, or stop
                self._publish_lost_sync()
                continue  # what was read stays with the reader; look at stop, wait on
        return None

    def _publish_lost_sync(self) -> None:
        """While it waits for a batch: a weight sync this trainer published that Redis no
        longer holds (a failover to a replica that had not got it, or a crash within the
        append-only file's fsync second) leaves model_step behind the weights trained, and
        producers that start now, or had not followed the event yet, on the older step:
        with max_staleness 0 they admit nothing the trainer can take. Publish it again.
        A model_step an operator set lower (`rollstream steps --model-step`) leaves the
        event in the stream, and is left alone."""
        if self._published is None:
            return
        step, uri, event = self._published
        control = self.reader.control
        if control.model_step() >= step or control.client.xrange(control.keys.events, event, event):
            return
        log.warning(
            "trainer: Redis lost the weight sync of step %d (a failover or a crash took its last "
            "writes): publishing it again", step,
        )  # fmt: skip
        self._published = (step, uri, publish_weights(control, step, uri))

    def train(self, batch: TrainBatch) -> float:
        """One optimizer step on the batch: the policy's, or the configured duration (which
        a cold stop cuts short)."""
        started = time.monotonic()
        if self.policy is not None:
            self.policy(batch)
        else:
            self._cold.wait(self.step_time_s)
        return time.monotonic() - started

    @staticmethod
    def log_step(step: int, batch: TrainBatch, train_s: float) -> StepLog:
        scores = [s.score for g in batch.groups for s in g.samples if s.score is not None]
        return StepLog(
            step=step,
            groups=len(batch),
            staleness=dict(batch.staleness),
            reward_mean=sum(scores) / len(scores) if scores else None,
            expired=batch.expired,
            wait_s=batch.wait_s,
            train_s=train_s,
        )
