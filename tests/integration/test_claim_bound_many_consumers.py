"""The admission bound with many producers holding claims, on real servers (7.x and 6.2).

The bounded claim counts what is running from the group's pending total in XINFO GROUPS
(O(groups)) instead of XPENDING's summary form, which lists every consumer (issue 26):
the count must stay the group's own, with 64 consumers holding entries in all three pools
and another group reading the prompts stream beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import PRODUCERS
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.scripts import CLAIM_BOUNDED
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts

pytestmark = pytest.mark.integration

PRODUCER_COUNT = 64
POOLS = ("aborted", "expired", "prompts")


@pytest.fixture(params=["redis-server", "redis-6.2"])
def server(request: pytest.FixtureRequest) -> EmbeddedRedis:
    name = "redis_server" if request.param == "redis-server" else "redis62_server"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


@pytest.fixture
def make(server: EmbeddedRedis, make_settings: SettingsFactory) -> Iterator[Callable[[str], ReplayBuffer]]:
    settings = make_settings(server.url, buffer={"claim_idle_ms": 60_000})
    client = connect(settings.redis)  # one connection for every producer: 64 would crowd 2 cores

    def buffer(consumer: str) -> ReplayBuffer:
        return open_buffer(client, settings, consumer)

    yield buffer
    client.close()


def summed_xpending(buffer: ReplayBuffer, task: str) -> int:
    """The producers group's pending entries in the pools, the way the script counted before."""
    streams = (buffer.keys.aborted(task), buffer.keys.expired(task), buffer.keys.prompts(task))
    return sum(int(buffer.client.xpending(s, PRODUCERS)["pending"]) for s in streams)


def test_the_bound_holds_with_64_producers_holding_claims_in_every_pool(
    make: Callable[[str], ReplayBuffer],
) -> None:
    feeder, trainer = make("feeder"), make("trainer")
    feeder.feed(prompts("math", 300))
    prompts_key = feeder.keys.prompts("math")
    # another group on the prompts stream with entries of its own pending: not the producers'
    feeder.client.xgroup_create(prompts_key, "bystander", id="0")
    feeder.client.xreadgroup("bystander", "b1", {prompts_key: ">"}, count=50)

    producers = [make(f"p{i}") for i in range(PRODUCER_COUNT)]
    held = {p.consumer: p.claim("math", 2, limit=1000) for p in producers}
    assert all(len(claims) == 2 for claims in held.values())
    for p in producers[:10]:  # accepted 10
        claim = held[p.consumer].pop()
        assert p.complete(claim, group_for(claim.prompt)) is not None
    for item in trainer.read_batch("math", 3).items:  # 3 of them expire: accepted 7
        assert trainer.expire(item) is not None
    for p in producers[10:15]:  # 5 go back to the aborted pool
        claim = held[p.consumer].pop()
        assert p.abort(claim, group_for(claim.prompt, n=1).samples) is not None
    # other producers take the aborted and expired work: pending in all three pools
    taken = [c for p in producers[20:25] for c in p.claim("math", 2, include_expired=True, limit=1000)]
    assert sorted(c.source for c in taken) == ["aborted"] * 5 + ["expired"] * 3 + ["prompts"] * 2

    for pool, key in zip(
        POOLS, (feeder.keys.aborted("math"), feeder.keys.expired("math"), prompts_key), strict=True
    ):
        assert int(feeder.client.xpending(key, PRODUCERS)["pending"]) > 0, pool
    assert len(feeder.client.xinfo_consumers(prompts_key, PRODUCERS)) >= PRODUCER_COUNT
    running = summed_xpending(feeder, "math")
    assert running == 2 * PRODUCER_COUNT - 10 - 5 + 10  # 128 claimed, 10 settled, 5 aborted, 10 taken
    assert feeder.running("math") == running  # XINFO GROUPS' total, the bystander's not in it
    admitted = feeder.accepted("math") + running
    assert admitted == 7 + running == feeder.admitted("math")

    late = make("late")
    assert late.claim("math", 10, limit=admitted) == []  # at the bound: nothing, the bystander ignored
    assert [c.source for c in late.claim("math", 10, limit=admitted + 3)] == ["prompts"] * 3
    assert summed_xpending(feeder, "math") == running + 3 == late.running("math")
    assert late.claim("math", 10, limit=admitted + 3) == []


def test_a_pool_without_the_producers_group_still_fails_the_bounded_claim(
    server: EmbeddedRedis,
) -> None:
    client = redis.Redis.from_url(server.url)
    try:
        for key in ("nogroup:a", "nogroup:e", "nogroup:p"):
            client.xadd(key, {"x": "1"})
        client.xgroup_create("nogroup:p", PRODUCERS, id="0")
        keys = ["nogroup:a", "nogroup:e", "nogroup:p", "nogroup:progress"]
        args = [PRODUCERS, "p1", 5, 10, "1", "math:completed"]
        script = client.register_script(CLAIM_BOUNDED)
        with pytest.raises(redis.ResponseError, match="NOGROUP"):
            script(keys=keys, args=args)
        client.delete("nogroup:a")  # no stream at all: the same error XPENDING gave
        with pytest.raises(redis.ResponseError, match="NOGROUP"):
            script(keys=keys, args=args)
    finally:
        client.delete(*(f"nogroup:{k}" for k in ("a", "e", "p", "progress")))
        client.close()


def test_running_of_a_task_whose_stream_is_gone_fails_as_before(make: Callable[[str], ReplayBuffer]) -> None:
    buffer = make("p1")
    buffer.feed(prompts("math", 2))
    assert buffer.running("math") == 0
    buffer.client.delete(buffer.keys.expired("math"))
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        buffer.running("math")
