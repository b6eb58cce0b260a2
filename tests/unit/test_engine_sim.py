"""The simulated engine's timing model, determinism, abort and weight updates.

The timing tests run the engine on a ManualClock: simulated time moves only when
the test advances it, so each event is checked at its exact time, however busy the
machine is. One test checks the default clock against the wall clock.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from rollstream.producer.engines.base import FINISH_ABORT, FINISH_LENGTH, EngineError, SamplingParams
from rollstream.producer.engines.sim import SimEngine
from rollstream.shared.engine_settings import SimEngineSettings
from tests.helpers import ManualClock, wait_for_async

COMPRESSION = 4.0
PREFILL = 1e-9  # a one-token prompt at prefill_tps 1e9: decoding starts this much after a request
JUST = 1e-6  # simulated seconds either side of an event: far above float rounding, far below any gap


def engine(clock: ManualClock | None = None, **overrides: object) -> SimEngine:
    knobs: dict[str, object] = {
        "capacity_tps": 4000, "speed_tps": 1000, "prefill_tps": 1e9, "time_compression": COMPRESSION,
    }  # fmt: skip
    knobs.update(overrides)
    return SimEngine(SimEngineSettings(**knobs), clock=clock)  # type: ignore[arg-type]


def exactly(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, ignore_eos=True)


async def outstanding(sim: SimEngine) -> int:
    return (await sim.health()).outstanding


async def holding(sim: SimEngine, count: int) -> None:
    """Wait until the generate tasks just created have handed the engine their requests."""

    async def held() -> bool:
        return await outstanding(sim) == count

    await wait_for_async(held)


async def around(sim: SimEngine, clock: ManualClock, at: float) -> tuple[int, int]:
    """Requests outstanding just before and just after simulated time ``at``."""
    clock.advance(at - JUST - clock.time)
    before = await outstanding(sim)
    clock.advance(2 * JUST)
    return before, await outstanding(sim)


def test_eight_concurrent_requests_share_the_capacity() -> None:
    async def main() -> tuple[tuple[int, int], list[int]]:
        clock = ManualClock()
        sim = engine(clock)
        tasks = [asyncio.create_task(sim.generate([i], exactly(1000))) for i in range(8)]
        await holding(sim, 8)
        # 8 x 1,000 tokens at T / 8 = 500 tokens/s each: 2 s, all of them together
        counts = await around(sim, clock, PREFILL + 2.0)
        return counts, [len(gen.response_ids) for (gen,) in await asyncio.gather(*tasks)]

    counts, lengths = asyncio.run(main())
    assert counts == (8, 0)
    assert lengths == [1000] * 8


def test_a_lone_request_runs_at_the_per_sequence_cap() -> None:
    async def main() -> tuple[int, int]:
        clock = ManualClock()
        sim = engine(clock)
        task = asyncio.create_task(sim.generate([1], exactly(1000)))
        await holding(sim, 1)
        counts = await around(sim, clock, PREFILL + 1.0)  # v = 1,000 tokens/s, not T
        await task
        return counts

    assert asyncio.run(main()) == (1, 0)


def test_a_straggler_leaves_the_engine_mostly_idle() -> None:
    async def main() -> tuple[tuple[int, int], float, tuple[int, int], int]:
        clock = ManualClock()
        sim = engine(clock)
        long = asyncio.create_task(sim.generate([0], exactly(4000)))
        short = [asyncio.create_task(sim.generate([i], exactly(100))) for i in range(1, 8)]
        await holding(sim, 8)
        # 8 at T / 8 = 500 tokens/s each: the short ones end at 0.2 s
        shorts_end = await around(sim, clock, PREFILL + 0.2)
        await asyncio.gather(*short)
        await sim.health()  # the busy window restarts here: only the straggler is left
        clock.advance(1.0)
        busy = (await sim.health()).busy_fraction
        # then the long one alone at v = 1,000 tokens/s: its other 3,900 tokens take 3.9 s
        long_end = await around(sim, clock, PREFILL + 4.1)
        (gen,) = await long
        return shorts_end, busy, long_end, len(gen.response_ids)

    shorts_end, busy, long_end, length = asyncio.run(main())
    assert shorts_end == (8, 1)
    assert busy == pytest.approx(0.25)  # 1,000 of the 4,000 tokens/s
    assert long_end == (1, 0) and length == 4000


def test_requests_beyond_max_concurrency_queue() -> None:
    async def main() -> tuple[tuple[int, int], tuple[int, int]]:
        clock = ManualClock()
        sim = engine(clock, max_concurrency=2, capacity_tps=2000)
        tasks = [asyncio.create_task(sim.generate([i], exactly(500))) for i in range(4)]
        await holding(sim, 4)
        # two at a time, each at 1,000 tokens/s: two waves of 0.5 s (each after its prefill)
        first = await around(sim, clock, PREFILL + 0.5)
        second = await around(sim, clock, 2 * PREFILL + 1.0)
        await asyncio.gather(*tasks)
        return first, second

    assert asyncio.run(main()) == ((4, 2), (2, 0))


def test_prefill_time_is_proportional_to_prompt_tokens() -> None:
    async def main() -> tuple[float, tuple[int, int]]:
        clock = ManualClock()
        sim = engine(clock, prefill_tps=10_000)
        task = asyncio.create_task(sim.generate(list(range(5000)), exactly(100)))
        await holding(sim, 1)
        clock.advance(0.5 - JUST)  # still in its 0.5 s of prefill: nothing decodes
        prefilling = (await sim.health()).busy_fraction
        counts = await around(sim, clock, 0.6)  # then 0.1 s of decode
        await task
        return prefilling, counts

    assert asyncio.run(main()) == (0.0, (1, 0))


def test_the_default_clock_runs_time_compression_times_faster_than_the_wall_clock() -> None:
    async def main() -> float:
        sim = engine()
        started = time.monotonic()
        (gen,) = await asyncio.wait_for(sim.generate([1], exactly(1000)), 60)
        assert len(gen.response_ids) == 1000
        return time.monotonic() - started

    # 1 simulated second: never sooner than 1 / 4 s (later only as late as the machine is busy)
    assert asyncio.run(main()) >= 1.0 / COMPRESSION - 1e-6


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
        clock = ManualClock()
        sim = engine(clock)
        task = asyncio.create_task(sim.generate([1], exactly(1000), n=2, request_id="g1"))
        await holding(sim, 2)
        clock.advance(PREFILL + 0.5)
        assert await sim.abort(["g1"]) == 1
        gens = await task
        assert all(g.finish_reason == FINISH_ABORT for g in gens)
        assert await outstanding(sim) == 0
        return [len(g.response_ids) for g in gens]

    assert asyncio.run(main()) == [500, 500]  # 0.5 s at 1,000 tokens/s


def test_weight_update_during_a_request_stamps_later_tokens() -> None:
    async def main() -> np.ndarray:
        clock = ManualClock()
        sim = engine(clock)
        task = asyncio.create_task(sim.generate([1], exactly(1000)))
        await holding(sim, 1)
        clock.advance(PREFILL + 0.4)
        await sim.update_weights(7)
        clock.advance(0.6)
        (gen,) = await task
        assert gen.finish_reason == FINISH_LENGTH
        return gen.versions

    versions = asyncio.run(main())
    assert versions.tolist() == [0] * 400 + [7] * 600  # 0.4 s at 1,000 tokens/s on step 0


def test_pause_freezes_decoding_and_resume_goes_on() -> None:
    async def main() -> tuple[int, tuple[int, int], int]:
        clock = ManualClock()
        sim = engine(clock)
        task = asyncio.create_task(sim.generate([1], exactly(500)))
        await holding(sim, 1)
        clock.advance(PREFILL + 0.2)  # 200 tokens
        await sim.pause()
        clock.advance(0.5)  # past when it would have finished
        paused = await outstanding(sim)
        await sim.resume()
        counts = await around(sim, clock, PREFILL + 0.2 + 0.5 + 0.3)  # the other 300 tokens
        (gen,) = await task
        return paused, counts, len(gen.response_ids)

    assert asyncio.run(main()) == (1, (1, 0), 500)


def test_failure_rate_fails_requests() -> None:
    async def main() -> None:
        sim = engine(failure_rate=1.0, time_compression=1e6)
        with pytest.raises(EngineError, match="simulated"):
            await sim.generate([1], SamplingParams(max_tokens=10))

    asyncio.run(main())


def test_a_cancelled_generate_stops_its_requests() -> None:
    async def main() -> int:
        clock = ManualClock()
        sim = engine(clock)
        task = asyncio.create_task(sim.generate([1], exactly(1000), n=3))
        await holding(sim, 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await outstanding(sim)

    assert asyncio.run(main()) == 0


def test_busy_total_is_not_reset_by_other_readers() -> None:
    async def main() -> tuple[float, float]:
        clock = ManualClock()
        sim = engine(clock)
        tasks = [asyncio.create_task(sim.generate([i], exactly(200))) for i in range(8)]
        await holding(sim, 8)
        clock.advance(PREFILL + 0.4)  # saturated: 8 x 200 tokens at 500 tokens/s each
        await asyncio.gather(*tasks)
        await sim.health()  # someone else reads (and resets) the window
        clock.advance(0.4)  # idle
        health = await sim.health()
        return health.busy_fraction, health.busy_total

    window, total = asyncio.run(main())
    assert window == 0.0  # idle since the last read
    assert total == pytest.approx(0.5)  # 0.4 s saturated, then 0.4 s idle, since the start
