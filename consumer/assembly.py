"""The consumer side's composition root: the one module under consumer/ that reads the
whole settings tree. It builds the parts (the replay buffer, the run's control, the
quota, the policy) and hands each what it uses, a settings section or a frozen plan of
plain values; BatchReader, ReferenceTrainer, Archiver and BatchCoordinator never see
the tree.

The doors a trainer uses, as arq's ``create_worker`` builds a worker from its settings:

    reader = create_reader()                         # load_settings(), connect: a BatchReader
    reader = create_reader(settings, client=client)  # a tree and a client of the caller's
    control = control_for(connect(settings), settings)

the doors of the outside trainers' adapters (consumer/integrations/, docs/integrations.md):
``create_trl_rollout`` (TRL's GRPOTrainer), ``create_async_grpo`` (TRL's AsyncGRPOTrainer),
``create_batch_stream`` (any PyTorch loop);
and those of the reference processes (`rollstream train`, `rollstream archive`, the demo,
the recipes): ``create_trainer``, ``create_coordinator``, ``create_archiver``,
``run_archiver``, ``create_policy``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import redis

from rollstream.consumer.archive import ARCHIVER_CONSUMER, ArchivePlan, Archiver, archive_run
from rollstream.consumer.batches import BatchReader, ReaderPlan
from rollstream.consumer.coordinator import LEASE_S, BatchCoordinator
from rollstream.consumer.evaluation import Evaluator
from rollstream.consumer.integrations.loop import BatchStream
from rollstream.consumer.integrations.trl import RolloutPlan, TrlRollout
from rollstream.consumer.integrations.trl_async import AsyncPlan, RolloutWorker, WeightTransfer
from rollstream.consumer.pg import PolicyGradient
from rollstream.consumer.trainer import ReferenceTrainer
from rollstream.consumer.weights import WeightPublisher
from rollstream.shared import connection
from rollstream.shared.events import RunControl
from rollstream.shared.keys import TRAINER_CONSUMER, Keys
from rollstream.shared.records import Prompt
from rollstream.shared.runconfig import open_buffer, task_quota
from rollstream.shared.settings import Settings, load_settings
from rollstream.shared.transports import default_dir

__all__ = [
    "Settings",
    "archive_plan",
    "connect",
    "control_for",
    "create_archiver",
    "create_async_grpo",
    "create_batch_stream",
    "create_coordinator",
    "create_policy",
    "create_reader",
    "create_trainer",
    "create_trl_rollout",
    "load_settings",
    "reader_plan",
    "run_archiver",
    "weight_publisher",
]


def connect(settings: Settings) -> redis.Redis:
    """A client for the run's Redis (``redis.url``) as rollstream's own processes use
    it: checked once, riding out outages up to ``redis.outage_limit_s``, replies as
    bytes (the stream's payloads are binary)."""
    return connection.connect(settings.redis)


def control_for(client: redis.Redis, settings: Settings) -> RunControl:
    """The run's control handle (its state and events) for ``publish_weights`` and
    ``wait_for_producers``; BatchReader has one as ``reader.control``."""
    return RunControl(client, Keys(settings.run))


def reader_plan(settings: Settings) -> ReaderPlan:
    """What a BatchReader reads by, from the tree: the tasks' quotas, the batch size, the
    staleness bound, the tail-batch mode, the keeper's cadence, the replicas to wait for."""
    rollout = settings.rollout
    return ReaderPlan(
        quota=task_quota(settings),
        batch_size=rollout.batch_size,
        stale_threshold=rollout.stale_threshold,
        drop_expired=rollout.tail_batch_trigger_size == -1,
        claim_idle_ms=settings.buffer.claim_idle_ms,
        redis=settings.redis,
    )


def _settings_and_client(
    settings: Settings | None, client: redis.Redis | None
) -> tuple[Settings, redis.Redis]:
    settings = load_settings() if settings is None else settings
    return settings, connect(settings) if client is None else client


def create_reader(
    settings: Settings | None = None, *, client: redis.Redis | None = None, consumer: str = TRAINER_CONSUMER
) -> BatchReader:
    """The trainer's BatchReader of the run: ``settings`` loaded (ROLLSTREAM_* variables,
    rollstream.toml) when None, a client connected to ``redis.url`` when none is given.
    ``consumer`` is the reader's stable name: a restarted trainer re-reads its own
    uncommitted groups under it."""
    settings, client = _settings_and_client(settings, client)
    buffer = open_buffer(client, settings, consumer)
    return BatchReader(buffer, RunControl(client, buffer.keys), reader_plan(settings))


def create_trainer(
    settings: Settings | None = None,
    *,
    client: redis.Redis | None = None,
    consumer: str = TRAINER_CONSUMER,
    step_time_s: float = 0.5,
    policy: PolicyGradient | None = None,
    evaluator: Evaluator | None = None,
) -> ReferenceTrainer:
    """The reference trainer: its reader as ``create_reader`` builds it, weight syncs every
    ``rollout.sync_weights_interval`` steps; ``policy`` (``create_policy``) trains an hf
    model, else a step takes ``step_time_s``."""
    settings, client = _settings_and_client(settings, client)
    reader = create_reader(settings, client=client, consumer=consumer)
    return ReferenceTrainer(
        reader, settings.rollout.sync_weights_interval, step_time_s, policy=policy, evaluator=evaluator
    )


def create_coordinator(
    settings: Settings | None = None,
    *,
    client: redis.Redis | None = None,
    consumer: str = "coordinator",
    lease_s: float = LEASE_S,
) -> BatchCoordinator:
    """The batch coordinator of the run, reading under ``consumer``, its finalizers' lease
    ``lease_s``."""
    settings, client = _settings_and_client(settings, client)
    buffer = open_buffer(client, settings, consumer)
    return BatchCoordinator(buffer, [t.name for t in settings.tasks], lease_s)


def create_policy(settings: Settings, hf_model: str, weights_dir: str, lr: float = 1e-5) -> PolicyGradient:
    """The reference trainer's policy-optimisation step of ``hf_model`` on the device of
    ``engines.hf``, with the loss of ``algorithm`` and the weight transport of ``weights``,
    saving under ``weights_dir``."""
    return PolicyGradient(
        hf_model, weights_dir, lr=lr, device=settings.engines.hf.device, algorithm=settings.algorithm,
        weights=settings.weights, run=settings.run,
    )  # fmt: skip


def archive_plan(settings: Settings) -> ArchivePlan:
    """What the archiver and its loop use, from the tree."""
    return ArchivePlan(
        run=settings.run,
        tasks=tuple(t.name for t in settings.tasks),
        archive=settings.archive,
        dead_maxlen=settings.buffer.dead_maxlen,
        filtered_maxlen=settings.buffer.filtered_maxlen,
        block_ms=settings.buffer.block_ms,
        progress_s=settings.process.progress_s,
        stop_timeout_s=settings.process.stop_timeout_s,
    )


def create_archiver(
    settings: Settings | None = None, *, client: redis.Redis | None = None, consumer: str = ARCHIVER_CONSUMER
) -> Archiver:
    """The run's archiver (``archive.dir``, ``archive.keep``), reading under ``consumer``."""
    settings, client = _settings_and_client(settings, client)
    return Archiver(client, archive_plan(settings), consumer)


def run_archiver(
    settings: Settings,
    stop: threading.Event,
    *,
    client: redis.Redis | None = None,
    consumer: str = ARCHIVER_CONSUMER,
    on_start: Callable[[Archiver], None] | None = None,
) -> Archiver:
    """``rollstream archive``'s loop (consumer/archive.py ``archive_run``) until ``stop``."""
    settings, client = _settings_and_client(settings, client)
    return archive_run(client, archive_plan(settings), stop, consumer, on_start)


def weight_publisher(
    settings: Settings, client: redis.Redis, weights_dir: str | None = None
) -> WeightPublisher:
    """A torch model's weights to the run's engines through ``weights.*``; the file
    transport writes under ``weights.dir``, else ``weights_dir``, else the run's directory
    on /dev/shm (or ./weights/<run> where there is none)."""
    root = weights_dir or default_dir(settings.run) or f"weights/{settings.run}"
    return WeightPublisher(RunControl(client, Keys(settings.run)), settings.weights, root, settings.run)


def create_trl_rollout(
    settings: Settings | None = None,
    *,
    client: redis.Redis | None = None,
    name: str = "trl",
    catalog: Mapping[str, Prompt] | Sequence[Prompt] | None = None,
    weights_dir: str | None = None,
    timeout_s: float | None = None,
) -> TrlRollout:
    """rollstream as TRL GRPOTrainer's ``rollout_func`` (consumer/integrations/trl.py), with
    its ``callback()``: prompts to the first task of the run unless ``catalog`` (the
    rollstream prompts, by text) names theirs and the meta their judge needs. ``name`` is
    the adapter's stable name: a restarted trainer finds what it left under it."""
    settings, client = _settings_and_client(settings, client)
    coordinator = create_coordinator(settings, client=client, consumer=name)
    rollout = settings.rollout
    plan = RolloutPlan(
        name=name,
        task=settings.tasks[0].name,
        group_size={t.name: t.n for t in settings.tasks},
        batch_size=rollout.batch_size,
        stale_threshold=rollout.stale_threshold,
        reroll=rollout.tail_batch_trigger_size == 0,
        timeout_s=timeout_s,
    )
    publisher = weight_publisher(settings, client, weights_dir)
    return TrlRollout(coordinator, publisher.control, publisher, plan, catalog)


def create_async_grpo(
    settings: Settings | None = None,
    *,
    client: redis.Redis | None = None,
    consumer: str = TRAINER_CONSUMER,
    max_staleness: int | None = None,
    queue_size: int = 0,
    weights_dir: str | None = None,
    wait_s: float = 0.0,
) -> tuple[RolloutWorker, WeightTransfer]:
    """rollstream as TRL AsyncGRPOTrainer's ``rollout_worker`` and ``weight_transfer``
    (consumer/integrations/trl_async.py): the worker reads the groups stream under
    ``consumer`` and hands TRL no sample staler than ``max_staleness`` (TRL's
    AsyncGRPOConfig.max_staleness; rollout.max_staleness when None)."""
    settings, client = _settings_and_client(settings, client)
    staleness = settings.rollout.max_staleness if max_staleness is None else max_staleness
    reader = create_reader(settings, client=client, consumer=consumer)
    worker = RolloutWorker(reader, AsyncPlan(max_staleness=staleness, queue_size=queue_size))
    return worker, WeightTransfer(weight_publisher(settings, client, weights_dir), wait_s)


def create_batch_stream(
    settings: Settings | None = None,
    *,
    client: redis.Redis | None = None,
    consumer: str = TRAINER_CONSUMER,
    steps: int | None = None,
    weights_dir: str | None = None,
) -> BatchStream:
    """rollstream for any PyTorch loop (consumer/integrations/loop.py): the run's train
    batches, one a step (``steps`` of them, or until ``close``), each committed by the
    loop, and ``publish_weights(model)``."""
    settings, client = _settings_and_client(settings, client)
    reader = create_reader(settings, client=client, consumer=consumer)
    return BatchStream(reader, weight_publisher(settings, client, weights_dir), steps=steps)
