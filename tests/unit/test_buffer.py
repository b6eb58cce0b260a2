"""Replay-buffer operations on fakeredis: the semantics, fast. The real server is in
tests/integration."""

from __future__ import annotations

import numpy as np
import pytest

from rollstream.cli.status import run_status
from rollstream.shared.errors import ReplayBufferError
from rollstream.shared.keys import PRODUCERS
from rollstream.shared.records import Status
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts, wait_idle


def test_feed_is_idempotent_by_uid(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer()
    first = buffer.feed(prompts("math", 5))
    again = buffer.feed(prompts("math", 7))
    assert (first.added, first.existing) == (5, 0)
    assert (again.added, again.existing) == (2, 5)
    assert buffer.client.xlen(buffer.keys.prompts("math")) == 7


def test_claim_order_aborted_then_expired_when_asked_then_fresh(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.feed(prompts("math", 6))
    first = buffer.claim("math", 3)
    # one claim goes back aborted with its partial samples, one is "expired" by the trainer
    partial = group_for(first[0].prompt, n=2, tokens=3).samples
    assert buffer.abort(first[0], partial) is not None
    buffer.complete(first[1], group_for(first[1].prompt))
    trainer = fake_buffer("trainer")
    batch = trainer.read_batch("math", 1)
    assert trainer.expire(batch.items[0]) is not None

    without_expired = buffer.claim("math", 2)
    assert [c.source for c in without_expired] == ["aborted", "prompts"]
    assert without_expired[0].partial == partial
    assert without_expired[0].group_id == first[0].prompt.group_id

    with_expired = buffer.claim("math", 2, include_expired=True)
    assert [c.source for c in with_expired] == ["expired", "prompts"]
    assert with_expired[0].prompt == first[1].prompt
    assert with_expired[0].partial == []


def test_complete_appends_group_and_removes_prompt(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.feed(prompts("math", 1))
    (claim,) = buffer.claim("math", 1)
    group = group_for(claim.prompt, step=5)
    entry_id = buffer.complete(claim, group)
    assert entry_id is not None
    assert buffer.client.xlen(buffer.keys.prompts("math")) == 0
    assert buffer.client.xpending(buffer.keys.prompts("math"), PRODUCERS)["pending"] == 0
    (entry,) = buffer.client.xrange(buffer.keys.groups("math"))
    assert entry[0].decode() == entry_id
    assert entry[1][b"model_step"] == b"5"
    # settling the same claim again writes nothing
    assert buffer.complete(claim, group) is None
    assert buffer.client.xlen(buffer.keys.groups("math")) == 1


def test_only_completed_groups_enter_the_buffer(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.feed(prompts("math", 1))
    (claim,) = buffer.claim("math", 1)
    group = group_for(claim.prompt)
    group.status = Status.FILTERED
    with pytest.raises(ReplayBufferError, match="filtered"):
        buffer.complete(claim, group)
    assert buffer.client.xlen(buffer.keys.prompts("math")) == 1


def test_drop_counts_filtered_without_writing_a_group(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.feed(prompts("math", 2))
    claims = buffer.claim("math", 2)
    assert all(buffer.drop(c) for c in claims)
    assert buffer.client.xlen(buffer.keys.groups("math")) == 0
    assert buffer.client.hget(buffer.keys.progress, "math:filtered") == b"2"


def test_read_commit_deletes_and_counts(fake_buffer: BufferFactory) -> None:
    producer, trainer = fake_buffer("p1"), fake_buffer("trainer")
    producer.feed(prompts("math", 5))
    for claim in producer.claim("math", 5):
        producer.complete(claim, group_for(claim.prompt))
    batch = trainer.read_batch("math", 3)
    assert [g.prompt.uid for g in batch.groups] == ["u0", "u1", "u2"]
    assert isinstance(batch.groups[0].samples[0].response_ids, np.ndarray)
    assert trainer.commit(batch) == []
    assert trainer.client.xlen(trainer.keys.groups("math")) == 2
    assert trainer.client.hget(trainer.keys.progress, "math:consumed") == b"3"
    rest = trainer.read_batch("math", 10)
    assert [g.prompt.uid for g in rest.groups] == ["u3", "u4"]


def test_restarted_trainer_rereads_its_own_pending_first(fake_buffer: BufferFactory) -> None:
    producer = fake_buffer("p1")
    producer.feed(prompts("math", 6))
    for claim in producer.claim("math", 6):
        producer.complete(claim, group_for(claim.prompt))
    before = fake_buffer("trainer")
    first = before.read_batch("math", 2)
    second = before.read_batch("math", 2)
    # the process dies without committing; a new one with the same name starts
    after = fake_buffer("trainer")
    again = after.read_batch("math", 3)
    assert [g.prompt.uid for g in again.groups] == ["u0", "u1", "u2"]
    assert [g.prompt.uid for g in after.read_batch("math", 3).groups] == ["u3", "u4", "u5"]
    assert [g.prompt.uid for g in first.groups + second.groups] == ["u0", "u1", "u2", "u3"]


def test_expire_writes_only_the_prompt_to_the_expired_pool(fake_buffer: BufferFactory) -> None:
    producer, trainer = fake_buffer("p1"), fake_buffer("trainer")
    producer.feed(prompts("math", 1))
    (claim,) = producer.claim("math", 1)
    producer.complete(claim, group_for(claim.prompt, tokens=500, step=2))
    (item,) = trainer.read_batch("math", 1).items
    assert trainer.expire(item) is not None
    assert trainer.client.xlen(trainer.keys.groups("math")) == 0
    ((_, fields),) = trainer.client.xrange(trainer.keys.expired("math"))
    assert fields[b"status"] == b"expired"
    assert fields[b"n"] == b"0"
    assert fields[b"model_step"] == b"2"
    assert len(fields[b"response_ids"]) == 0
    assert trainer.expire(item) is None  # settled already: nothing more is written
    assert trainer.client.xlen(trainer.keys.expired("math")) == 1


def test_discard_acks_without_requeue(fake_buffer: BufferFactory) -> None:
    producer, trainer = fake_buffer("p1"), fake_buffer("trainer")
    producer.feed(prompts("math", 1))
    (claim,) = producer.claim("math", 1)
    producer.complete(claim, group_for(claim.prompt))
    (item,) = trainer.read_batch("math", 1).items
    assert trainer.discard(item)
    assert trainer.client.xlen(trainer.keys.expired("math")) == 0
    assert trainer.client.xlen(trainer.keys.groups("math")) == 0
    assert trainer.client.hget(trainer.keys.progress, "math:expired_dropped") == b"1"


def test_reclaim_after_idle_and_dead_letter_after_max_attempts(fake_buffer: BufferFactory) -> None:
    knobs = {"claim_idle_ms": 300, "max_attempts": 2}
    a, b = fake_buffer("p1", buffer=knobs), fake_buffer("p2", buffer=knobs)
    a.feed(prompts("math", 1))
    assert [c.entry.deliveries for c in a.claim("math", 1)] == [1]
    assert b.claim("math", 1) == []  # not idle yet
    stream = a.keys.prompts("math")
    wait_idle(a.client, stream, PRODUCERS, 300)
    (again,) = b.claim("math", 1)
    assert (again.prompt.uid, again.entry.deliveries) == ("u0", 2)
    wait_idle(a.client, stream, PRODUCERS, 300)
    assert a.claim("math", 1) == []  # third delivery would pass max_attempts
    ((_, dead),) = a.client.xrange(a.keys.dead)
    assert dead[b"attempts"] == b"3"
    assert dead[b"uid"] == b"u0"
    assert dead[b"source"] == a.keys.prompts("math").encode()
    assert b"max_attempts 2" in dead[b"reason"]
    assert a.client.xlen(a.keys.prompts("math")) == 0


def test_undecodable_entry_is_dead_lettered_and_the_rest_flow(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.feed(prompts("math", 1))
    buffer.client.xadd(buffer.keys.prompts("math"), {"uid": "junk", "data": b"\xff{not json"})
    buffer.feed(prompts("math", 1, start=1))
    claims = buffer.claim("math", 3)
    assert [c.prompt.uid for c in claims] == ["u0", "u1"]
    ((_, dead),) = buffer.client.xrange(buffer.keys.dead)
    assert dead[b"uid"] == b"junk"
    assert dead[b"data"] == b"\xff{not json"
    assert b"undecodable prompt entry" in dead[b"reason"]


def test_status_counts_per_stream(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.feed(prompts("math", 4))
    buffer.feed(prompts("code", 2))
    buffer.claim("math", 3)
    status = run_status(buffer.client, buffer.keys)
    by_key = {s.key: s for s in status.streams}
    math = by_key[buffer.keys.prompts("math")]
    assert (math.length, math.pending, math.lag, math.consumers) == (4, 3, 1, 1)
    assert math.oldest_pending_idle_ms is not None
    code = by_key[buffer.keys.prompts("code")]
    assert (code.length, code.pending, code.lag) == (2, 0, 2)
    assert status.progress == {"code:fed": 2, "math:fed": 4}


def test_bounded_claim_admits_only_while_accepted_plus_running_stay_below_the_limit(
    fake_buffer: BufferFactory,
) -> None:
    a, b = fake_buffer("p1"), fake_buffer("p2")
    a.feed(prompts("math", 20))
    first = a.claim("math", 10, limit=6)
    assert len(first) == 6  # running 6
    assert b.claim("math", 10, limit=6) == []  # the bound holds across producers
    for claim in first[:4]:
        a.complete(claim, group_for(claim.prompt))  # accepted 4, running 2
    assert b.claim("math", 10, limit=6) == []
    assert len(b.claim("math", 10, limit=8)) == 2  # accepted 4 + running 4 = 8
    a.drop(first[4])  # filtered: neither accepted nor running any more
    assert [c.source for c in a.claim("math", 10, limit=8)] == ["prompts"]
    assert a.admitted("math") == 8


def test_expired_groups_give_their_admission_back(fake_buffer: BufferFactory) -> None:
    producer, trainer = fake_buffer("p1"), fake_buffer("trainer")
    producer.feed(prompts("math", 4))
    for claim in producer.claim("math", 2, limit=2):
        producer.complete(claim, group_for(claim.prompt))
    assert producer.claim("math", 1, limit=2) == []
    (item, _) = trainer.read_batch("math", 2).items
    trainer.expire(item)  # a stale group will be produced again: it no longer counts
    again = producer.claim("math", 5, limit=2, include_expired=True)
    assert [c.source for c in again] == ["expired"]
