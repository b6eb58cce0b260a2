"""A producer's completed groups written together: one settle for the groups that finish
in one turn of the event loop, each caller still told about its own group."""

from __future__ import annotations

import asyncio

import pytest
import redis

from rollstream.producer.completions import Completions
from rollstream.shared.errors import ReplayBufferError
from rollstream.shared.records import Status
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts

pytestmark = pytest.mark.integration


def test_groups_finishing_together_share_one_settle(real_buffer: BufferFactory) -> None:
    buffer, trainer = real_buffer("p"), real_buffer("trainer")
    buffer.feed(prompts("math", 5))
    claims = buffer.claim("math", 5)
    completions = Completions(buffer)

    async def main() -> list[str | None]:
        return await asyncio.gather(*(completions.complete(c, group_for(c.prompt)) for c in claims))

    ids = asyncio.run(main())
    assert completions.flushes == 1
    assert None not in ids and len(set(ids)) == 5
    batch = trainer.read_batch("math", 10)
    assert [item.entry.id for item in batch.items] == ids
    assert [g.prompt.uid for g in batch.groups] == [c.prompt.uid for c in claims]


def test_one_bad_group_fails_alone(real_buffer: BufferFactory) -> None:
    buffer = real_buffer("p")
    buffer.feed(prompts("math", 3))
    claims = buffer.claim("math", 3)
    groups = [group_for(c.prompt) for c in claims]
    groups[1].status = Status.FILTERED  # not a completed group: complete refuses it
    completions = Completions(buffer)

    async def main() -> list[object]:
        calls = (completions.complete(c, g) for c, g in zip(claims, groups, strict=True))
        return await asyncio.gather(*calls, return_exceptions=True)

    first, bad, third = asyncio.run(main())
    assert isinstance(bad, ReplayBufferError) and "filtered" in str(bad)
    assert isinstance(first, str) and isinstance(third, str)
    assert buffer.accepted("math") == 2
    assert buffer.running("math") == 1  # the bad one's claim stays pending: reclaimed later


def test_redis_down_fails_every_waiter_without_retrying_each(real_buffer: BufferFactory) -> None:
    buffer = real_buffer("p")
    buffer.feed(prompts("math", 3))
    claims = buffer.claim("math", 3)
    calls: list[int] = []

    def unreachable(done: list[object]) -> list[str | None]:
        calls.append(len(done))
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1")

    buffer.complete_many = unreachable  # type: ignore[assignment, method-assign]
    completions = Completions(buffer)

    async def main() -> list[object]:
        calls_ = (completions.complete(c, group_for(c.prompt)) for c in claims)
        return await asyncio.gather(*calls_, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert all(isinstance(o, redis.ConnectionError) for o in outcomes)
    assert calls == [3]  # one attempt for the batch, not one more per group
