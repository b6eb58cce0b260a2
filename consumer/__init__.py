"""What a trainer uses from rollstream: read batches, commit them after the optimizer
step, publish weights, and the batch-level coordinator. The stream format underneath is
docs/stream-format.md; a trainer in another language follows that instead.

    from consumer import BatchReader, publish_weights

    reader = BatchReader(client, settings)
    batch = reader.get_batch(step)          # this step's groups, stale ones expired
    ...                                     # the optimizer step
    batch.commit()                          # ack + delete, then train_step = step
    publish_weights(reader.control, step, uri)
"""

from consumer.batches import BatchReader, TrainBatch
from consumer.coordinator import BatchCoordinator
from consumer.weights import SyncTimeout, publish_weights, wait_for_producers

__all__ = [
    "BatchCoordinator",
    "BatchReader",
    "SyncTimeout",
    "TrainBatch",
    "publish_weights",
    "wait_for_producers",
]
