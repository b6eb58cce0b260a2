"""Two producer bugs found in review, each pinned by a test that failed before its fix:
a weight sync published while a producer starts was missed, and --burst did not exit
when only the admission bound held it back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from rollstream.producer.assembly import build_producer
from rollstream.producer.worker import Producer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import WEIGHT_SYNC
from rollstream.shared.runconfig import open_buffer
from tests.helpers import prompts
from tests.integration.test_producer import settings_for

pytestmark = pytest.mark.integration


def make(redis_server: EmbeddedRedis, run_name: str, **overrides: Any) -> Producer:
    settings = settings_for(redis_server.url, run_name, **overrides)
    return build_producer(redis.Redis.from_url(redis_server.url), settings, name="p1")


@pytest.mark.timeout(60)
def test_a_weight_sync_published_while_the_producer_starts_is_not_missed(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    producer = make(redis_server, run_name)
    read_step = producer.control.model_step

    def racing_read() -> int:
        step = read_step()  # the producer has read step 0 ...
        producer.control.publish(WEIGHT_SYNC, 1)  # ... and the trainer publishes step 1 now
        producer.control.model_step = read_step  # type: ignore[method-assign]
        return step

    producer.control.model_step = racing_read  # type: ignore[method-assign]

    async def main() -> None:
        stop = asyncio.Event()
        run = asyncio.create_task(producer.run(stop))
        # Then the producer follows the event it could have missed and moves to step 1
        deadline = asyncio.get_running_loop().time() + 30
        while producer.model_step < 1:
            assert not run.done(), run.exception()
            assert asyncio.get_running_loop().time() < deadline, "the weight sync was missed"
            await asyncio.sleep(0.02)
        stop.set()
        await run

    asyncio.run(main())
    assert producer.stats.weight_syncs == 1


@pytest.mark.timeout(60)
def test_burst_exits_when_only_the_admission_bound_holds_it_back(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    # async, batch 4, max_staleness 0: at model step 0 the bound admits 4 groups
    producer = make(redis_server, run_name)
    producer.buffer.feed(prompts("math", 20))
    asyncio.run(producer.run(burst=True))  # before the fix: waited for ever for a trainer
    assert producer.stats.outcomes == {"completed": 4}
    assert producer.buffer.unclaimed("math") == 16  # the rest waits for the next model step


@pytest.mark.timeout(60)
def test_sync_mode_produces_every_batch_until_the_next_weight_sync(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    # sync, batch 4, a weight sync every 2 steps: the trainer needs 2 batches on step 0
    # before it publishes anything (1 batch before: the run stalled at its second step)
    producer = make(redis_server, run_name, rollout={"mode": "sync", "sync_weights_interval": 2})
    producer.buffer.feed(prompts("math", 20))
    asyncio.run(producer.run(burst=True))
    assert producer.stats.outcomes == {"completed": 8}


@pytest.mark.timeout(60)
def test_a_dead_lettered_group_gives_its_place_back_to_the_producers(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    # async, batch 4, max_staleness 0: the bound admits 4 groups at model step 0
    producer = make(redis_server, run_name)
    producer.buffer.feed(prompts("math", 20))
    asyncio.run(producer.run(burst=True))
    assert producer.stats.outcomes == {"completed": 4}
    # When the trainer dead-letters one of them (it could not use it)
    trainer = open_buffer(producer.buffer.client, settings_for(redis_server.url, run_name), "trainer")
    (item, *_) = trainer.read_batch("math", 4).items
    assert trainer.dead_letter(item.entry, "bad group")
    # Then a producer may make one more: the dead group no longer holds a place for ever
    # (before, the run stalled: at max_staleness 0 nothing more was admitted)
    again = make(redis_server, run_name)
    asyncio.run(again.run(burst=True))
    assert again.stats.outcomes == {"completed": 1}
    assert again.buffer.accepted("math") == 4
