"""take_train_batch / commit_train_batch: a train batch's groups handed to a trainer that
commits them after its optimizer step (an outside trainer's rollout function), on a real
redis-server; groups are completed by hand, as a producer would."""

from __future__ import annotations

import pytest
import redis

from rollstream.consumer.assembly import create_coordinator
from rollstream.consumer.coordinator import BatchCoordinator
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import BatchTimeout, ReplayBufferError
from rollstream.shared.keys import TRAINER
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings
from tests.helpers import group_for, prompts

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(redis_server: EmbeddedRedis, run_name: str) -> Settings:
    return load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": "math", "n": 4}],
        rollout={"batch_size": 100},
        buffer={"claim_idle_ms": 500},
    )


def coordinator(server: EmbeddedRedis, settings: Settings, consumer: str = "rollout") -> BatchCoordinator:
    return create_coordinator(settings, client=redis.Redis.from_url(server.url), consumer=consumer)


def produce(coord: BatchCoordinator, settings: Settings, count: int) -> None:
    worker = open_buffer(coord.client, settings, "hand")
    for claim in worker.claim("math", count):
        assert worker.complete(claim, group_for(claim.prompt)) is not None


def progress(coord: BatchCoordinator) -> dict[str, int]:
    return {k.decode(): int(float(v)) for k, v in coord.client.hgetall(coord.keys.progress).items()}


def pending(coord: BatchCoordinator) -> int:
    return int(coord.client.xpending(coord.keys.groups("math"), TRAINER)["pending"])


def test_taken_groups_stay_pending_until_the_commit(redis_server: EmbeddedRedis, settings: Settings) -> None:
    coord = coordinator(redis_server, settings)
    coord.submit_batch("b1", prompts("math", 3))
    produce(coord, settings, 3)

    groups = coord.take_train_batch("b1", timeout=30)

    assert sorted(g.prompt.uid for g in groups) == ["b1/u0", "b1/u1", "b1/u2"]
    assert coord.status("b1") == "handed"
    assert pending(coord) == 3 and progress(coord).get("math:consumed", 0) == 0
    # taken again (the same process asks twice): the same groups, nothing read anew
    assert [g.group_id for g in coord.take_train_batch("b1", timeout=5)] == [g.group_id for g in groups]

    result = coord.commit_train_batch("b1", train_step=1)

    assert result["status"] == "finalized" and coord.status("b1") == "finalized"
    assert pending(coord) == 0 and coord.client.xlen(coord.keys.groups("math")) == 0
    assert progress(coord)["math:consumed"] == 3
    with pytest.raises(ReplayBufferError, match="nothing to commit"):
        coord.commit_train_batch("b1")


def test_a_restart_takes_the_handed_batch_again(redis_server: EmbeddedRedis, settings: Settings) -> None:
    first = coordinator(redis_server, settings)
    first.submit_batch("b2", prompts("math", 4))
    produce(first, settings, 4)
    taken = first.take_train_batch("b2", timeout=30)
    # the process dies before its commit; its restart has the same consumer name

    again = coordinator(redis_server, settings)
    assert again.submitted_with("b2", prompts("math", 4))
    assert not again.submitted_with("b2", prompts("math", 4, start=1))
    groups = again.take_train_batch("b2", timeout=30)

    assert [g.group_id for g in groups] == [g.group_id for g in taken]
    again.commit_train_batch("b2", train_step=1)
    assert progress(again)["math:consumed"] == 4 and pending(again) == 0


def test_another_consumer_gets_the_handed_groups_once_they_are_idle(
    redis_server: EmbeddedRedis, settings: Settings
) -> None:
    first = coordinator(redis_server, settings, consumer="rollout-a")
    first.submit_batch("b3", prompts("math", 2))
    produce(first, settings, 2)
    first.take_train_batch("b3", timeout=30)

    other = coordinator(redis_server, settings, consumer="rollout-b")
    groups = other.take_train_batch("b3", timeout=30)  # reclaimed after claim_idle_ms

    assert len(groups) == 2
    other.commit_train_batch("b3")
    assert progress(other)["math:consumed"] == 2


def test_a_handed_group_not_back_in_time_is_named(redis_server: EmbeddedRedis, settings: Settings) -> None:
    slow = settings.model_copy(
        update={"buffer": settings.buffer.model_copy(update={"claim_idle_ms": 600_000})}
    )
    first = coordinator(redis_server, slow, consumer="rollout-a")
    first.submit_batch("b4", prompts("math", 2))
    produce(first, slow, 2)
    first.take_train_batch("b4", timeout=30)

    with pytest.raises(BatchTimeout, match=r"2 of its 2 handed groups are not back after 0\.3 s"):
        coordinator(redis_server, slow, consumer="rollout-b").take_train_batch("b4", timeout=0.3)


def test_aborted_groups_are_dropped_not_counted_as_trained(
    redis_server: EmbeddedRedis, settings: Settings
) -> None:
    coord = coordinator(redis_server, settings)
    coord.submit_batch("b5", prompts("math", 2))
    coord.submit_batch("b6", prompts("math", 3, start=10))
    produce(coord, settings, 4)  # b5's two, two of b6's three
    coord.take_train_batch("b5", timeout=30)

    coord.abort_batch("b5", "the trainer restarted on other prompts")  # handed: discarded
    with pytest.raises(BatchTimeout):
        coord.finalize_train_batch("b6", timeout=0.3)  # reads b6's two groups: too few
    coord.abort_batch("b6", "not needed")  # running, finished groups not kept: discarded

    counts = progress(coord)
    assert counts.get("math:consumed", 0) == 0
    assert counts["math:aborted_dropped"] == 4 and counts["math:removed"] == 1
    assert pending(coord) == 0 and coord.client.xlen(coord.keys.groups("math")) == 0
