"""The producer's composition root: the one module of producer/ that reads the whole
settings tree. It builds the parts a Producer runs on (the run's replay buffer, its run
control, the tokenizer, the judges, the filters, the agent, the group runner and, unless
given one, a local engine pool) and hands each the section of the settings it uses or
plain values; the produce loop gets its numbers as a ProducerPlan.

    producer = build_producer(client, settings, pool=pool, name="p1")

cli/produce.py builds the pool (local engines or the run's Ray actors) and hands it here;
tests and benchmarks that inject a part of their own build the Producer from its parts
(producer_plan, build_runner).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import redis

from rollstream.producer.agents.base import AgentConfig
from rollstream.producer.agents.registry import load_agent
from rollstream.producer.filters import load_filter, load_should_continue
from rollstream.producer.fleet.pool import BasePool, LocalPool
from rollstream.producer.group import GroupRunner
from rollstream.producer.judges.registry import load_judge
from rollstream.producer.judges.rq import RQJudge
from rollstream.producer.tokenizer import make_tokenizer
from rollstream.producer.worker import Producer, ProducerPlan
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import default_consumer_name
from rollstream.shared.connection import refuse_on_cluster
from rollstream.shared.errors import SettingsError
from rollstream.shared.events import RunControl
from rollstream.shared.liveness import Liveness
from rollstream.shared.runconfig import open_buffer, task_quota
from rollstream.shared.settings import Settings

__all__ = ["build_producer", "build_runner", "producer_plan"]

T = TypeVar("T")


def _plugin(load: Callable[[str], T], spec: str, setting: str) -> T:
    """A plug-in named by a setting; a bad name says which setting named it."""
    try:
        return load(spec)
    except SettingsError as exc:
        variable = f"ROLLSTREAM_PRODUCER__{setting.upper()}"
        raise SettingsError(f"invalid setting producer.{setting} ({variable}): {exc}") from None


def producer_plan(settings: Settings) -> ProducerPlan:
    """The numbers the produce loop reads, out of the settings tree."""
    rollout, producer, process = settings.rollout, settings.producer, settings.process
    return ProducerPlan(
        run=settings.run,
        mode=rollout.mode,
        on_weight_sync=rollout.on_weight_sync,
        batch=task_quota(settings),
        group_sizes={t.name: t.n for t in settings.tasks},
        over_sample_threshold=rollout.over_sample_threshold,
        stale_threshold=rollout.stale_threshold,
        sync_weights_interval=rollout.sync_weights_interval,
        tail_batch_trigger_size=rollout.tail_batch_trigger_size,
        max_inflight=producer.max_inflight,
        heartbeat_s=producer.heartbeat_s,
        idle_poll_max_s=producer.idle_poll_max_s,
        sync_timeout_s=producer.sync_timeout_s,
        stop_timeout_s=process.stop_timeout_s,
        progress_s=process.progress_s,
    )


def build_runner(
    client: redis.Redis, settings: Settings, buffer: ReplayBuffer, pool: BasePool
) -> GroupRunner:
    """The group runner over ``buffer`` and ``pool``, with the tokenizer, the judge (and the
    rq judge queue, with producer.judge_on_queue), the group filter and the agent the
    settings name."""
    p = settings.producer
    on_weight_sync, max_attempts = settings.rollout.on_weight_sync, settings.buffer.max_attempts
    if p.judge_on_queue:  # rq's keys share no hash tag: its MULTIs cross slots
        refuse_on_cluster(settings.redis, "the rq judge queue (producer.judge_on_queue)")
    rq_judge = RQJudge(client, p.judge, p.judge_timeout_s, max_attempts - 1)
    agent_config = AgentConfig.from_settings(p, on_weight_sync)
    return GroupRunner(
        p,
        settings.tasks,
        buffer,
        pool,
        make_tokenizer(settings.engines),
        _plugin(load_judge, p.judge, "judge"),
        _plugin(load_filter, p.is_valid, "is_valid"),
        rq_judge if p.judge_on_queue else None,
        _plugin(lambda spec: load_agent(spec, agent_config), p.agent, "agent"),
        on_weight_sync=on_weight_sync,
        max_attempts=max_attempts,
    )


def build_producer(
    client: redis.Redis,
    settings: Settings,
    *,
    pool: BasePool | None = None,
    name: str | None = None,
    liveness: Liveness | None = None,
) -> Producer:
    """A producer of the run ``settings`` name, on ``pool`` (default: the engines section's
    engines in this process, LocalPool.start), as consumer ``name`` (default: one of its
    own), renewing ``liveness`` with its heartbeat if given."""
    name = name or default_consumer_name("producer")
    pool = LocalPool.start(settings.engines) if pool is None else pool
    buffer = open_buffer(client, settings, name)
    control = RunControl(client, buffer.keys)
    runner = build_runner(client, settings, buffer, pool)
    should_continue = _plugin(load_should_continue, settings.producer.should_continue, "should_continue")
    return Producer(
        producer_plan(settings),
        name=name,
        buffer=buffer,
        control=control,
        pool=pool,
        runner=runner,
        should_continue=should_continue,
        liveness=liveness,
    )
