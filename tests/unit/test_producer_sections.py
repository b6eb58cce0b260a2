"""The producer's parts take the sections of the settings they use, never the whole tree
(issue 22): the group runner its producer section, the tasks' group sizes, the weight-sync
mode and the attempts; the pools and the engine actors the engines section and the run's
name; the Producer its parts and a ProducerPlan (issue 33). Only the producer's composition
root (producer/assembly.py) holds the tree: tests/unit/test_packaging.py checks that for
every part."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import redis

from rollstream.producer.assembly import build_producer, producer_plan
from rollstream.producer.filters import keep_all
from rollstream.producer.fleet.pool import LocalPool
from rollstream.producer.group import GroupRunner
from rollstream.producer.judges.registry import load_judge
from rollstream.producer.tokenizer import BytesTokenizer
from rollstream.shared.errors import SettingsError
from rollstream.shared.keys import Keys
from rollstream.shared.settings import load_settings


def test_a_producer_is_built_from_parts_and_a_plan(fake_client: redis.Redis) -> None:
    settings = load_settings(
        run="plan",
        tasks=[{"name": "math", "n": 3, "weight": 3.0}, {"name": "code", "n": 5}],
        rollout={"mode": "sync", "batch_size": 8, "max_staleness": 2, "on_weight_sync": "abort"},
        producer={"max_inflight": 5, "heartbeat_s": 0.5, "idle_poll_max_s": 2.0, "sync_timeout_s": 9.0},
        process={"stop_timeout_s": 4.0, "progress_s": 7.0},
    )
    plan = producer_plan(settings)
    assert (plan.run, plan.mode, plan.on_weight_sync) == ("plan", "sync", "abort")
    assert dict(plan.batch) == {"math": 6, "code": 2} and dict(plan.group_sizes) == {"math": 3, "code": 5}
    assert (plan.stale_threshold, plan.sync_weights_interval, plan.max_inflight) == (3, 1, 5)
    assert (plan.heartbeat_s, plan.idle_poll_max_s, plan.sync_timeout_s) == (0.5, 2.0, 9.0)
    assert (plan.stop_timeout_s, plan.progress_s) == (4.0, 7.0)
    pool = LocalPool([])
    producer = build_producer(fake_client, settings, pool=pool, name="p9")
    assert not hasattr(producer, "settings")
    assert producer.plan == plan and producer.pool is pool and producer.name == "p9"
    assert producer.buffer.consumer == "p9"
    assert producer.buffer.keys == producer.control.keys == Keys("plan")
    assert producer.batch == {"math": 6, "code": 2}
    assert producer.runner.on_weight_sync == "abort" and producer.runner.group_size("code") == 5


def test_a_group_runner_is_built_from_sections(fake_client: redis.Redis) -> None:
    settings = load_settings(
        tasks=[{"name": "math", "n": 3}, {"name": "code", "n": 5}],
        producer={"group_timeout_s": 7.0},
        rollout={"on_weight_sync": "drain"},
        buffer={"max_attempts": 4},
    )
    buffer: Any = SimpleNamespace(client=fake_client, keys=Keys("r"), consumer="p1")
    s = settings
    runner = GroupRunner(
        s.producer, s.tasks, buffer, LocalPool([]), BytesTokenizer(), load_judge("math"), keep_all,
        on_weight_sync=s.rollout.on_weight_sync, max_attempts=s.buffer.max_attempts,
    )  # fmt: skip
    assert not hasattr(runner, "settings")
    assert (runner.group_size("math"), runner.group_size("code")) == (3, 5)
    assert (runner.on_weight_sync, runner.max_attempts, runner.timeout_s()) == ("drain", 4, 7.0)
    assert runner.agent.config.on_weight_sync == "drain"  # type: ignore[attr-defined]
    with pytest.raises(SettingsError, match="unknown task 'nope'; the settings define: math, code"):
        runner.group_size("nope")


def test_a_local_pool_is_built_from_the_engines_section() -> None:
    engines = load_settings(engines={"kind": "sim", "count": 3}).engines
    pool = LocalPool.start(engines)
    assert len(pool.hosts) == 3 and pool.serving() == [0, 1, 2]
