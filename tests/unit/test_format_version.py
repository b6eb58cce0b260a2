"""The stream format's version: every entry and the run's state carry "format"; a reader
reads every minor version of its major and stops, without dead-lettering anything, at
another major (the data is fine: this rollstream is the wrong one)."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from rollstream.shared import codec
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.errors import FormatError
from rollstream.shared.events import WEIGHT_SYNC, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.runconfig import check_run_settings, open_buffer
from tests.helpers import group_for, prompts


def test_every_entry_and_the_state_carry_the_format(fake_client: redis.Redis, make_settings: Any) -> None:
    settings = make_settings()
    buffer = open_buffer(fake_client, settings, "p")
    buffer.feed(prompts("math", 1))
    ((_, fields),) = buffer.client.xrange(buffer.keys.prompts("math"))
    assert fields[b"format"] == codec.FORMAT_VERSION.encode()
    (claim,) = buffer.claim("math", 1)
    buffer.complete(claim, group_for(claim.prompt))
    ((_, group),) = buffer.client.xrange(buffer.keys.groups("math"))
    assert group[b"format"] == codec.FORMAT_VERSION.encode()
    control = RunControl(buffer.client, buffer.keys)
    control.publish(WEIGHT_SYNC, 1)
    ((_, event),) = buffer.client.xrange(buffer.keys.events)
    assert event[b"format"] == codec.FORMAT_VERSION.encode()
    check_run_settings(buffer.client, buffer.keys, settings, "p")
    assert buffer.client.hget(buffer.keys.state, "format") == codec.FORMAT_VERSION.encode()


def encoded(**extra: Any) -> dict[bytes, bytes]:
    (prompt,) = prompts("math", 1)
    fields = {**codec.encode_group(group_for(prompt)), **extra}
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


def test_another_minor_version_decodes_and_another_major_stops() -> None:
    assert codec.decode_group(encoded(format="1.9")).group_id == "math:u0"
    without = encoded()
    del without[b"format"]
    assert codec.decode_group(without).group_id == "math:u0"  # written before the field existed
    with pytest.raises(FormatError, match=r"stream format '2.0'; this rollstream reads format 1.x"):
        codec.decode_group(encoded(format="2.0"))


def test_a_batch_with_a_newer_major_stops_the_reader_and_dead_letters_nothing(fake_buffer: Any) -> None:
    buffer: ReplayBuffer = fake_buffer("trainer")
    buffer.client.xgroup_create(buffer.keys.groups("math"), "trainer", id="0", mkstream=True)
    buffer.client.xadd(buffer.keys.groups("math"), encoded(format="2.0"))  # type: ignore[arg-type]
    with pytest.raises(FormatError):
        buffer.read_batch("math", 8)
    assert buffer.client.xlen(buffer.keys.dead) == 0


def test_a_run_written_in_another_major_is_refused(fake_client: redis.Redis, make_settings: Any) -> None:
    settings = make_settings()
    keys = Keys(settings.run)
    fake_client.hset(keys.state, "format", "2.1")
    with pytest.raises(FormatError, match=f"run '{settings.run}' is in stream format '2.1'"):
        check_run_settings(fake_client, keys, settings, "p")


def test_an_event_in_another_major_stops_the_follower(fake_client: redis.Redis) -> None:
    control = RunControl(fake_client, Keys("r1"))
    fake_client.xadd(control.keys.events, {"type": "weight_sync", "model_step": 1, "ts": 0, "format": "3.0"})
    with pytest.raises(FormatError, match="event"):
        control.events("0-0")
