"""A finalization outlives the process doing it: a batch whose finalizer died is taken over
once its lease runs out, while a live finalizer keeps its lease and others wait for it."""

from __future__ import annotations

import threading
import time
from typing import Any

import orjson
import pytest
import redis

from rollstream.consumer.assembly import create_coordinator
from rollstream.consumer.coordinator import BatchCoordinator
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import BatchTimeout
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(redis_server: EmbeddedRedis, make_settings: SettingsFactory) -> Settings:
    # groups a dead finalizer had read come back to the next one after claim_idle_ms
    return make_settings(redis_server.url, buffer={"claim_idle_ms": 300, "max_attempts": 3, "block_ms": 100})


def coordinator(server: EmbeddedRedis, settings: Settings, name: str, **kwargs: Any) -> BatchCoordinator:
    return create_coordinator(settings, client=redis.Redis.from_url(server.url), consumer=name, **kwargs)


def finish(client: redis.Redis, settings: Settings, count: int) -> None:
    """``count`` of the batch's prompts generated, as a producer would."""
    worker = open_buffer(client, settings, "hand")
    for claim in worker.claim("math", count):
        worker.complete(claim, group_for(claim.prompt))


def in_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


@pytest.mark.timeout(20)
def test_a_batch_whose_finalizer_died_is_taken_over(redis_server: EmbeddedRedis, settings: Settings) -> None:
    coord = coordinator(redis_server, settings, "trainer-b")
    coord.submit_batch("b1", prompts("math", 3))
    finish(coord.client, settings, 3)
    # what a finalizer killed mid-finalize leaves: the batch FINALIZING under its lease,
    # and the groups it had read pending on its consumer, never handed over
    dead = coordinator(redis_server, settings, "trainer-a")
    assert len(dead.buffer.read_batch("math", 10)) == 3
    seconds, micros = coord.client.time()
    lease_until = seconds * 1000 + micros // 1000 + 500
    key = coord.keys.batch("b1")
    coord.client.hset(
        key, mapping={"status": "finalizing", "owner": "trainer-a-1", "lease_until": lease_until}
    )

    started = time.monotonic()
    result = coord.finalize_train_batch("b1", timeout=10)
    took = time.monotonic() - started
    assert result["status"] == "finalized" and result["finished_task_count"] == 3
    assert sorted(result["group_ids"]) == sorted(f"math:b1/u{i}" for i in range(3))
    assert 0.4 < took < 10  # after the dead one's lease, not at once and not never
    assert coord.client.hmget(key, "status", "owner") == [b"finalized", None]
    assert coord.client.xlen(coord.keys.groups("math")) == 0  # handed over: acked and deleted
    assert coord.finalize_train_batch("b1") == result  # idempotent


@pytest.mark.timeout(20)
def test_a_live_finalizer_keeps_its_batch_and_a_waiter_honours_its_timeout(
    redis_server: EmbeddedRedis, real_client: redis.Redis, settings: Settings
) -> None:
    first = coordinator(redis_server, settings, "trainer-a", lease_s=0.5)
    second = coordinator(redis_server, settings, "trainer-b", lease_s=0.5)
    first.submit_batch("b2", prompts("math", 2))
    thread, out = in_thread(lambda: first.finalize_train_batch("b2"))
    wait_for(lambda: real_client.hget(first.keys.batch("b2"), "owner"))
    # a wait of several leases: the finalizer renews its lease, so nobody takes over
    with pytest.raises(BatchTimeout, match=r"no result after 1\.5 s; trainer-a-\S+ is still finalizing it"):
        second.finalize_train_batch("b2", timeout=1.5)
    finish(real_client, settings, 2)
    thread.join(timeout=10)
    assert not thread.is_alive()
    (result,) = out
    assert result["finished_task_count"] == 2
    assert second.finalize_train_batch("b2", timeout=1.0) == result


@pytest.mark.timeout(20)
def test_a_finalizer_that_lost_its_lease_hands_nothing_over(
    redis_server: EmbeddedRedis, real_client: redis.Redis, settings: Settings
) -> None:
    slow = coordinator(redis_server, settings, "trainer-a", lease_s=0.3)
    slow.submit_batch("b3", prompts("math", 3))
    finish(real_client, settings, 2)
    key = slow.keys.batch("b3")
    thread, out = in_thread(lambda: slow.finalize_train_batch("b3"))
    wait_for(lambda: len(slow._held.get("b3", [])) == 2)  # read, waiting for the third
    seconds, _ = real_client.time()
    # as if it had stalled past its lease and another caller had taken over
    real_client.hset(key, mapping={"owner": "trainer-b-1", "lease_until": (seconds + 60) * 1000})
    wait_for(lambda: "b3" not in slow._held)  # it let go of what it had read
    finish(real_client, settings, 1)
    theirs = {"batch_id": "b3", "status": "finalized", "finished_task_count": 3}
    real_client.hset(key, mapping={"status": "finalized", "result": orjson.dumps(theirs)})
    thread.join(timeout=10)
    assert out == [theirs]
    groups = slow.keys.groups("math")
    assert real_client.xlen(groups) == 3  # nothing acked away under a lost lease
    assert real_client.xpending(groups, "trainer")["pending"] == 2  # for the new owner to reclaim
