"""The batch coordinator with a producer (sim engines in this process) serving it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import redis

from consumer.coordinator import BatchCoordinator
from producer.pool import LocalPool
from producer.worker import Producer
from shared.embedded import EmbeddedRedis
from shared.errors import BatchTimeout, ReplayBufferError
from shared.settings import Settings, load_settings
from tests.helpers import group_for, prompts

pytestmark = pytest.mark.integration


def coordinator_settings(server: EmbeddedRedis, run: str) -> Settings:
    return load_settings(
        run=run,
        redis={"url": server.url},
        tasks=[{"name": "math", "n": 4}],
        engines={"count": 2, "sim": {"time_compression": 50.0, "median_tokens": 100}},
        rollout={"batch_size": 1000},
        producer={"is_valid": "keep_all", "max_inflight": 8},
    )


@pytest.fixture
def producing(redis_server: EmbeddedRedis, run_name: str) -> Iterator[Settings]:
    """A producer running in a background thread for the test's duration."""
    settings = coordinator_settings(redis_server, run_name)
    stop = threading.Event()

    def serve() -> None:
        async def main() -> None:
            done = asyncio.Event()
            producer = Producer(
                settings, redis.Redis.from_url(redis_server.url), LocalPool.start(settings), "p1"
            )
            task = asyncio.create_task(producer.run(done))
            await asyncio.to_thread(stop.wait)
            done.set()
            await task

        asyncio.run(main())

    thread = threading.Thread(target=serve)
    thread.start()
    yield settings
    stop.set()
    thread.join(timeout=30)


def coordinator(server: EmbeddedRedis, settings: Settings) -> BatchCoordinator:
    return BatchCoordinator(redis.Redis.from_url(server.url), settings)


def test_train_batch_lifecycle(redis_server: EmbeddedRedis, producing: Settings) -> None:
    coord = coordinator(redis_server, producing)
    assert coord.submit_batch("b1", prompts("math", 6)) == 6
    assert coord._status("b1") == "running"
    with pytest.raises(ReplayBufferError, match="still running"):
        coord.submit_batch("b1", prompts("math", 1))
    result = coord.finalize_train_batch("b1", timeout=30)
    assert result["status"] == "finalized" and result["finished_task_count"] == 6
    assert sorted(result["group_ids"]) == sorted(f"math:b1/u{i}" for i in range(6))
    assert coord.finalize_train_batch("b1") == result  # idempotent
    assert coord.client.xlen(coord.keys.groups("math")) == 0  # handed over: acked and deleted
    assert coord.submit_batch("b1", prompts("math", 1, start=10)) == 1  # a finished id may be reused


def test_concurrent_finalizes_return_one_identical_result(
    redis_server: EmbeddedRedis, producing: Settings
) -> None:
    coord = coordinator(redis_server, producing)
    coord.submit_batch("b2", prompts("math", 4))
    results: list[dict] = []  # type: ignore[type-arg]
    threads = [
        threading.Thread(
            target=lambda: results.append(coordinator(redis_server, producing).finalize_train_batch("b2", 30))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and results[0] == results[1] == results[2]
    assert results[0]["finished_task_count"] == 4


def test_eval_batch_goes_ahead_and_reports_metrics(redis_server: EmbeddedRedis, producing: Settings) -> None:
    coord = coordinator(redis_server, producing)
    coord.submit_batch("train-big", prompts("math", 200))
    coord.submit_batch("gsm", prompts("math", 5, start=500), kind="eval")
    result = coord.finalize_eval_batch("gsm", timeout=30)
    assert result["finished_task_count"] == 5
    metrics = result["metrics"]
    assert metrics["eval/gsm/finished_task_count"] == 5
    assert (
        0
        <= metrics["eval/gsm/score/worst@2"]
        <= metrics["eval/gsm/score/mean@4"]
        <= metrics["eval/gsm/score/best@2"]
    )
    # served first: most of the big train batch is still waiting
    assert coord.client.xlen(coord.keys.prompts("math")) > 100
    aborted = coord.abort_batch("train-big", "not needed")
    assert aborted["status"] == "aborted" and aborted["removed_prompts"] > 100


def test_abort_cleans_the_pending_prompts(redis_server: EmbeddedRedis, run_name: str) -> None:
    settings = coordinator_settings(redis_server, run_name)
    coord = coordinator(redis_server, settings)
    coord.submit_batch("b3", prompts("math", 20))
    result = coord.abort_batch("b3", "changed my mind", keep_partial_results=True)
    assert result == {**result, "status": "aborted", "reason": "changed my mind", "removed_prompts": 20}
    assert coord.client.xlen(coord.keys.prompts("math")) == 0
    with pytest.raises(ReplayBufferError, match="aborted"):
        coord.abort_batch("b3", "again")


def test_finalize_with_a_timeout_honours_min_wait_num(redis_server: EmbeddedRedis, run_name: str) -> None:
    settings = coordinator_settings(redis_server, run_name)
    coord = coordinator(redis_server, settings)
    coord.submit_batch("b4", prompts("math", 10), min_wait_num=3)
    worker = coord.buffer.__class__(coord.client, settings, "hand")
    for claim in worker.claim("math", 2):  # only two finish in time
        worker.complete(claim, group_for(claim.prompt))
    with pytest.raises(BatchTimeout, match=r"2 of 10 results after 0\.3 s, fewer than min_wait_num 3"):
        coord.finalize_train_batch("b4", timeout=0.3)
    (claim,) = worker.claim("math", 1)
    worker.complete(claim, group_for(claim.prompt))
    result = coord.finalize_train_batch("b4", timeout=0.3)
    assert result["finished_task_count"] == 3
    assert result["removed_prompts"] == 7  # the rest is cleaned up
    assert coord.client.xlen(coord.keys.prompts("math")) == 0
