"""The simulated engine's timing model, determinism, abort and weight updates.

Times are measured on the wall clock and scaled by the time compression, so
these tests run 4x faster than the simulated seconds they check.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from producer.engines.base import FINISH_ABORT, FINISH_LENGTH, EngineError, SamplingParams
from producer.engines.sim import SimEngine
from shared.settings import SimEngineSettings

COMPRESSION = 4.0


def engine(**overrides: object) -> SimEngine:
    knobs: dict[str, object] = {
        "capacity_tps": 4000, "speed_tps": 1000, "prefill_tps": 1e9, "time_compression": COMPRESSION,
    }  # fmt: skip
    knobs.update(overrides)
    return SimEngine(SimEngineSettings(**knobs))  # type: ignore[arg-type]


def exactly(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, ignore_eos=True)


def sim_seconds(start: float) -> float:
    return (time.monotonic() - start) * COMPRESSION


def test_eight_concurrent_requests_share_the_capacity() -> None:
    async def main() -> tuple[list[float], list[int]]:
        sim = engine()
        start = time.monotonic()
        ends: list[float] = []

        async def one(i: int) -> int:
            (gen,) = await sim.generate([i], exactly(1000))
            ends.append(sim_seconds(start))
            return len(gen.response_ids)

        lengths = await asyncio.gather(*(one(i) for i in range(8)))
        return ends, list(lengths)

    ends, lengths = asyncio.run(main())
    assert lengths == [1000] * 8
    assert all(1.8 <= t <= 2.3 for t in ends), ends  # 8 x 1,000 tokens at T / 8 = 500 tokens/s each
    assert max(ends) - min(ends) < 0.1  # they finish together


def test_a_lone_request_runs_at_the_per_sequence_cap() -> None:
    async def main() -> float:
        sim = engine()
        start = time.monotonic()
        await sim.generate([1], exactly(1000))
        return sim_seconds(start)

    assert 0.9 <= asyncio.run(main()) <= 1.25  # v = 1,000 tokens/s, not T


def test_a_straggler_leaves_the_engine_mostly_idle() -> None:
    async def main() -> tuple[float, float]:
        sim = engine()
        start = time.monotonic()
        long = asyncio.create_task(sim.generate([0], exactly(4000)))
        await asyncio.gather(*(sim.generate([i], exactly(100)) for i in range(1, 8)))
        await sim.health()  # the busy window restarts here: only the straggler is left
        await asyncio.sleep(1.0 / COMPRESSION)
        busy = (await sim.health()).busy_fraction
        await long
        return sim_seconds(start), busy

    took, busy = asyncio.run(main())
    # 0.2 s at 500 tokens/s each, then the long one alone at 1,000 tokens/s: 0.2 + 3.9 s
    assert 3.8 <= took <= 4.5, took
    assert 0.2 <= busy <= 0.3, busy


def test_requests_beyond_max_concurrency_queue() -> None:
    async def main() -> float:
        sim = engine(max_concurrency=2, capacity_tps=2000)
        start = time.monotonic()
        await asyncio.gather(*(sim.generate([i], exactly(500)) for i in range(4)))
        return sim_seconds(start)

    # two at a time, each at 1,000 tokens/s: two waves of 0.5 s
    assert 0.9 <= asyncio.run(main()) <= 1.25


def test_prefill_time_is_proportional_to_prompt_tokens() -> None:
    async def main() -> float:
        sim = engine(prefill_tps=10_000)
        start = time.monotonic()
        await sim.generate(list(range(5000)), exactly(100))
        return sim_seconds(start)

    assert 0.55 <= asyncio.run(main()) <= 0.8  # 0.5 s of prefill, 0.1 s of decode


def test_outputs_are_deterministic_for_a_seed_and_long_tailed() -> None:
    async def lengths(seed: int) -> list[int]:
        sim = engine(time_compression=1e6, median_tokens=100, sigma=1.0, seed=seed)
        gens = await sim.generate([5, 6, 7], SamplingParams(max_tokens=4000), n=64)
        return [len(g.response_ids) for g in gens]

    async def tokens(seed: int) -> list[int]:
        sim = engine(time_compression=1e6, seed=seed)
        (gen,) = await sim.generate([5, 6, 7], SamplingParams(max_tokens=50))
        return gen.response_ids.tolist()

    first, again, other = asyncio.run(lengths(1)), asyncio.run(lengths(1)), asyncio.run(lengths(2))
    assert first == again != other
    assert asyncio.run(tokens(3)) == asyncio.run(tokens(3)) != asyncio.run(tokens(4))
    assert 50 <= float(np.median(first)) <= 200
    assert max(first) > 3 * float(np.median(first))  # the tail


def test_abort_returns_the_partial_tokens() -> None:
    async def main() -> list[int]:
        sim = engine()
        task = asyncio.create_task(sim.generate([1], exactly(1000), n=2, request_id="g1"))
        await asyncio.sleep(0.5 / COMPRESSION)
        assert await sim.abort(["g1"]) == 1
        gens = await task
        assert all(g.finish_reason == FINISH_ABORT for g in gens)
        assert (await sim.health()).outstanding == 0
        return [len(g.response_ids) for g in gens]

    lengths = asyncio.run(main())
    assert all(350 <= n <= 650 for n in lengths), lengths  # ~0.5 s at 1,000 tokens/s


def test_weight_update_during_a_request_stamps_later_tokens() -> None:
    async def main() -> np.ndarray:
        sim = engine()
        task = asyncio.create_task(sim.generate([1], exactly(1000)))
        await asyncio.sleep(0.4 / COMPRESSION)
        await sim.update_weights(7)
        (gen,) = await task
        assert gen.finish_reason == FINISH_LENGTH
        return gen.versions

    versions = asyncio.run(main())
    assert len(versions) == 1000
    switch = int(np.argmax(versions == 7))
    assert 250 <= switch <= 550, switch
    assert set(versions[:switch].tolist()) == {0} and set(versions[switch:].tolist()) == {7}


def test_pause_freezes_decoding_and_resume_goes_on() -> None:
    async def main() -> float:
        sim = engine()
        start = time.monotonic()
        task = asyncio.create_task(sim.generate([1], exactly(500)))
        await asyncio.sleep(0.2 / COMPRESSION)
        await sim.pause()
        await asyncio.sleep(0.5 / COMPRESSION)
        assert not task.done()
        await sim.resume()
        await task
        return sim_seconds(start)

    assert 0.95 <= asyncio.run(main()) <= 1.3  # 0.5 s of decoding + 0.5 s paused


def test_failure_rate_fails_requests() -> None:
    async def main() -> None:
        sim = engine(failure_rate=1.0, time_compression=1e6)
        with pytest.raises(EngineError, match="simulated"):
            await sim.generate([1], SamplingParams(max_tokens=10))

    asyncio.run(main())


def test_a_cancelled_generate_stops_its_requests() -> None:
    async def main() -> int:
        sim = engine()
        task = asyncio.create_task(sim.generate([1], exactly(1000), n=3))
        await asyncio.sleep(0.1 / COMPRESSION)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return (await sim.health()).outstanding

    assert asyncio.run(main()) == 0


def test_busy_total_is_not_reset_by_other_readers() -> None:
    async def main() -> tuple[float, float]:
        sim = engine()
        await asyncio.gather(*(sim.generate([i], exactly(200)) for i in range(8)))  # saturated
        await sim.health()  # someone else reads (and resets) the window
        await asyncio.sleep(0.2 / COMPRESSION)  # idle
        health = await sim.health()
        return health.busy_fraction, health.busy_total

    window, total = asyncio.run(main())
    assert window < 0.1  # idle since the last read
    assert 0.4 < total < 0.95  # a saturated stretch, then idle, since the start
