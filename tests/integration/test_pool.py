"""The Ray engine pool on a real local Ray: load sharing, attaching from another
process, and an engine actor killed in the middle of a group."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import ray
import redis

from rollstream.producer.engines.base import FINISH_LENGTH, SamplingParams
from rollstream.producer.fleet.actors import actor_name, namespace
from rollstream.producer.fleet.pool import EnginePool, PoolResult
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.settings import Settings, load_settings
from tests.helpers import wait_for_async

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]


def pool_settings(run: str, **sim: object) -> Settings:
    knobs: dict[str, object] = {"capacity_tps": 4000, "speed_tps": 1000, "time_compression": 20.0, **sim}
    return load_settings(run=run, engines={"count": 2, "num_cpus": 0, "max_restarts": 2, "sim": knobs})


@pytest.fixture
def pool(run_name: str) -> EnginePool:  # type: ignore[misc]
    settings = pool_settings(run_name)
    pool = EnginePool.start(settings.run, settings.engines)
    yield pool
    EnginePool.stop(settings.run, settings.engines.count)


def test_two_engines_share_the_load(pool: EnginePool) -> None:
    async def main() -> list[int]:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        results = await asyncio.gather(*(pool.generate([i], params, 4, f"g{i}") for i in range(6)))
        assert not any(r.failed for r in results)
        assert all(len(r.generations) == 4 for r in results)
        assert all(g.finish_reason == FINISH_LENGTH for r in results for g in r.generations)
        return [r.engine for r in results]

    engines = asyncio.run(main())
    assert sorted(engines) == [0, 0, 0, 1, 1, 1]
    assert pool.outstanding == [0, 0]


def test_actors_are_named_in_the_run_namespace(pool: EnginePool, run_name: str) -> None:
    for i in range(2):
        handle = ray.get_actor(actor_name(run_name, i), namespace=namespace(run_name))
        assert handle._actor_id == pool.handles[i]._actor_id
    with pytest.raises(ValueError):
        ray.get_actor(actor_name(run_name, 0))  # not in the driver's own namespace


ATTACHER = textwrap.dedent(
    """
    import asyncio, sys
    from rollstream.producer.engines.base import SamplingParams
    from rollstream.producer.fleet.pool import EnginePool
    from rollstream.producer.fleet.actors import init_ray
    from rollstream.shared.settings import load_settings

    init_ray(sys.argv[1])
    settings = load_settings(run=sys.argv[2], engines={"count": 2})
    pool = EnginePool.attach(settings.run, settings.engines.count)
    result = asyncio.run(pool.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), 3, "other"))
    print(result.engine, [len(g.response_ids) for g in result.generations], result.error or "ok")
    """
)


def test_a_second_process_attaches_to_the_named_actors(pool: EnginePool, run_name: str) -> None:
    address = ray.get_runtime_context().gcs_address
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", ATTACHER, address, run_name],
        capture_output=True, text=True, timeout=120, cwd=root,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2].endswith("[50, 50, 50] ok")


def test_attach_without_engines_says_what_is_missing(run_name: str) -> None:
    from rollstream.producer.fleet.actors import PoolError

    with pytest.raises(PoolError, match=f"rollstream:{run_name}:engine:0"):
        EnginePool.attach(run_name, pool_settings(run_name).engines.count)


def test_killed_engine_fails_its_group_is_restarted_and_a_retry_succeeds(run_name: str) -> None:
    settings = pool_settings(run_name, time_compression=1.0)
    pool = EnginePool.start(settings.run, settings.engines)
    try:

        async def main() -> None:
            params = SamplingParams(max_tokens=5000, ignore_eos=True)  # 5 s: killed long before
            task = asyncio.create_task(pool.generate([1], params, 2, "doomed"))

            async def generating_on_engine_0() -> bool:
                health = (await pool.health())[0]
                return health is not None and health.outstanding == 2

            await wait_for_async(generating_on_engine_0, timeout=60)
            ray.kill(pool.handles[0], no_restart=False)
            failed = await task
            assert failed.failed and failed.engine == 0
            assert "engine 0 died" in failed.error
            retry = await pool.generate(
                [1], SamplingParams(max_tokens=20, ignore_eos=True), 2, "doomed", avoid=[0]
            )
            assert not retry.failed and retry.engine == 1

            # Ray restarts the dead actor; it serves again under the same name
            async def served() -> PoolResult | None:
                again = await pool.generate([1], SamplingParams(max_tokens=20), 1, "after", avoid=[1])
                return None if again.failed else again

            again = await wait_for_async(served, timeout=60, interval=0.5)
            assert again.engine == 0

        asyncio.run(main())
    finally:
        EnginePool.stop(settings.run, settings.engines.count)


def test_pause_update_and_health_reach_every_engine(pool: EnginePool) -> None:
    async def main() -> None:
        assert await pool.update_weights(5) == []
        health = await pool.health()
        assert [h.model_step for h in health if h] == [5, 5]
        assert await pool.pause() == []
        assert all(h and h.paused for h in await pool.health())
        assert await pool.resume() == []
        result = await pool.generate([9], SamplingParams(max_tokens=10, ignore_eos=True), 2, "v")
        assert all(g.versions.tolist() == [5] * 10 for g in result.generations)

    asyncio.run(main())


def test_engines_started_by_the_cli_serve_a_producer_in_another_process(
    run_name: str, redis_server: EmbeddedRedis
) -> None:
    # Given `rollstream engines` run as its own process, which exits once they are up
    address = ray.get_runtime_context().gcs_address
    env = {
        **os.environ,
        "ROLLSTREAM_REDIS__URL": redis_server.url,
        "ROLLSTREAM_RUN": run_name,
        "ROLLSTREAM_ENGINES__COUNT": "2",
        "ROLLSTREAM_ENGINES__NUM_CPUS": "0",
        "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "50",
    }
    started = subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", "engines", "--address", address],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr[-2000:]
    assert f"rollstream:{run_name}:engine:1" in started.stderr  # its log
    # and recorded the run's Ray cluster, where the run's producers find it
    assert RunControl(redis.Redis.from_url(redis_server.url), Keys(run_name)).ray_address() == address
    # When this process attaches to them by name, Then they generate (they outlived their starter)
    settings = pool_settings(run_name)
    pool = EnginePool.attach(settings.run, settings.engines.count)
    result = asyncio.run(pool.generate([4, 5], SamplingParams(max_tokens=30, ignore_eos=True), 2, "g"))
    assert not result.failed
    assert [len(g.response_ids) for g in result.generations] == [30, 30]
    stopped = subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", "engines", "--address", address, "--stop"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "stopped 2 engine actors" in stopped.stdout, stopped.stderr[-2000:]
    with pytest.raises(ValueError):
        ray.get_actor(actor_name(run_name, 0), namespace=namespace(run_name))
