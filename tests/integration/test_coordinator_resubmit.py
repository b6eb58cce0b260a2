"""The coordinator's batch ids submitted again, and the uids its batches leave behind, on a
real redis-server. The groups are made by hand: what is tested is the bookkeeping."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.consumer.coordinator import BatchCoordinator
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import Keys
from tests.helpers import group_for, prompts
from tests.integration.test_coordinator import coordinator, coordinator_settings

pytestmark = pytest.mark.integration


def produce(coord: BatchCoordinator, count: int) -> None:
    """A producer by hand: ``count`` prompts claimed and their groups completed."""
    worker = ReplayBuffer(coord.client, coord.keys, coord.buffer.buffer_settings, "hand")
    claims = worker.claim("math", count)
    assert len(claims) == count
    for claim in claims:
        worker.complete(claim, group_for(claim.prompt))


def fed_sets(coord: BatchCoordinator) -> list[bytes]:
    """Every fed set of the run: the one-shot feeds' and the batches'."""
    return sorted(coord.client.scan_iter(match=f"{coord.keys.base}:*fed*"))


@pytest.mark.timeout(60)
def test_a_finished_batch_submitted_again_is_answered_from_its_record(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    coord = coordinator(redis_server, coordinator_settings(redis_server, run_name))
    assert coord.submit_batch("b1", prompts("math", 3)) == 3
    produce(coord, 3)
    result = coord.finalize_train_batch("b1", timeout=10)
    assert result["finished_task_count"] == 3
    # When the same batch is submitted again (a trainer that restarted in its step)
    assert coord.submit_batch("b1", prompts("math", 3)) == 0
    # Then nothing is fed and finalize answers at once with the stored result (before the
    # fix: nothing was fed but 3 results were awaited, so finalize without a timeout
    # waited for ever; with one it timed out)
    assert coord.client.xlen(coord.keys.prompts("math")) == 0
    assert coord.finalize_train_batch("b1", timeout=5) == result
    assert coord._status("b1") == "finalized"


@pytest.mark.timeout(60)
def test_a_finished_id_used_again_with_other_prompts_feeds_every_one_of_them(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    coord = coordinator(redis_server, coordinator_settings(redis_server, run_name))
    coord.submit_batch("b2", prompts("math", 3))  # u0 u1 u2
    produce(coord, 3)
    coord.finalize_train_batch("b2", timeout=10)
    # When the id is used for a new batch that shares two prompts with the old one
    assert coord.submit_batch("b2", prompts("math", 4, start=1)) == 4  # u1 u2 u3 u4
    # Then all four are fed (before the fix u1 and u2 counted as fed already: 2 fed, 4 awaited)
    assert coord.client.xlen(coord.keys.prompts("math")) == 4
    produce(coord, 4)
    result = coord.finalize_train_batch("b2", timeout=10)
    assert sorted(result["group_ids"]) == [f"math:b2/u{i}" for i in range(1, 5)]


@pytest.mark.timeout(60)
def test_a_batchs_uids_go_with_the_batch(redis_server: EmbeddedRedis, run_name: str) -> None:
    coord = coordinator(redis_server, coordinator_settings(redis_server, run_name))
    coord.submit_batch("b3", prompts("math", 3))
    coord.submit_batch("b4", prompts("math", 2, start=10), kind="eval")
    coord.submit_batch("b5", prompts("math", 2, start=20))
    assert fed_sets(coord)  # remembered while the batches run: a re-sent feed adds nothing
    produce(coord, 2)  # the eval prompts come first
    coord.finalize_eval_batch("b4", timeout=10)
    produce(coord, 3)
    coord.finalize_train_batch("b3", timeout=10)
    coord.abort_batch("b5", "not needed")
    # Then no fed uid of any batch is left behind (before the fix the run's fed set kept
    # every uid of every batch for ever, 7 here)
    assert fed_sets(coord) == []


def test_a_uid_twice_in_one_batch_is_refused(redis_server: EmbeddedRedis, run_name: str) -> None:
    coord = coordinator(redis_server, coordinator_settings(redis_server, run_name))
    with pytest.raises(ValueError, match=r"batch 'b6': prompt math:u1 is given twice"):
        coord.submit_batch("b6", [*prompts("math", 2), *prompts("math", 1, start=1)])
    assert coord.client.xlen(coord.keys.prompts("math")) == 0


def test_a_batchs_fed_set_is_named_as_documented() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "stream-format.md").read_text(encoding="utf-8")
    assert Keys("r1").batch_fed("b1", "math") == "rs:{r1}:batch:b1:fed:math"
    assert "| `rs:{run}:batch:{batch}:fed:{task}` | set |" in doc
