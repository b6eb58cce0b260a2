"""A producer's lifecycle on a real redis-server: what a restarted producer takes back
from a dead one, and what keeps it alive while its event loop is busy."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from rollstream.producer.pool import LocalPool
from rollstream.producer.worker import Producer
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import EXPIRED, PRODUCERS
from tests.helpers import prompts, wait_idle
from tests.integration.test_producer import settings_for

pytestmark = pytest.mark.integration


def make(redis_server: EmbeddedRedis, run_name: str, name: str = "p1", **overrides: Any) -> Producer:
    settings = settings_for(redis_server.url, run_name, **overrides)
    return Producer(settings, redis.Redis.from_url(redis_server.url), LocalPool.start(settings), name)


@pytest.mark.timeout(60)
def test_a_restarted_producer_takes_back_a_dead_ones_claims_from_the_expired_pool(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    # tail-batch mode at 8: the expired pool goes first once 8 prompts wait there
    overrides: dict[str, Any] = {"rollout": {"tail_batch_trigger_size": 8}, "buffer": {"claim_idle_ms": 200}}
    producer = make(redis_server, run_name, "restarted", **overrides)
    keys = producer.buffer.keys
    # Given a producer in tail mode that claimed the 5 prompts of the expired pool, then died
    dead = ReplayBuffer(redis.Redis.from_url(redis_server.url), producer.settings, "dead")
    dead.feed(prompts("math", 5), pool=EXPIRED)
    assert len(dead.claim("math", 5, include_expired=True)) == 5
    wait_idle(producer.buffer.client, keys.expired("math"), PRODUCERS, 200)
    # When a producer that is not in tail mode (5 waiting < 8, as after a restart) admits work
    claims = producer.admit()
    # Then it takes the dead producer's claims back (before the fix: never, and they counted
    # as running for ever, holding the admission bound)
    assert sorted(c.prompt.uid for c in claims) == [f"u{i}" for i in range(5)]
    assert {c.entry.kind for c in claims} == {EXPIRED}
    assert not producer._tail["math"]
