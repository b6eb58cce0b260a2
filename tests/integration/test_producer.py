"""The producer on a real redis-server with simulated engines in this process
(the Ray pool has its own tests): admission, sync targets, weight-sync modes.

Tests that need an event at a given point of a generation run the engines on a
ManualClock: generation moves only when the test advances it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from rollstream.producer.assembly import build_producer
from rollstream.producer.engines.sim import SimEngine
from rollstream.producer.fleet.pool import LocalPool
from rollstream.producer.worker import Producer
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import Batch
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import WEIGHT_SYNC
from rollstream.shared.settings import Settings, load_settings
from tests.helpers import ManualClock, prompts, still_running, wait_for_async

pytestmark = pytest.mark.integration

ProducerFactory = Callable[..., Producer]


def settings_for(url: str, run: str, **overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "run": run,
        "redis": {"url": url},
        "tasks": [{"name": "math", "n": 2}],
        "buffer": {"claim_idle_ms": 5000, "max_attempts": 3},
        "engines": {"count": 2, "sim": {"time_compression": 50.0, "median_tokens": 100, "sigma": 0.5}},
        "rollout": {"mode": "async", "batch_size": 4, "max_staleness": 0},
        "producer": {"max_tokens": 400, "is_valid": "keep_all", "heartbeat_s": 0.2, "max_inflight": 16},
    }
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return load_settings(**base)


@pytest.fixture
def make_producer(redis_server: EmbeddedRedis, run_name: str) -> ProducerFactory:
    def make(name: str = "p1", clock: ManualClock | None = None, **overrides: Any) -> Producer:
        settings = settings_for(redis_server.url, run_name, **overrides)
        if clock is None:
            pool = LocalPool.start(settings.engines)
        else:
            pool = LocalPool(
                [SimEngine(settings.engines.sim, clock=clock) for _ in range(settings.engines.count)]
            )
        return build_producer(redis.Redis.from_url(redis_server.url), settings, pool=pool, name=name)

    return make


def hosts(producer: Producer) -> list[Any]:
    assert isinstance(producer.pool, LocalPool)
    return producer.pool.hosts


def groups_on_engines(producer: Producer) -> int:
    return sum(host.inflight for host in hosts(producer))


def sync_reached_engines(producer: Producer, step: int) -> bool:
    """Every engine has taken the weight sync: it is on the step, or draining towards it
    (EngineHost holds new requests while it drains)."""
    return all(host.model_step == step or not host._open.is_set() for host in hosts(producer))


async def finish(
    run: asyncio.Task[Any], clock: ManualClock, step_s: float = 1.0, timeout: float = 60
) -> None:
    """Advance the engines' clock until the producer's run ends: each generation, first or
    again, finishes at its own simulated time; the wall clock only paces the polling."""
    deadline = time.monotonic() + timeout
    while not run.done():
        assert time.monotonic() < deadline, "the producer's run did not end"
        clock.advance(step_s)
        await asyncio.wait([run], timeout=0.01)
    run.result()


def watch_admissions(producer: Producer) -> list[tuple[int, int]]:
    """(admitted, limit) after every claim the producer makes."""
    seen: list[tuple[int, int]] = []
    claim = producer.buffer.claim

    def checked(task: str, *args: Any, **kwargs: Any) -> Any:
        got = claim(task, *args, **kwargs)
        if got:
            seen.append((producer.buffer.admitted(task), kwargs["limit"]))
        return got

    producer.buffer.claim = checked  # type: ignore[method-assign]
    return seen


async def full_batch(trainer: ReplayBuffer, count: int) -> Batch:
    batch = Batch("math")

    def full() -> bool:
        batch.items.extend(trainer.read_batch("math", count - len(batch)).items)
        return len(batch) == count

    await wait_for_async(full, timeout=60, interval=0.02)
    return batch


def test_async_never_admits_past_the_bound_with_a_slow_trainer(make_producer: ProducerFactory) -> None:
    producer = make_producer()
    trainer = make_producer("t").buffer  # a trainer's view of the same run
    producer.buffer.feed(prompts("math", 40))
    seen = watch_admissions(producer)
    staleness: list[int] = []

    async def slow_trainer(stop: asyncio.Event) -> None:
        for step in range(1, 5):
            batch = await full_batch(trainer, 4)
            staleness.extend(step - g.model_step - 1 for g in batch.groups)
            # the train step itself: much slower than generation, so that the producer
            # runs into its admission bound while it waits for the weight sync
            await asyncio.sleep(0.3)
            trainer.commit(batch)
            producer.control.publish(WEIGHT_SYNC, step)
        stop.set()

    async def main() -> None:
        stop = asyncio.Event()
        await asyncio.gather(producer.run(stop), slow_trainer(stop))

    asyncio.run(main())
    assert seen and all(admitted <= limit for admitted, limit in seen), seen
    assert max(limit for _, limit in seen) >= 12  # the bound moved with the weight syncs
    assert staleness and max(staleness) < 1  # max_staleness 0: nothing trained stale
    assert producer.stats.weight_syncs >= 3


def test_sync_produces_the_batch_plus_budget_then_stops(make_producer: ProducerFactory) -> None:
    producer = make_producer(rollout={"mode": "sync", "batch_size": 8, "over_sample_threshold": 0.25})
    producer.buffer.feed(prompts("math", 40))
    seen = watch_admissions(producer)
    # no trainer asks for the next step: burst ends the run once the producer may take no more
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    accepted = producer.buffer.accepted("math")
    assert 8 <= accepted <= 10  # the batch, at most the budget of 2 more
    assert all(admitted <= 10 for admitted, _ in seen)
    assert producer.buffer.running("math") == 0  # leftovers went back to the aborted pool
    waiting = producer.buffer.unclaimed("math") + producer.buffer.client.xlen(
        producer.buffer.keys.aborted("math")
    )
    assert waiting + accepted == 40  # nothing lost, nothing produced past the budget


def run_with_sync_midway(producer: Producer, clock: ManualClock, groups: int, at_s: float = 0.6) -> None:
    """Burst run with a weight sync once ``groups`` groups are on the engines and ``at_s``
    simulated seconds into their generation."""

    async def main() -> None:
        task = asyncio.create_task(producer.run(burst=True))
        await wait_for_async(lambda: still_running(task) and groups_on_engines(producer) == groups)
        clock.advance(at_s)
        producer.control.publish(WEIGHT_SYNC, 1)
        await wait_for_async(lambda: still_running(task) and sync_reached_engines(producer, 1))
        await finish(task, clock)

    asyncio.run(main())


LONG = {  # 1,200 tokens a sample at 1,000 tokens/s: 1.2 simulated seconds a group
    "engines": {"count": 1, "sim": {"time_compression": 4.0, "median_tokens": 1e6, "speed_tps": 1000}},
    "producer": {"max_tokens": 1200},
}


def trained_groups(producer: Producer) -> list[Any]:
    return producer.buffer.read_batch("math", 100).groups


def test_partial_rollout_continues_on_the_new_weights_in_place(make_producer: ProducerFactory) -> None:
    clock = ManualClock()
    producer = make_producer(clock=clock, rollout={"on_weight_sync": "partial"}, **LONG)
    producer.buffer.feed(prompts("math", 1))
    run_with_sync_midway(producer, clock, groups=1)
    (group,) = trained_groups(producer)
    for sample in group.samples:
        versions = sample.response_versions
        assert set(np.unique(versions).tolist()) == {0, 1}  # spans both steps
        assert np.all(np.diff(versions) >= 0)
        assert len(sample.response_ids) == 1200  # the length it was going to have
    assert producer.stats.outcomes == {"completed": 1}  # never aborted: the engine updated in place


def test_aborted_partial_samples_go_on_from_their_own_tokens(make_producer: ProducerFactory) -> None:
    # an abort that is not a weight sync (a stuck engine, a stopping producer) hands the
    # partial samples on through the aborted pool; the next claim continues them
    clock = ManualClock()
    producer = make_producer(clock=clock, rollout={"on_weight_sync": "partial"}, **LONG)
    (prompt,) = prompts("math", 1)
    producer.buffer.feed([prompt])

    async def main() -> None:
        task = asyncio.create_task(producer.run(burst=True))
        await wait_for_async(lambda: still_running(task) and groups_on_engines(producer) == 1)
        clock.advance(0.6)
        await producer.pool.abort(list(producer.runner.inflight))
        await finish(task, clock)

    asyncio.run(main())
    assert producer.stats.outcomes == {"aborted": 1, "completed": 1}
    (group,) = trained_groups(producer)
    fresh = asyncio.run(fresh_generation(producer, prompt.prompt, len(group.samples)))
    for sample, whole in zip(group.samples, fresh, strict=True):
        assert len(sample.response_ids) == 1200
        assert sample.response_ids[0] == whole.response_ids[0]  # began as the fresh one did
        assert not np.array_equal(sample.response_ids, whole.response_ids)  # then went on from its cut


def test_an_aborted_entry_with_fewer_than_n_samples_is_made_up_to_n(make_producer: ProducerFactory) -> None:
    """docs/stream-format.md §11.9.3: a partial hand-back holds all n samples. One written
    with fewer (another framework's producer that left out the samples it had not started)
    is continued and made up to n, never completed as a smaller group."""
    from rollstream.shared import codec
    from rollstream.shared.records import Group, Sample, Status

    clock = ManualClock()
    producer = make_producer(clock=clock, rollout={"on_weight_sync": "partial"}, **LONG)
    (prompt,) = prompts("math", 1)
    cut = Sample([1, 2], [7, 8, 9], [-0.1, -0.2, -0.3], [0] * 3, status=Status.ABORTED)
    handed = Group.for_prompt(prompt, samples=[cut], status=Status.ABORTED)
    producer.buffer.ensure("math")
    producer.buffer.client.xadd(producer.buffer.keys.aborted("math"), codec.encode_group(handed))

    async def main() -> None:
        await finish(asyncio.create_task(producer.run(burst=True)), clock)

    asyncio.run(main())
    (group,) = trained_groups(producer)
    assert len(group.samples) == 2  # the task's n
    assert group.samples[0].response_ids[:3].tolist() == [7, 8, 9]  # the cut sample, continued
    assert all(len(s.response_ids) == 1200 for s in group.samples)


async def fresh_generation(producer: Producer, text: str, n: int) -> list[Any]:
    from rollstream.producer.engines.base import SamplingParams
    from rollstream.producer.engines.sim import SimEngine

    engine = SimEngine(hosts(producer)[0].engine.settings)  # the settings of the producer's engines
    params = SamplingParams(max_tokens=1200)
    return await engine.generate(producer.runner.tokenizer.encode(text), params, n)


def test_abort_mode_regenerates_from_the_prompt(make_producer: ProducerFactory) -> None:
    clock = ManualClock()
    producer = make_producer(clock=clock, rollout={"on_weight_sync": "abort"}, **LONG)
    producer.buffer.feed(prompts("math", 1))
    run_with_sync_midway(producer, clock, groups=1)
    (group,) = trained_groups(producer)
    assert all(set(s.response_versions.tolist()) == {1} for s in group.samples)
    assert all(len(s.response_ids) == 1200 for s in group.samples)


def test_drain_mode_finishes_on_the_old_weights(make_producer: ProducerFactory) -> None:
    clock = ManualClock()
    producer = make_producer(clock=clock, rollout={"on_weight_sync": "drain"}, **LONG)
    producer.buffer.feed(prompts("math", 2))
    run_with_sync_midway(producer, clock, groups=2)
    groups = trained_groups(producer)
    assert len(groups) == 2
    for group in groups:
        for sample in group.samples:
            assert len(set(sample.response_versions.tolist())) == 1  # one version per sample
    assert producer.stats.outcomes.get("aborted") is None


def test_engine_failures_are_retried_then_dead_lettered(make_producer: ProducerFactory) -> None:
    producer = make_producer(engines={"sim": {"failure_rate": 1.0}}, buffer={"max_attempts": 2})
    producer.buffer.feed(prompts("math", 2))
    asyncio.run(producer.run(burst=True))
    assert producer.stats.outcomes == {"failed": 2}
    dead = producer.buffer.client.xrange(producer.buffer.keys.dead)
    assert len(dead) == 2
    assert all(b"2 attempts" in fields[b"reason"] and b"simulated" in fields[b"reason"] for _, fields in dead)


def test_a_hung_judge_is_killed_at_its_timeout_retried_then_dead_lettered(
    make_producer: ProducerFactory, redis_server: EmbeddedRedis
) -> None:
    import subprocess

    from tests.integration.test_judge_rq import ROOT, THIS, worker_command, worker_env

    producer = make_producer(
        buffer={"max_attempts": 2},
        producer={"judge": f"{THIS}:sleep_forever", "judge_on_queue": True, "judge_timeout_s": 1.0},
    )
    producer.buffer.feed(prompts("math", 1))
    # a worker that serves the judge queue (rq retries the killed job once: max_attempts 2)
    command = [c for c in worker_command(redis_server.url, "judge") if c != "--burst"]  # serve until killed
    worker = subprocess.Popen(
        command, cwd=ROOT, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        # a deadline instead of waiting for ever: killed at the timeout, not waited on
        asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    finally:
        worker.kill()
        worker.wait()
    assert producer.stats.outcomes == {"failed": 1}
    ((_, dead),) = producer.buffer.client.xrange(producer.buffer.keys.dead)
    assert b"judge failed" in dead[b"reason"] and b"timed out" in dead[b"reason"]


def test_each_model_step_leaves_a_metrics_record(make_producer: ProducerFactory) -> None:
    clock = ManualClock()
    producer = make_producer(clock=clock, producer={"is_valid": "nonzero_reward_std"})
    producer.buffer.feed(prompts("math", 12))
    # the admission bound of step 0 (4 groups) is on the engines when the sync comes
    run_with_sync_midway(producer, clock, groups=4, at_s=0.0)
    records = [f for _, f in producer.buffer.client.xrange(producer.buffer.keys.metrics)]
    assert [r[b"model_step"] for r in records] == [b"0", b"1"]  # at the sync, and at the end
    assert sum(int(r[b"groups"]) for r in records) == producer.stats.outcomes.get("completed", 0)
    assert all(float(r[b"engine_busy"]) >= 0 for r in records)
    assert int(records[-1][b"filtered"]) == producer.stats.outcomes.get("filtered", 0)


def never(completed: int, target: int) -> bool:
    return False


def test_sync_asks_the_should_continue_plug_in(make_producer: ProducerFactory) -> None:
    producer = make_producer(
        rollout={"mode": "sync", "batch_size": 8},
        producer={"should_continue": "tests.integration.test_producer:never"},
    )
    producer.buffer.feed(prompts("math", 10))
    # burst: the run ends once the producer has asked the plug-in and may take nothing
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    assert producer.buffer.accepted("math") == 0
    assert producer.buffer.unclaimed("math") == 10


def test_attempts_past_the_group_timeout_are_aborted_and_retried(make_producer: ProducerFactory) -> None:
    producer = make_producer(  # the engines' clock never moves: no group finishes before its timeout
        clock=ManualClock(),
        buffer={"max_attempts": 2},
        producer={"group_timeout_s": 0.1, "max_tokens": 1200},
    )
    producer.buffer.feed(prompts("math", 1))
    asyncio.run(producer.run(burst=True))
    assert producer.stats.outcomes == {"failed": 1}
    assert producer.runner.retries == 2
    ((_, dead),) = producer.buffer.client.xrange(producer.buffer.keys.dead)
    assert b"timed out after 0.1 s" in dead[b"reason"]
    health = asyncio.run(producer.pool.health())
    assert all(h is not None and h.outstanding == 0 for h in health)  # the engines were told to stop


def test_dynamic_timeout_follows_recent_group_times(make_producer: ProducerFactory) -> None:
    runner = make_producer(producer={"group_timeout_s": 0, "timeout_ratio": 3, "min_timeout_s": 1}).runner
    assert runner.timeout_s() is None  # not enough seen yet
    runner.recent_s.extend([1.0, 2.0, 3.0] * 3)
    assert runner.timeout_s() == pytest.approx(6.0)


def test_an_engine_restarted_from_step_zero_is_brought_back_to_the_run_step(
    make_producer: ProducerFactory,
) -> None:
    producer = make_producer(producer={"heartbeat_s": 0.02})
    producer.control.publish(WEIGHT_SYNC, 3)
    pool = producer.pool
    assert isinstance(pool, LocalPool)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(producer.run(stop))
        # synced when the producer started
        await wait_for_async(lambda: still_running(task) and pool.hosts[0].model_step == 3)
        pool.hosts[0].model_step = 0  # as a restarted actor comes back
        # brought back by the producer's periodic engine check
        await wait_for_async(lambda: still_running(task) and pool.hosts[0].model_step == 3)
        stop.set()
        await task

    asyncio.run(main())
    assert pool.hosts[0].model_step == 3
