"""An engine that Ray restarted comes back at model step 0: it serves nothing until it
holds the run's weights, so no group is generated on weights the run has left behind."""

from __future__ import annotations

import asyncio

from rollstream.producer.engines import make_engine
from rollstream.producer.engines.base import SamplingParams
from rollstream.producer.fleet.host import EngineHost, StaleWeights
from rollstream.producer.fleet.pool import LocalPool
from rollstream.shared.settings import load_settings

FAST = {"count": 2, "sim": {"time_compression": 1000.0, "median_tokens": 20}}
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def test_a_restarted_engine_is_brought_to_the_runs_step_before_it_generates() -> None:
    settings = load_settings(engines=FAST)

    async def main() -> None:
        pool = LocalPool.start(settings.engines)
        assert await pool.sync_weights(3, mode="abort") == []
        # Given engine 0 restarted (a new actor starts from step 0)
        pool.hosts[0] = EngineHost(make_engine(settings.engines))
        # When a group is sent to it
        result = await pool.generate([1, 2, 3], PARAMS, 2, "g1", engine=0)
        # Then it was synced first: every token carries the run's step
        assert not result.failed, result.error
        assert result.engine == 0 and pool.hosts[0].model_step == 3
        assert all(set(g.versions.tolist()) == {3} for g in result.generations)

    asyncio.run(main())


def test_a_host_behind_the_request_refuses_it() -> None:
    settings = load_settings(engines=FAST)

    async def main() -> None:
        host = EngineHost(make_engine(settings.engines))
        try:
            await host.generate([1, 2], PARAMS, 1, "g", min_step=2)
        except StaleWeights as exc:
            assert "holds model step 0, the request needs 2" in str(exc)
        else:
            raise AssertionError("a host on step 0 served a request that needs step 2")
        assert host.inflight == 0
        await host.sync_weights(2, None, "abort")
        (gen,) = await host.generate([1, 2], PARAMS, 1, "g", min_step=2)
        assert set(gen.versions.tolist()) == {2}

    asyncio.run(main())
