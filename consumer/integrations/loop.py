"""rollstream for any PyTorch loop: an iterable of train batches, committed explicitly.

    stream = create_batch_stream(settings)        # consumer/assembly.py builds this
    for batch in stream:                          # a TrainBatch of step stream.step
        loss = my_loss(model, batch.groups)
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        stream.commit()                           # after the optimizer step: acked + deleted
        stream.publish_weights(model)             # the engines generate with these next

The stream starts at the run's last committed train step + 1 (a restarted loop re-reads
the groups it held uncommitted first, under the same consumer name) and hands out one
batch a step: each task's quota of groups, the too-stale ones expired on the way
(consumer/batches.py). Asking for the next batch before ``commit()`` is an error: a
batch is committed once, after the step that used it, or not at all (a loop that
stops without committing leaves its groups to its restart). ``dataset()`` wraps the
stream as a ``torch.utils.data.IterableDataset`` for a DataLoader (``batch_size=None``,
``num_workers=0``: the batches are the stream's, read in the loop's process).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from rollstream.consumer.batches import BatchReader, TrainBatch
from rollstream.consumer.weights import WeightPublisher
from rollstream.shared.errors import BatchTimeout, IntegrationError

__all__ = ["BatchStream"]


class BatchStream:
    """Train batches of the run, one a step, each committed by the loop."""

    def __init__(
        self,
        reader: BatchReader,
        publisher: WeightPublisher,
        *,
        steps: int | None = None,
        stop: threading.Event | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.reader = reader
        self.publisher = publisher
        self.steps = steps  # batches to hand out; None: until ``stop`` is set
        self.stop = stop or threading.Event()
        self.poll_s = poll_s
        self.batch: TrainBatch | None = None  # handed out, not committed yet
        self.step = reader.control.train_step()  # the last committed step
        self.handed = 0

    def __iter__(self) -> Iterator[TrainBatch]:
        while self.steps is None or self.handed < self.steps:
            batch = self.next_batch()
            if batch is None:
                return
            yield batch

    def next_batch(self) -> TrainBatch | None:
        """The batch of the next step, waiting for it; None once ``stop`` is set."""
        if self.batch is not None:
            raise IntegrationError(
                f"the batch of step {self.batch.train_step} is not committed: call commit() after its "
                "optimizer step, before asking for the next"
            )
        step = self.step + 1
        full = self.reader.plan.batch_size
        while not self.stop.is_set():
            try:
                self.batch = self.reader.get_batch(step, timeout_s=self.poll_s, min_wait_num=full)
            except BatchTimeout:
                continue  # what was read stays with the reader
            self.handed += 1
            return self.batch
        return None

    def commit(self) -> int:
        """Ack and delete the batch handed out, after the optimizer step that used it, and
        record its step as the run's train_step; returns that step."""
        batch = self.batch
        if batch is None:
            raise IntegrationError("nothing to commit: no batch handed out since the last commit")
        batch.commit()
        self.batch = None
        self.step = batch.train_step
        return self.step

    def publish_weights(self, model: Any) -> int:
        """Send ``model``'s weights to the engines through the run's transport and publish
        them as a model step: the last committed step, or one above the run's model_step
        when that is there already (a restart). Returns the step published."""
        step = max(self.step, self.reader.control.model_step() + 1)
        published, _ = self.publisher.publish(model, step)
        return published

    def close(self) -> None:
        """Stop refreshing what the reader holds (its groups become reclaimable)."""
        self.stop.set()
        self.reader.close()
        self.publisher.close()

    def dataset(self) -> Any:
        """This stream as a ``torch.utils.data.IterableDataset`` (DataLoader with
        ``batch_size=None``, ``num_workers=0``)."""
        from torch.utils.data import IterableDataset

        stream = self

        class BatchDataset(IterableDataset):  # type: ignore[type-arg]
            def __iter__(self) -> Iterator[TrainBatch]:
                return iter(stream)

        return BatchDataset()
