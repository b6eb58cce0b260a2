"""The engines' autoscale rule (`rollstream engines scale --min A --max B`): one engine
more while the engines are busy and prompts wait for producers, one fewer while they
idle, within the bounds; the engines process applies it by asking for the count as
`engines scale N` does."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis

from rollstream.cli.engines import prompts_waiting
from rollstream.producer.engines.base import EngineHealth
from rollstream.producer.fleet.autoscale import autoscale_step, autoscale_target
from rollstream.producer.fleet.scaling import ENGINES_AUTOSCALE, ENGINES_BUSY, EngineCount
from rollstream.shared.errors import CorruptValueError
from rollstream.shared.keys import Keys
from rollstream.shared.runconfig import open_buffer
from tests.conftest import SettingsFactory
from tests.helpers import prompts


@pytest.mark.parametrize(
    ("current", "busy", "lag", "target"),
    [
        (2, 0.9, 10, 3),  # busy, and work waits: one more
        (2, 0.9, 0, 2),  # busy, nothing waits: the producers are not short of engines
        (4, 0.9, 10, 4),  # at the maximum
        (2, 0.5, 10, 2),  # neither busy nor idle
        (3, 0.1, 10, 2),  # idle: one fewer
        (1, 0.1, 0, 1),  # at the minimum
        (3, None, 10, 3),  # no engine answered: no change
        (9, 0.5, 0, 4),  # outside the bounds (the rule was narrowed): into them
    ],
)
def test_autoscale_target(current: int, busy: float | None, lag: int, target: int) -> None:
    assert autoscale_target(current, 1, 4, busy, lag) == target


def test_the_rule_is_kept_in_the_state_hash(fake_client: redis.Redis) -> None:
    count = EngineCount(fake_client, Keys("r"))
    assert count.autoscale() is None
    count.set_autoscale(2, 8)
    assert count.autoscale() == (2, 8)
    count.clear_autoscale()
    assert count.autoscale() is None
    with pytest.raises(ValueError, match="min <= max"):
        count.set_autoscale(5, 3)
    fake_client.hset(Keys("r").state, ENGINES_AUTOSCALE, "lots")
    with pytest.raises(CorruptValueError, match="engines scale --min A --max B"):
        count.autoscale()


class Pool:
    def __init__(self, busy: list[float | None]) -> None:
        self.handles: list[Any] = [object() for _ in busy]
        self.busy = busy

    def probe(self, timeout_s: float) -> list[EngineHealth | None]:
        return [
            None if b is None else EngineHealth(True, 0, False, 1, 1, 0, busy_fraction=b) for b in self.busy
        ]


def test_the_engines_process_asks_for_one_engine_more_while_busy_with_prompts_waiting(
    make_settings: SettingsFactory, fake_client: redis.Redis
) -> None:
    settings = make_settings()
    buffer = open_buffer(fake_client, settings, "worker")
    keys = buffer.keys
    count = EngineCount(fake_client, keys)

    def waiting() -> int:
        return prompts_waiting(fake_client, settings.run)

    assert autoscale_step(Pool([0.9, 0.95]), count, waiting) is None  # no rule: nothing
    assert count.wanted() is None
    # but the busy figure is published, rule or not: the producers' scaling figure reads it
    assert orjson.loads(fake_client.hget(keys.state, ENGINES_BUSY))["busy"] == pytest.approx(0.925)

    count.set_autoscale(1, 3)
    # busy, but nothing waits for producers: no change
    assert autoscale_step(Pool([0.9, 0.95]), count, waiting) == 2
    assert count.wanted() is None
    buffer.feed(prompts("math", 5))
    assert autoscale_step(Pool([0.9, 0.95]), count, waiting) == 3
    assert count.wanted() == 3
    # engines that idle (one not answering): one fewer
    assert autoscale_step(Pool([0.1, None, 0.2]), count, waiting) == 2
    assert count.wanted() == 2
