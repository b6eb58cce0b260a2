"""The batch coordinator with a producer (sim engines in this process) serving it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from rollstream.consumer.assembly import create_coordinator
from rollstream.consumer.coordinator import BatchCoordinator
from rollstream.producer.assembly import build_producer
from rollstream.shared.buffer_types import Claim
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import BatchTimeout, ReplayBufferError
from rollstream.shared.keys import PRODUCERS
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings
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


class BackgroundProducer:
    """A producer in a thread of its own, with the uids it claimed in the order it claimed
    them. A crash is kept and raised by ``check`` and ``stop``: reported as the crash, not
    as a batch that never finished."""

    def __init__(self, server: EmbeddedRedis, settings: Settings) -> None:
        self.server = server
        self.settings = settings
        self.claimed: list[str] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="producer")

    def start(self) -> BackgroundProducer:
        self._thread.start()
        return self

    def check(self) -> bool:
        if self.error is not None:
            raise AssertionError(f"the producer crashed: {self.error!r}") from self.error
        return True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the producer did not stop"
        self.check()

    def _serve(self) -> None:
        async def main() -> None:
            client = redis.Redis.from_url(self.server.url)
            producer = build_producer(client, self.settings, name="p1")
            claim = producer.buffer.claim

            def recorded(*args: Any, **kwargs: Any) -> list[Claim]:
                claims = claim(*args, **kwargs)
                self.claimed.extend(c.prompt.uid for c in claims)
                return claims

            producer.buffer.claim = recorded  # type: ignore[method-assign]
            done = asyncio.Event()
            task = asyncio.create_task(producer.run(done))
            stopping = asyncio.create_task(asyncio.to_thread(self._stop.wait))
            await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
            done.set()
            try:
                await task
            except BaseException as exc:
                self.error = exc  # now, not once the test's stop lets asyncio.run return

        try:
            asyncio.run(main())
        except BaseException as exc:  # the producer could not even start
            self.error = exc


@pytest.fixture
def start_producer(redis_server: EmbeddedRedis, run_name: str) -> Iterator[Callable[[], BackgroundProducer]]:
    """Starts a producer for the rest of the test; it is stopped, and its crash raised, after."""
    started: list[BackgroundProducer] = []

    def start() -> BackgroundProducer:
        started.append(BackgroundProducer(redis_server, coordinator_settings(redis_server, run_name)).start())
        return started[-1]

    yield start
    for producer in started:
        producer.stop()


@pytest.fixture
def producing(start_producer: Callable[[], BackgroundProducer]) -> Settings:
    """A producer running in a background thread for the test's duration."""
    return start_producer().settings


def coordinator(server: EmbeddedRedis, settings: Settings) -> BatchCoordinator:
    return create_coordinator(settings, client=redis.Redis.from_url(server.url))


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


def test_eval_batch_goes_ahead_and_reports_metrics(
    redis_server: EmbeddedRedis, run_name: str, start_producer: Callable[[], BackgroundProducer]
) -> None:
    coord = coordinator(redis_server, coordinator_settings(redis_server, run_name))
    coord.submit_batch("train-big", prompts("math", 200))
    coord.submit_batch("gsm", prompts("math", 5, start=500), kind="eval")
    producer = start_producer()  # both batches wait for it
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
    # served first: the producer's first claims are the eval prompts, fed after the train batch
    assert sorted(producer.claimed[:5]) == [f"gsm/u{i}" for i in range(500, 505)]
    aborted = coord.abort_batch("train-big", "not needed")
    assert aborted["status"] == "aborted"
    # nothing of the aborted batch is left for a producer to claim (the stream first: a
    # claim in between then counts as claimed, never as left)
    stream = coord.keys.prompts("math")
    entries = coord.client.xrange(stream)
    pending = {p["message_id"] for p in coord.client.xpending_range(stream, PRODUCERS, "-", "+", 1000)}
    assert [i for i, f in entries if f[b"uid"].startswith(b"train-big/") and i not in pending] == []


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
    worker = open_buffer(coord.client, settings, "hand")
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


@pytest.mark.parametrize("kind", ["eval", "train"])
def test_a_batch_whose_prompt_went_to_the_dead_letters_finalizes_without_it(
    redis_server: EmbeddedRedis, run_name: str, kind: str
) -> None:
    """A prompt delivered max_attempts times (or undecodable) is dead-lettered: no result
    will ever come for it. Finalizing with no timeout (what the evaluator does) waited for
    it for ever; it is settled, and the result says how many went. Prompts not yet claimed
    when the rest settled would be removed; here every one was claimed."""
    settings = coordinator_settings(redis_server, run_name)
    coord = coordinator(redis_server, settings)
    coord.submit_batch("b9", prompts("math", 3), kind=kind)
    worker = open_buffer(coord.client, settings, "hand")
    claims = worker.claim("math", 3)
    assert len(claims) == 3
    for claim in claims[:2]:
        worker.complete(claim, group_for(claim.prompt))
    assert worker.dead_letter(claims[2].entry, "delivered 4 times")
    finalize = coord.finalize_eval_batch if kind == "eval" else coord.finalize_train_batch
    result = finalize("b9", timeout=None)
    assert result["status"] == "finalized" and result["dead_prompts"] == 1
    assert result["finished_task_count"] == 2
    # min_wait_num counts what can still come: with one of two dead, one result finalizes
    coord.submit_batch("b10", prompts("math", 2, start=10), kind=kind, min_wait_num=2)
    (first, second) = worker.claim("math", 2)
    worker.complete(first, group_for(first.prompt))
    worker.dead_letter(second.entry, "undecodable")
    result = finalize("b10", timeout=5.0)
    assert (result["finished_task_count"], result["dead_prompts"]) == (1, 1)
