"""Eval batches in sync mode: a producer whose train batch is done (it admits no more
training work until the next weight sync) still serves eval prompts, and does not take
them for leftovers of the batch to abort."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

from rollstream.consumer.assembly import create_coordinator
from rollstream.producer.assembly import build_producer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import prompts, wait_for

pytestmark = pytest.mark.integration


def test_a_producer_with_its_sync_batch_done_serves_an_eval_batch(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": "math", "n": 2}],
        # ~0.1-0.3 s a group: longer than a turn of the producer's loop, where leftovers are aborted
        engines={"count": 1, "sim": {"time_compression": 10, "median_tokens": 100, "speed_tps": 100}},
        rollout={"mode": "sync", "batch_size": 4},
        producer={"is_valid": "keep_all", "max_inflight": 8, "max_tokens": 300},
    )
    client = redis.Redis.from_url(redis_server.url)
    buffer = open_buffer(client, settings, "feeder")
    buffer.feed(prompts("math", 40))
    stop = threading.Event()
    errors: list[BaseException] = []
    outcomes: dict[str, int] = {}

    def serve() -> None:
        async def main() -> None:
            producer = build_producer(client, settings, name="p1")
            done = asyncio.Event()
            running = asyncio.create_task(producer.run(done))
            await asyncio.to_thread(stop.wait)
            done.set()
            outcomes.update((await running).outcomes)

        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        wait_for(lambda: buffer.accepted("math") >= 4, timeout=30)  # step 1's batch: the producer stops
        coordinator = create_coordinator(settings, client=client)
        coordinator.submit_batch("ev", prompts("math", 3, start=100), kind="eval")
        result = coordinator.finalize_eval_batch("ev", timeout=30)
        assert result["finished_task_count"] == 3
        assert result["metrics"]["eval/ev/finished_task_count"] == 3
        assert buffer.accepted("math") == 4  # no training work admitted beyond the batch meanwhile
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
    # each group generated once: no eval request was aborted as a leftover of the train batch
    assert outcomes == {"completed": 4 + 3}
