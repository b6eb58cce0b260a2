"""An engine host's lifecycle: a weight sync cut short leaves the engine serving."""

from __future__ import annotations

import asyncio

from rollstream.producer.engines.base import SamplingParams
from rollstream.producer.fleet.pool import LocalPool
from rollstream.shared.settings import load_settings

ONE = {"count": 1, "sim": {"time_compression": 1.0, "median_tokens": 20}}
LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)  # 100 s at the sim's 1,000 tokens/s
SHORT = SamplingParams(max_tokens=8, ignore_eos=True)


def test_a_drain_cut_short_by_the_sync_timeout_leaves_the_engine_open() -> None:
    settings = load_settings(engines=ONE)

    async def main() -> None:
        pool = LocalPool.start(settings.engines)
        # Given a request that runs far longer than the sync timeout
        long = asyncio.create_task(pool.generate([1, 2, 3], LONG, 1, "long", engine=0))
        await asyncio.sleep(0)  # admitted: the drain waits for it
        while pool.hosts[0].inflight == 0:
            await asyncio.sleep(0.01)
        # When a drain sync gives up on it at the timeout (its call to the host is cancelled)
        assert await pool.sync_weights(1, mode="drain", timeout_s=0.3) == [0]
        # and the producer aborts what it had on the engine that never confirmed
        await pool.abort(None)
        assert not (await long).failed
        # Then the engine takes new work again, on the new weights (before the fix the
        # cancelled drain left it closed: every later request waited for ever)
        async with asyncio.timeout(10):
            result = await pool.generate([4, 5], SHORT, 1, "after", engine=0)
        assert not result.failed, result.error
        assert set(result.generations[0].versions.tolist()) == {1}

    asyncio.run(main())
