"""`rollstream status` accounts for groups that no producer made from a fed prompt (an
entry written by hand, or by a foreign producer that does not count them) on a line of
their own, never as negative lost prompts."""

from __future__ import annotations

import pytest
import redis

from rollstream.cli.ops import format_status
from rollstream.cli.status import TaskAccount, run_status
from rollstream.shared import codec
from rollstream.shared.keys import Keys
from rollstream.shared.records import Prompt
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts

pytestmark = pytest.mark.integration


def test_groups_never_fed_are_not_fed_not_negative_lost(
    real_buffer: BufferFactory, real_client: redis.Redis, run_name: str
) -> None:
    producer = real_buffer("producer-1", tasks=[{"name": "math", "n": 4}])
    trainer = real_buffer("trainer", tasks=[{"name": "math", "n": 4}])
    keys = Keys(run_name)
    assert producer.feed(prompts("math", 3)).added == 3
    for claim in producer.claim("math", 2):
        assert producer.complete(claim, group_for(claim.prompt)) is not None
    # Given a group entry written by hand that nobody can decode, and one that decodes
    # but stands for a prompt never fed
    real_client.xadd(keys.groups("math"), {"format": "1.0", "group_id": "math:junk", "meta": b"{"})
    stray = group_for(Prompt(uid="by-hand", task="math", prompt="1 + 1?"))
    real_client.xadd(keys.groups("math"), codec.encode_group(stray))  # type: ignore[arg-type]
    # When the trainer reads them all (the junk one is dead-lettered) and commits the rest
    batch = trainer.read_batch("math", 4)
    assert len(batch.items) == 3
    assert trainer.commit(batch) == []

    # Then the account of fed prompts adds up, lost 0, and the two show as not fed
    status = run_status(real_client, keys)
    math = status.accounts["math"]
    assert math == TaskAccount(
        fed=3, trained=3, evaluated=0, waiting=0, in_pools=1, filtered=0, dropped=0, dead=1, lost=0, not_fed=2
    )
    shown = format_status(status)
    assert "dead 1 + lost 0 - not fed 2" in shown, shown
    assert "not fed 2: groups of math that no producer made from a fed prompt" in shown


def test_a_run_of_fed_prompts_only_shows_no_not_fed_line(
    real_buffer: BufferFactory, real_client: redis.Redis, run_name: str
) -> None:
    producer = real_buffer("producer-1", tasks=[{"name": "math", "n": 4}])
    trainer = real_buffer("trainer", tasks=[{"name": "math", "n": 4}])
    assert producer.feed(prompts("math", 2)).added == 2
    for claim in producer.claim("math", 2):
        assert producer.complete(claim, group_for(claim.prompt)) is not None
    batch = trainer.read_batch("math", 1)
    assert trainer.commit(batch) == []
    status = run_status(real_client, Keys(run_name))
    assert (status.accounts["math"].lost, status.accounts["math"].not_fed) == (0, 0)
    assert "not fed" not in format_status(status)
