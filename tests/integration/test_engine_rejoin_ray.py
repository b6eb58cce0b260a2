"""The same on real Ray: an engine actor killed and restarted by Ray is brought to the
run's step by the pool before it serves again."""

from __future__ import annotations

import asyncio

import pytest
import ray

from rollstream.producer.engines.base import SamplingParams
from rollstream.producer.fleet.pool import EnginePool
from rollstream.shared.settings import load_settings
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]


def test_a_restarted_engine_actor_serves_only_on_the_runs_weights(run_name: str) -> None:
    settings = load_settings(
        run=run_name,
        engines={"count": 1, "num_cpus": 0, "max_restarts": 2, "sim": {"time_compression": 1000.0}},
    )
    pool = EnginePool.start(settings.run, settings.engines)
    try:
        assert asyncio.run(pool.sync_weights(4, mode="abort")) == []
        # Given the actor killed and restarted by Ray (from step 0)
        ray.kill(pool.handles[0], no_restart=False)
        wait_for(lambda: _step(pool) == 0, timeout=60)
        # When the pool sends it a group, Then the group is made on step 4
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        result = asyncio.run(pool.generate([1, 2, 3], params, 2, "g", engine=0))
        assert not result.failed, result.error
        assert all(set(g.versions.tolist()) == {4} for g in result.generations)
        assert _step(pool) == 4
    finally:
        EnginePool.stop(settings.run, settings.engines.count)


def _step(pool: EnginePool) -> int | None:
    (health,) = pool.probe(timeout_s=2.0)
    return None if health is None else health.model_step
