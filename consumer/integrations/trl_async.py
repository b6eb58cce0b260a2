"""rollstream for TRL's AsyncGRPOTrainer (``trl.experimental.async_grpo``, TRL >= 1.16, < 1.17):
its ``RolloutWorkerProtocol`` over the groups stream and its ``WeightTransferProtocol``
over rollstream's weight transports and weight-sync events.

    worker, transfer = create_async_grpo(settings, max_staleness=config.max_staleness)
    trainer = AsyncGRPOTrainer(model, args=config, train_dataset=prompts,
                               rollout_worker=worker, weight_transfer=transfer)

The producers choose the prompts (the run's feeder or ``rollstream feed``) and run ahead
within the admission bound; the worker reads the groups as the reference trainer does
(consumer/batches.py: the too-stale expired on the way) and puts each sample in
``rollout_buffer`` as a ``RolloutSample``: prompt + response ids, the engine's logprobs,
the group's GRPO advantage (as TRL's own worker computes it from the judge's scores)
and the policy version TRL counts, the group's model step less the offset between the
two counts (TRL bumps its version once per weight sync; each sync here publishes the
next model step).

TRL drops a sample staler than its ``max_staleness`` when it takes it from the queue.
The worker knows TRL's version at that moment (the queue's ``get`` runs in the loop that
reads it), so it takes such a sample out first: a group none of whose samples went to
the trainer is expired (its prompt produced again), one whose first samples went is
committed with them. A group is committed (acked, deleted, the run's train_step moved)
once its last sample was taken ``commit_lag`` weight syncs ago: TRL's loader and batcher
take a micro-batch or two ahead of the step that trains it, so by then the steps that
used it are done. What the worker read and had not committed at a stop stays pending:
a restart under the same consumer name trains it (again, if it was trained before the
stop: nothing committed is ever handed out twice).

The weight transfer sends what TRL streams (``send_weights``) through the run's
transport and publishes it as the next model step; producers follow as the run's
``on_weight_sync`` says. ``pause`` and ``resume`` are the producers' own affair;
``resume`` waits for them to be on the new step when ``wait_s`` > 0.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollstream.consumer.batches import BatchReader
from rollstream.consumer.integrations.trl import check_trl
from rollstream.consumer.weights import SyncTimeout, WeightPublisher, wait_for_producers
from rollstream.shared.buffer_types import Batch, BatchItem
from rollstream.shared.errors import BatchTimeout, IntegrationError
from rollstream.shared.records import Group

__all__ = ["AsyncPlan", "RolloutWorker", "WeightTransfer", "rollout_samples"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AsyncPlan:
    """The numbers the worker goes by."""

    max_staleness: int  # TRL's AsyncGRPOConfig.max_staleness: staler samples are not handed to it
    queue_size: int = 0  # samples in rollout_buffer at most (0: no bound but the admission's)
    commit_lag: int = 2  # weight syncs between a group's last sample taken and its commit
    poll_s: float = 0.5  # the longest wait of one read, between looks at stop


@dataclass(slots=True)
class _Held:
    item: BatchItem
    size: int  # samples put in the queue
    given: int = 0  # taken by the trainer
    skipped: int = 0  # taken out as too stale for it
    done_at: int | None = None  # the weight syncs counted when its last sample was taken


class _Buffer(queue.Queue):  # type: ignore[type-arg]
    """rollout_buffer: a queue whose ``get`` tells the worker what the trainer took."""

    def __init__(self, worker: RolloutWorker, maxsize: int) -> None:
        super().__init__(maxsize)
        self.worker = worker

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        while True:
            sample = super().get(block, timeout)
            if self.worker.taken(sample):
                return sample


class RolloutWorker:
    """TRL's RolloutWorkerProtocol over the run's groups stream."""

    def __init__(self, reader: BatchReader, plan: AsyncPlan) -> None:
        check_trl()
        self.reader = reader
        self.control = reader.control
        self.plan = plan
        self.rollout_buffer: queue.Queue[Any] = _Buffer(self, plan.queue_size)
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=4096)
        self.version = 0  # TRL's policy version, as update_model_version says
        self.offset = 0  # the run's model_step less TRL's version
        self.syncs = 0
        self.committed = 0  # groups committed
        self.expired = 0  # groups expired as too stale for the trainer when it took them
        self.handed: deque[str] = deque(maxlen=4096)  # the groups' stream ids, in the order handed
        self._held: dict[int, _Held] = {}
        self._numbers = iter(range(1, 2**62))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._beat = time.time()

    # --- the protocol ------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._beat = time.time()
        self._thread = threading.Thread(target=self._run, name="rollstream-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.reader.close()  # what was not committed is reclaimable, and re-read by a restart

    def update_model_version(self, model_version: int) -> None:
        """After each weight sync: the new version, and the groups whose steps are done committed."""
        self.version = model_version
        self.offset = self.control.model_step() - model_version
        self.syncs += 1
        with self._lock:
            due = [
                n
                for n, h in self._held.items()
                if h.done_at is not None and h.done_at <= self.syncs - self.plan.commit_lag
            ]
            items = [self._held.pop(n).item for n in due]
        self._commit(items)

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise IntegrationError(f"rollstream's rollout worker failed: {self._error!r}") from self._error
        age = time.time() - self._beat
        if self._thread is not None and age > stale_after_s:
            raise IntegrationError(
                f"rollstream's rollout worker has not looked at the stream for {age:.0f} s"
            )

    # --- what the trainer took ---------------------------------------------------------

    def taken(self, sample: Any) -> bool:
        """The trainer took ``sample`` from the queue: False when it is staler than TRL
        allows (TRL would drop it; the worker takes it out instead)."""
        stale = self.version - int(sample.model_version) > self.plan.max_staleness
        with self._lock:
            held = self._held[int(sample.group_id)]
            if stale:
                held.skipped += 1
            else:
                held.given += 1
            if held.given + held.skipped < held.size:
                return not stale
            if held.given:
                held.done_at = self.syncs
                return not stale
            del self._held[int(sample.group_id)]
        self._expire(held.item)
        return False

    # --- the reading thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._beat = time.time()
                step = self.control.model_step() + 1
                try:
                    batch = self.reader.get_batch(step, timeout_s=self.plan.poll_s, min_wait_num=1)
                except BatchTimeout:
                    continue
                for item in sorted((i for b in batch.batches.values() for i in b.items), key=_age):
                    self._hand(item)
        except BaseException as exc:
            log.exception("rollstream's rollout worker failed")
            self._error = exc

    def _hand(self, item: BatchItem) -> None:
        number = next(self._numbers)
        samples = rollout_samples(item.group, number, item.group.model_step - self.offset)
        with self._lock:
            self._held[number] = _Held(item, len(samples))
        self.handed.append(item.entry.id)
        for sample in samples:
            while not self._stop.is_set():
                self._beat = time.time()
                try:
                    self.rollout_buffer.put(sample, timeout=self.plan.poll_s)
                    break
                except queue.Full:
                    continue
        self._push_metrics(item.group)

    def _commit(self, items: list[BatchItem]) -> None:
        if not items:
            return
        step = self.control.model_step()
        for task in {i.entry.task for i in items}:
            self.reader.buffer.commit(Batch(task, [i for i in items if i.entry.task == task]), step)
        self.control.advance_train_step(step)
        self.committed += len(items)

    def _expire(self, item: BatchItem) -> None:
        step = self.control.model_step() + 1
        if self.reader.plan.drop_expired:
            self.reader.buffer.discard(item, train_step=step)
        else:
            self.reader.buffer.expire(item, train_step=step)
        self.expired += 1

    def _push_metrics(self, group: Group) -> None:
        scores = [s.score for s in group.samples if s.score is not None]
        figures = {"rollstream/groups_read": 1.0, "rollstream/group_model_step": float(group.model_step)}
        if scores:
            figures["rollstream/reward_mean"] = float(np.mean(scores))
        with contextlib.suppress(queue.Full):  # a trainer that does not drain it never blocks the reading
            self.metrics_queue.put_nowait(figures)


def _age(item: BatchItem) -> int:
    return item.group.model_step


def rollout_samples(group: Group, number: int, version: int) -> list[Any]:
    """A group as TRL's RolloutSamples: prompt + response ids, the response's loss mask and
    logprobs (zeros over the prompt), the GRPO advantage of each sample's score within the
    group, (r - mean) / (std + 1e-8) as TRL's own worker computes it (0 for a sample the
    judge gave no score), TRL's policy ``version`` and the group's ``number``."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    rewards = np.array([np.nan if s.score is None else s.score for s in group.samples], dtype=float)
    scored = ~np.isnan(rewards)
    advantages = np.zeros_like(rewards)
    if scored.any():
        advantages[scored] = (rewards[scored] - rewards[scored].mean()) / (rewards[scored].std() + 1e-8)
    reward_std = float(rewards[scored].std()) if scored.any() else float("nan")
    prompt = group.prompt.prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    out = []
    for sample, advantage, reward in zip(group.samples, advantages, rewards, strict=True):
        p, r = len(sample.prompt_ids), len(sample.response_ids)
        if r == 0 or len(sample.logprobs) != r or not np.isfinite(sample.logprobs).all():
            raise IntegrationError(
                f"group {group.group_id}: a sample with {r} response tokens and {len(sample.logprobs)} "
                "finite logprobs; TRL's loss needs the engine's logprob of every response token"
            )
        mask = np.ones(r, dtype=np.int64) if sample.loss_mask is None else sample.loss_mask.astype(np.int64)
        out.append(
            RolloutSample(
                prompt=messages,
                completion=[{"role": "assistant", "content": sample.text}],
                input_ids=np.concatenate([sample.prompt_ids, sample.response_ids]).astype(np.int64),
                completion_mask=np.concatenate([np.zeros(p, dtype=np.int64), mask]),
                old_log_probs=np.concatenate([np.zeros(p, dtype=np.float32), sample.logprobs]).astype(
                    np.float32
                ),
                advantage=float(advantage),
                model_version=version,
                group_id=number,
                metrics={"reward": float(reward), "reward_std": reward_std},
                enqueued_at=time.time(),
            )
        )
    return out


@dataclass(slots=True)
class WeightTransfer:
    """TRL's WeightTransferProtocol over rollstream's weight transports and events."""

    publisher: WeightPublisher
    wait_s: float = 0.0  # resume waits this long for producers to be on the new step (0: no wait)
    published: list[int] = field(default_factory=list)  # the model steps sent

    def init_weight_transfer(self) -> None:
        check_trl()

    def pause(self) -> None:
        """Producers pause (or drain, or go on in place) by themselves when they follow a sync."""

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        step, uri = self.publisher.publish_tensors(dict(iterator))
        self.published.append(step)
        log.info("rollstream: weights of model step %d at %s", step, uri)

    def resume(self) -> None:
        if self.wait_s > 0 and self.published:
            try:
                wait_for_producers(self.publisher.control, self.published[-1], self.wait_s)
            except SyncTimeout as exc:
                log.warning("rollstream: %s", exc)

    def destroy(self) -> None:
        self.publisher.close()
