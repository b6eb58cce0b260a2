"""The trainer's keeper thread, which refreshes the groups it holds, survives an error it
did not expect: it dying in silence let another trainer consumer take the groups over
after claim_idle_ms, and train them a second time."""

from __future__ import annotations

import time
from typing import Any

import pytest

from rollstream.consumer.assembly import create_reader
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import GROUPS, TRAINER, Keys
from rollstream.shared.runconfig import open_buffer
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts, wait_for

pytestmark = pytest.mark.integration

IDLE_MS = 1000  # the keeper touches every third of it: room for a loaded machine


def test_the_keeper_goes_on_after_an_unexpected_error_and_keeps_the_groups(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    settings = make_settings(
        redis_server.url,
        tasks=[{"name": "math", "n": 4}],
        rollout={"batch_size": 2},
        buffer={"claim_idle_ms": IDLE_MS, "max_attempts": 3, "block_ms": 100},
    )
    client = connect(settings.redis)
    holder = create_reader(settings, client=client, consumer="trainer-a")
    try:
        producer = open_buffer(client, settings, "p1")
        producer.feed(prompts("math", 2))
        for claim in producer.claim("math", 2, limit=100):
            producer.complete(claim, group_for(claim.prompt))
        other = open_buffer(client, settings, "trainer-b")
        # Given a keeper whose first refresh fails with an error that is not Redis'
        touch, failed = holder.buffer.touch, []

        def touch_failing_once(entries: Any) -> list[str]:
            if not failed:
                failed.append(True)
                raise ValueError("an unexpected reply")
            return touch(entries)

        monkeypatch.setattr(holder.buffer, "touch", touch_failing_once)
        batch = holder.get_batch(1, timeout_s=5.0)
        assert len(batch) == 2
        wait_for(lambda: failed, timeout=10)
        started = time.monotonic()
        taken: list[str] = []

        def held_long_enough() -> bool:  # meanwhile the other consumer tries to take them
            taken.extend(e.id for e in other.reclaim(GROUPS, "math", 10, force=True))
            return time.monotonic() - started > 3 * IDLE_MS / 1000

        # Then it goes on refreshing them (and says what failed): nobody takes them over
        wait_for(held_long_enough, timeout=30)
        assert taken == []
        assert batch.commit() == []
        assert client.xpending(Keys(settings.run).groups("math"), TRAINER)["pending"] == 0
        assert "an unexpected reply" in caplog.text
    finally:
        holder.close()
        client.close()
