"""Delivery corners on a real redis-server: a settle that Redis refuses (out of memory),
a claim or a settle whose reply is lost, a trainer that holds its groups long, an entry
moved to the dead letters by hand."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import RedisOutOfMemory
from rollstream.shared.keys import PRODUCERS, Count, progress_field
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts

pytestmark = pytest.mark.integration

IDLE_MS = 400


@pytest.fixture
def make(redis_server: EmbeddedRedis, make_settings: SettingsFactory) -> Iterator:  # type: ignore[type-arg]
    clients: list[redis.Redis] = []

    def buffer(consumer: str, **buffer_overrides: object) -> ReplayBuffer:
        knobs = {"claim_idle_ms": IDLE_MS, "max_attempts": 3, **buffer_overrides}
        settings = make_settings(redis_server.url, buffer=knobs)
        client = connect(settings.redis)
        clients.append(client)
        return ReplayBuffer(client, settings, consumer)

    yield buffer
    for client in clients:
        client.close()


def counter(buffer: ReplayBuffer, task: str, count: Count) -> int:
    value = buffer.client.hget(buffer.keys.progress, progress_field(task, count))
    return int(value or 0)


def test_settle_refused_for_memory_is_one_clear_error_and_loses_nothing(
    make, redis_server: EmbeddedRedis
) -> None:  # type: ignore[no-untyped-def]
    producer = make("p1")
    producer.feed(prompts("math", 1))
    [claim] = producer.claim("math")
    admin = redis.Redis.from_url(redis_server.url)
    saved = admin.config_get("maxmemory*")
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # below what the server uses: every write refused
        with pytest.raises(RedisOutOfMemory, match=r"out of memory.*maxmemory"):
            producer.complete(claim, group_for(claim.prompt))
    finally:
        admin.config_set("maxmemory", saved["maxmemory"])
        admin.config_set("maxmemory-policy", saved["maxmemory-policy"])
        admin.close()
    # nothing written, the claim still this producer's: it settles once Redis has room
    assert producer.client.xlen(producer.keys.groups("math")) == 0
    assert producer.client.xpending(producer.keys.prompts("math"), PRODUCERS)["pending"] == 1
    assert producer.complete(claim, group_for(claim.prompt)) is not None
    assert producer.client.xlen(producer.keys.groups("math")) == 1
    assert counter(producer, "math", Count.COMPLETED) == 1
