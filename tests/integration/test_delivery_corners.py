"""Delivery corners on a real redis-server: a settle that Redis refuses (out of memory),
a claim or a settle whose reply is lost, a trainer that holds its groups long, an entry
moved to the dead letters by hand."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from rollstream.consumer.assembly import create_reader
from rollstream.producer.assembly import build_producer
from rollstream.shared import codec
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import Batch
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import FeederError, FormatError, RedisOutOfMemory
from rollstream.shared.keys import GROUPS, PRODUCERS, TRAINER, Count, Keys, progress_field
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings
from rollstream.shared.streams import SETTLE_RESENDS, text
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts, wait_for, wait_for_async, wait_idle

pytestmark = pytest.mark.integration

IDLE_MS = 400
HOLD_IDLE_MS = 1000  # the holder touches every third of it: room for a loaded machine


@pytest.fixture
def make(redis_server: EmbeddedRedis, make_settings: SettingsFactory) -> Iterator:  # type: ignore[type-arg]
    clients: list[redis.Redis] = []

    def buffer(consumer: str, **buffer_overrides: object) -> ReplayBuffer:
        knobs = {"claim_idle_ms": IDLE_MS, "max_attempts": 3, **buffer_overrides}
        settings = make_settings(redis_server.url, buffer=knobs)
        client = connect(settings.redis)
        clients.append(client)
        return open_buffer(client, settings, consumer)

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


def _lose_reply_once(client: redis.Redis, lost: Callable[[Any], bool]) -> list[Any]:
    """Make the client lose the reply of the first command whose reply ``lost`` picks, as
    a dropped connection would, after Redis ran it: the client's outage retry sends the
    command again. Returns the replies lost (one, once it happened)."""
    original = client.parse_response
    dropped: list[Any] = []

    def parse_response(connection: Any, command_name: Any, **options: Any) -> Any:
        reply = original(connection, command_name, **options)
        if not dropped and lost(reply):
            dropped.append(reply)
            connection.disconnect()
            raise redis.ConnectionError("connection lost (test)")
        return reply

    client.parse_response = parse_response  # type: ignore[method-assign]
    return dropped


def _settled_once(buffer: ReplayBuffer, task: str) -> None:
    """The task's one prompt completed exactly once, nothing pending anywhere."""
    assert buffer.client.xlen(buffer.keys.groups(task)) == 1
    assert counter(buffer, task, Count.COMPLETED) == 1
    assert buffer.client.xlen(buffer.keys.prompts(task)) == 0
    assert buffer.client.xpending(buffer.keys.prompts(task), PRODUCERS)["pending"] == 0


def test_a_lone_producer_takes_back_a_claim_whose_reply_was_lost(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p1")
    producer.feed(prompts("math", 1))
    # the bounded claim's reply ({stream, id, fields} per entry) is lost after Redis ran it
    lost = _lose_reply_once(
        producer.client, lambda r: isinstance(r, list) and r and isinstance(r[0], list) and len(r[0]) == 3
    )
    assert producer.claim("math", limit=100) == []  # the retry found nothing new
    assert lost, "the claim's reply was not lost: the test does not test what it says"
    stream = producer.keys.prompts("math")
    assert producer.client.xpending(stream, PRODUCERS)["pending"] == 1  # pending, unknown to it
    wait_idle(producer.client, stream, PRODUCERS, IDLE_MS)
    [claim] = wait_for(lambda: producer.claim("math", limit=100))
    assert claim.entry.deliveries == 2
    assert producer.complete(claim, group_for(claim.prompt)) is not None
    _settled_once(producer, "math")


def _break_settles(producer: ReplayBuffer, *, times: int, applied: bool = False) -> None:
    """The next ``times`` settle round trips end on a dropped connection: before Redis got
    them, or (``applied``) after it ran them, the reply lost."""
    original = producer.streams.round_trip
    left = [times]

    def blip(commands: list[Any]) -> list[Any]:
        if left[0] <= 0:
            return original(commands)
        left[0] -= 1
        if applied:
            original(commands)  # the settle ran, its reply did not come back
        raise redis.ConnectionError("connection lost (test)")

    producer.streams.round_trip = blip  # type: ignore[method-assign]


def test_a_settle_whose_connection_dropped_before_redis_is_sent_again(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p1")
    producer.feed(prompts("math", 1))
    [claim] = producer.claim("math", limit=100)
    _break_settles(producer, times=1)
    assert producer.complete(claim, group_for(claim.prompt)) is not None  # checked, then sent again
    _settled_once(producer, "math")


def test_a_settle_whose_reply_was_lost_is_not_sent_again(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p1")
    producer.feed(prompts("math", 1))
    [claim] = producer.claim("math", limit=100)
    _break_settles(producer, times=1, applied=True)
    with pytest.raises(redis.ConnectionError):  # it ran: nothing pending for it any more
        producer.complete(claim, group_for(claim.prompt))
    assert producer.claim("math", limit=100) == []
    _settled_once(producer, "math")


def test_a_lone_producer_takes_back_a_claim_whose_settle_failed(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p1")
    producer.feed(prompts("math", 1))
    [claim] = producer.claim("math", limit=100)
    _break_settles(producer, times=100)  # longer than the settle's own re-sends
    with pytest.raises(redis.ConnectionError):
        producer.complete(claim, group_for(claim.prompt))
    del producer.streams.round_trip  # Redis answers settles again
    stream = producer.keys.prompts("math")
    wait_idle(producer.client, stream, PRODUCERS, IDLE_MS)
    [again] = wait_for(lambda: producer.claim("math", limit=100))
    assert again.entry.id == claim.entry.id
    assert producer.complete(again, group_for(again.prompt)) is not None
    _settled_once(producer, "math")


def test_a_held_claim_is_never_taken_back_by_its_own_producer(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p1")
    producer.feed(prompts("math", 2))
    [held] = producer.claim("math", limit=100)
    wait_idle(producer.client, producer.keys.prompts("math"), PRODUCERS, IDLE_MS)  # not touched
    [other] = producer.claim("math", 2, limit=100)  # the second prompt, not the held one again
    assert other.entry.id != held.entry.id
    assert producer.reclaim("prompts", "math", 10, force=True) == []


def test_a_trainer_takes_back_groups_whose_read_reply_was_lost(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p1")
    producer.feed(prompts("math", 1))
    [claim] = producer.claim("math", limit=100)
    producer.complete(claim, group_for(claim.prompt))
    trainer = make("trainer")
    assert len(trainer.read_batch("math", 0)) == 0
    trainer._recover_from["math"] = "done"  # a trainer past its start-up re-read
    # XREADGROUP's reply, [[stream, [entry, ...]]], lost after Redis delivered the entry
    lost = _lose_reply_once(
        trainer.client, lambda r: isinstance(r, list) and r and isinstance(r[0], list) and r[0][1]
    )
    assert len(trainer.read_batch("math", 1)) == 0  # the read's reply was lost, the retry got nothing
    assert lost
    stream = trainer.keys.groups("math")
    wait_idle(trainer.client, stream, TRAINER, IDLE_MS)
    batch = wait_for(lambda: trainer.read_batch("math", 1).items)
    assert [item.group.group_id for item in batch] == ["math:u0"]
    batch_ = Batch("math", batch)
    assert trainer.commit(batch_) == []
    assert trainer.client.xpending(stream, TRAINER)["pending"] == 0


def _holding_settings(redis_server: EmbeddedRedis, make_settings: SettingsFactory) -> Settings:
    """Batches of 2 groups of one task, held past claim_idle_ms by a trainer's keeper."""
    return make_settings(
        redis_server.url,
        tasks=[{"name": "math", "n": 4}],
        rollout={"batch_size": 2},
        buffer={"claim_idle_ms": HOLD_IDLE_MS, "max_attempts": 3, "block_ms": 100},
    )


def _complete_groups(client: redis.Redis, settings: Settings, count: int) -> None:
    """``count`` prompts fed, claimed and completed: ``count`` groups for the trainer."""
    producer = open_buffer(client, settings, "p1")
    producer.feed(prompts("math", count))
    for claim in producer.claim("math", count, limit=100):
        producer.complete(claim, group_for(claim.prompt))


def test_a_trainer_keeps_the_groups_it_holds_from_another_trainer_consumer(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory
) -> None:
    """A step (or a batch wait) longer than claim_idle_ms: the groups stay the holder's,
    refreshed while it holds them, and the other trainer-group consumer takes none."""
    settings = _holding_settings(redis_server, make_settings)
    client = connect(settings.redis)
    try:
        _complete_groups(client, settings, 2)
        holder = create_reader(settings, client=client, consumer="trainer-a")
        other = open_buffer(client, settings, "trainer-b")
        batch = holder.get_batch(1, timeout_s=5.0)
        assert len(batch) == 2
        started = time.monotonic()
        taken: list[str] = []

        def held_long_enough() -> bool:  # meanwhile the other consumer tries to take them
            taken.extend(e.id for e in other.reclaim(GROUPS, "math", 10, force=True))
            return time.monotonic() - started > 3 * HOLD_IDLE_MS / 1000

        wait_for(held_long_enough, timeout=30)
        assert taken == []
        assert batch.commit() == []  # every group still the holder's: trained once
        assert client.xpending(Keys(settings.run).groups("math"), TRAINER)["pending"] == 0
        holder.close()
    finally:
        client.close()


def test_a_trainer_says_groups_were_taken_over_only_when_another_consumer_holds_them(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The keeper's touch finds groups no longer pending for this trainer. Acked ones come
    from a commit of its own that ended between the keeper's look at what it holds and
    its touch (seen in a benchmark as a warning that another trainer had them): they are
    let go without a word. Only groups another consumer holds are said to be taken over."""
    settings = _holding_settings(redis_server, make_settings)
    client = connect(settings.redis)
    stream = Keys(settings.run).groups("math")
    try:
        _complete_groups(client, settings, 4)
        holder = create_reader(settings, client=client, consumer="trainer-a")
        first = holder.get_batch(1, timeout_s=5.0)
        acked = [item.entry.id for item in first.batches["math"].items]
        client.xack(stream, TRAINER, *acked)  # a commit done in Redis, not yet forgotten here
        wait_for(lambda: not {e.id for e in holder.buffer.held(GROUPS)} & set(acked), timeout=10)
        assert "taken over" not in caplog.text
        second = holder.get_batch(2, timeout_s=5.0)
        taken = [item.entry.id for item in second.batches["math"].items]
        claimed = client.xclaim(stream, TRAINER, "trainer-b", 0, taken, justid=True)
        assert sorted(text(i) for i in claimed) == sorted(taken)
        wait_for(lambda: "taken over" in caplog.text, timeout=10)
        assert all(i in caplog.text for i in taken) and not any(i in caplog.text for i in acked)
        holder.close()
    finally:
        client.close()


def test_a_lone_producer_process_completes_a_prompt_whose_settle_failed_once_only(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    """The producer's own loop: a settle that fails for good (longer than its re-sends)
    leaves the claim pending under the live producer, the only one; its loop takes it
    back after claim_idle_ms and the prompt is completed exactly once."""
    settings = load_settings(
        run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}],
        buffer={"claim_idle_ms": IDLE_MS, "max_attempts": 3},
        engines={"count": 1, "sim": {"time_compression": 50.0, "median_tokens": 20, "sigma": 0.5}},
        rollout={"mode": "async", "batch_size": 4, "max_staleness": 0},
        producer={"max_tokens": 100, "is_valid": "keep_all", "heartbeat_s": 0.1, "max_inflight": 4},
    )  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    producer = build_producer(client, settings, name="p1")
    producer.buffer.feed(prompts("math", 1))
    _break_settles(producer.buffer, times=SETTLE_RESENDS + 1)  # the first settle fails for good
    keys = producer.buffer.keys

    async def main() -> None:
        stop = asyncio.Event()
        run = asyncio.create_task(producer.run(stop))
        try:
            await wait_for_async(lambda: client.xlen(keys.groups("math")) >= 1 or run.done(), timeout=30)
        finally:
            stop.set()
            await run

    asyncio.run(main())
    _settled_once(producer.buffer, "math")
    [(_, group)] = client.xrange(keys.groups("math"))
    assert group[b"group_id"] == b"math:u0" and group[b"attempt"] == b"2"  # its second delivery
    client.close()


def test_a_reader_that_goes_on_after_a_refused_format_gets_the_others_back(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p1")
    producer.ensure("math")
    future = dict(codec.encode_group(group_for(prompts("math", 1, start=9)[0])))
    future["format"] = "2.0"
    bad = producer.client.xadd(producer.keys.groups("math"), future).decode()  # type: ignore[arg-type]
    producer.feed(prompts("math", 1))
    [claim] = producer.claim("math", limit=100)
    producer.complete(claim, group_for(claim.prompt))
    trainer = make("trainer")
    with pytest.raises(FormatError, match=f"entry {bad}.*rollstream dead-letter groups:math {bad}"):
        trainer.read_batch("math", 2)
    # the good group read with it comes back once idle; the refused one is not read again
    wait_idle(trainer.client, trainer.keys.groups("math"), TRAINER, IDLE_MS)
    batch = wait_for(lambda: trainer.read_batch("math", 2).items)
    assert [item.group.group_id for item in batch] == ["math:u0"]
    assert trainer.reclaim(GROUPS, "math", 10, force=True) == []
    assert trainer.client.xlen(trainer.keys.dead) == 0


def test_a_lone_producer_takes_back_a_claim_whose_group_crashed(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    """A group that fails with an unexpected error (no settle at all) leaves its claim
    pending; the producer lets go of it and, alone, takes it back once idle."""
    settings = load_settings(
        run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}],
        buffer={"claim_idle_ms": IDLE_MS, "max_attempts": 3},
        engines={"count": 1, "sim": {"time_compression": 50.0, "median_tokens": 20, "sigma": 0.5}},
        rollout={"mode": "async", "batch_size": 4, "max_staleness": 0},
        producer={"max_tokens": 100, "is_valid": "keep_all", "heartbeat_s": 0.1, "max_inflight": 4},
    )  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    producer = build_producer(client, settings, name="p1")
    producer.buffer.feed(prompts("math", 1))
    score = producer.runner.score
    crashed: list[str] = []

    async def crash_once(group: Any) -> None:
        if not crashed:
            crashed.append(group.group_id)
            raise RuntimeError("a bug in a plug-in (test)")
        await score(group)

    producer.runner.score = crash_once  # type: ignore[method-assign]
    keys = producer.buffer.keys

    async def main() -> None:
        stop = asyncio.Event()
        run = asyncio.create_task(producer.run(stop))
        try:
            await wait_for_async(lambda: client.xlen(keys.groups("math")) >= 1 or run.done(), timeout=30)
        finally:
            stop.set()
            await run

    asyncio.run(main())
    assert crashed == ["math:u0"]
    _settled_once(producer.buffer, "math")
    client.close()


def test_a_feeder_cursor_write_whose_reply_was_lost_is_not_taken_for_another_feeder(
    make,
) -> None:  # type: ignore[no-untyped-def]
    """The script that appends a feeder's prompts and moves its cursor ran, its reply was
    lost, and the outage retry sent it again: the retry finds its own write (its token),
    answers what it appended, and writes nothing twice (it failed with a false 'another
    feeder running?', and the feeder exited)."""
    feeder = make("feeder")
    feeder.ensure("math")
    lost = _lose_reply_once(feeder.client, lambda r: r == 3)  # the script's reply: 3 appended
    assert feeder.feed_at_cursor("math", prompts("math", 3), "", "cursor-1") == 3
    assert lost, "the write's reply was not lost: the test does not test what it says"
    assert feeder.client.xlen(feeder.keys.prompts("math")) == 3
    assert counter(feeder, "math", Count.FED) == 3
    assert feeder.feeder_cursor("math") == "cursor-1"
    # the next write goes on from there; a second feeder at the old cursor is still refused
    assert feeder.feed_at_cursor("math", prompts("math", 2, start=3), "cursor-1", "cursor-2") == 2
    other = make("feeder2")
    with pytest.raises(FeederError, match="another feeder"):
        other.feed_at_cursor("math", prompts("math", 2, start=3), "cursor-1", "cursor-2")
    assert counter(feeder, "math", Count.FED) == 5
