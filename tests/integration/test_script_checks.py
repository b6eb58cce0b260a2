"""Redis does not roll back a script that fails half-way: a script checks every counter
it will increment before its first write. HINCRBY refuses a counter that Lua's tonumber()
takes ('1.5', '0x10', ' 7'), so such a counter failed a script after its writes."""

from __future__ import annotations

import pytest
import redis

from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import Batch
from rollstream.shared.errors import CorruptValueError
from rollstream.shared.keys import GROUPS, PRODUCERS, TRAINER
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts, wait_idle

pytestmark = pytest.mark.integration


def trained_group(real_buffer: BufferFactory, **settings: object) -> tuple[ReplayBuffer, Batch]:
    """A producer's group in the replay buffer, read by trainer consumer t1."""
    producer = real_buffer("producer", **settings)
    producer.feed(prompts("math", 1))
    (claim,) = producer.claim("math", 1)
    assert producer.complete(claim, group_for(claim.prompt)) is not None
    trainer = real_buffer("t1", **settings)
    batch = trainer.read_batch("math", 1)
    assert len(batch) == 1
    return trainer, batch


def pending_for(buffer: ReplayBuffer, consumer: str) -> int:
    stream = buffer.keys.groups("math")
    return len(buffer.client.xpending_range(stream, TRAINER, "-", "+", 10, consumername=consumer))


@pytest.mark.parametrize("value", ["1.5", "0x10", " 7"])
def test_a_commit_on_a_counter_hincrby_refuses_writes_nothing(real_buffer: BufferFactory, value: str) -> None:
    trainer, batch = trained_group(real_buffer)
    consumed = "math:consumed"
    trainer.client.hset(trainer.keys.progress, consumed, value)
    with pytest.raises(redis.ResponseError, match=f"progress field {consumed} is not a number"):
        trainer.commit(batch)
    # the group is neither acked nor deleted: the trainer commits it once the counter is repaired
    assert trainer.client.xlen(trainer.keys.groups("math")) == 1
    assert pending_for(trainer, "t1") == 1


def test_a_reclaim_that_dead_letters_a_group_checks_groups_dead_before_writing(
    real_buffer: BufferFactory,
) -> None:
    settings = {"buffer": {"claim_idle_ms": 1, "max_attempts": 1, "block_ms": 100}}
    trained_group(real_buffer, **settings)
    other = real_buffer("t2", **settings)
    other.client.hset(other.keys.progress, "math:groups_dead", "lots")
    wait_idle(other.client, other.keys.groups("math"), TRAINER, 1)
    # t2 takes over t1's idle group, delivered more than max_attempts: a dead letter, whose
    # groups_dead counter is not a number
    with pytest.raises(redis.ResponseError, match="progress field math:groups_dead is not a number"):
        other.reclaim(GROUPS, "math", 10, force=True)
    # nothing written: no dead letter, the group still pending for t1, dead not counted
    assert other.client.xlen(other.keys.dead) == 0
    assert other.client.xlen(other.keys.groups("math")) == 1
    assert pending_for(other, "t1") == 1
    assert other.client.hget(other.keys.progress, "math:dead") is None


@pytest.mark.parametrize(("field", "value"), [("math:completed", "1.5"), ("math:reward_sum", "inf")])
def test_a_settle_on_a_counter_its_transaction_would_refuse_writes_nothing(
    real_buffer: BufferFactory, field: str, value: str
) -> None:
    producer = real_buffer("producer")
    producer.feed(prompts("math", 1))
    (claim,) = producer.claim("math", 1)
    producer.client.hset(producer.keys.progress, field, value)
    # the gate refuses it, naming the counter: no group written, the claim still pending
    with pytest.raises(CorruptValueError, match=field):
        producer.complete(claim, group_for(claim.prompt))
    assert producer.client.xlen(producer.keys.groups("math")) == 0
    assert producer.client.xpending(producer.keys.prompts("math"), PRODUCERS)["pending"] == 1
