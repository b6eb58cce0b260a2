"""What a trainer uses from rollstream: read batches, commit them after the optimizer
step, publish weights, and the batch-level coordinator; with the records, settings and
errors that appear in those signatures, so that a trainer imports from here only. The
stream format underneath is docs/stream-format.md; a trainer in another language
follows that instead.

    from rollstream.consumer import create_reader, load_settings, publish_weights

    settings = load_settings()              # ROLLSTREAM_* variables, rollstream.toml
    reader = create_reader(settings)        # a BatchReader, connected to redis.url
    batch = reader.get_batch(step)          # this step's groups, stale ones expired
    ...                                     # the optimizer step
    batch.commit()                          # ack + delete, then train_step = step
    publish_weights(reader.control, step, uri)

``create_reader``, ``create_coordinator``, ``connect`` and ``control_for`` are the
doors that read the settings (consumer/assembly.py, the consumer side's composition
root); the classes behind them take their parts. A trainer without a BatchReader
publishes through ``control_for(client, settings)``.
Its per-step learning figures go to TensorBoard or W&B as the reference trainer's do:
``open_loggers("tensorboard", logdir).log(step, step_figures(...))``.

A trainer people already use reads from rollstream through its own extension point
(consumer/integrations/, docs/integrations.md): ``create_trl_rollout`` for TRL's GRPOTrainer
(with ``rollstream_reward``), ``create_async_grpo`` for TRL's AsyncGRPOTrainer,
``create_batch_stream`` for any PyTorch loop.
"""

from rollstream.consumer.assembly import (
    Settings,
    connect,
    control_for,
    create_async_grpo,
    create_batch_stream,
    create_coordinator,
    create_reader,
    create_trl_rollout,
    load_settings,
)
from rollstream.consumer.batches import BatchReader, TrainBatch
from rollstream.consumer.coordinator import BatchCoordinator
from rollstream.consumer.integrations.loop import BatchStream
from rollstream.consumer.integrations.trl import TrlRollout, rollstream_reward
from rollstream.consumer.integrations.trl_async import RolloutWorker, WeightTransfer
from rollstream.consumer.tracking import Loggers, StepLogger, open_loggers, step_figures
from rollstream.consumer.weights import SyncTimeout, WeightPublisher, publish_weights, wait_for_producers
from rollstream.shared.buffer_types import Batch
from rollstream.shared.errors import BatchTimeout
from rollstream.shared.events import RunControl
from rollstream.shared.records import Group, Prompt, Sample

__all__ = [
    "Batch",
    "BatchCoordinator",
    "BatchReader",
    "BatchStream",
    "BatchTimeout",
    "Group",
    "Loggers",
    "Prompt",
    "RolloutWorker",
    "RunControl",
    "Sample",
    "Settings",
    "StepLogger",
    "SyncTimeout",
    "TrainBatch",
    "TrlRollout",
    "WeightPublisher",
    "WeightTransfer",
    "connect",
    "control_for",
    "create_async_grpo",
    "create_batch_stream",
    "create_coordinator",
    "create_reader",
    "create_trl_rollout",
    "load_settings",
    "open_loggers",
    "publish_weights",
    "rollstream_reward",
    "step_figures",
    "wait_for_producers",
]
