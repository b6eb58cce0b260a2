"""The dead-letter and filtered streams are capped (XADD MAXLEN ~, buffer.dead_maxlen and
buffer.filtered_maxlen): every path that appends to them trims, so a long run's dead letters
and filtered records stay near the cap while the counters count every one."""

from __future__ import annotations

import pytest

from rollstream.shared.keys import PROMPTS
from rollstream.shared.settings import BufferSettings
from tests.conftest import BufferFactory
from tests.helpers import prompts

pytestmark = pytest.mark.integration

CAP = 10
MANY = 300  # three times a stream node (stream-node-max-entries 100): trimming must show
NODE = 100  # MAXLEN ~ trims whole nodes: the length stays below cap + a node


def capped(length: int) -> bool:
    return CAP <= length < CAP + NODE


def test_the_settle_paths_trim_the_dead_and_filtered_streams(real_buffer: BufferFactory) -> None:
    caps = {"dead_maxlen": CAP, "filtered_maxlen": CAP}
    buffer = real_buffer("producer-1", buffer={"claim_idle_ms": 60_000, "max_attempts": 3, **caps})
    buffer.feed(prompts("math", 2 * MANY))
    claims = buffer.claim("math", 2 * MANY)
    assert len(claims) == 2 * MANY
    for claim in claims[:MANY]:
        assert buffer.drop(claim)
    for claim in claims[MANY:]:
        assert buffer.dead_letter(claim.entry, "test")
    client = buffer.client
    assert capped(client.xlen(buffer.keys.filtered)), client.xlen(buffer.keys.filtered)
    assert capped(client.xlen(buffer.keys.dead)), client.xlen(buffer.keys.dead)
    # the newest entries are the ones kept, and the counters count every one
    newest = client.xrevrange(buffer.keys.dead, count=1)[0][1]
    assert newest[b"uid"] == f"u{2 * MANY - 1}".encode()
    progress = client.hgetall(buffer.keys.progress)
    assert (progress[b"math:filtered"], progress[b"math:dead"]) == (str(MANY).encode(), str(MANY).encode())


def test_reclaim_and_by_hand_dead_letters_trim_too(real_buffer: BufferFactory) -> None:
    settings = {"claim_idle_ms": 1, "max_attempts": 1, "dead_maxlen": CAP}
    first = real_buffer("producer-1", buffer=settings)
    second = real_buffer("producer-2", buffer=settings)
    first.feed(prompts("math", MANY + 20))
    assert len(first.claim("math", MANY)) == MANY
    first.release(first.held())  # as a dead process would: nothing held, all pending
    reclaimed = second.reclaim(PROMPTS, "math", 2 * MANY, force=True)  # the Lua dead letters
    client = first.client
    assert reclaimed == []
    assert client.hget(first.keys.progress, "math:dead") == str(MANY).encode()
    assert capped(client.xlen(first.keys.dead)), client.xlen(first.keys.dead)
    # the operator's move of one entry appends through the same capped XADD
    entries = client.xrange(first.keys.prompts("math"), count=20)
    for entry_id, _ in entries:
        second.dead_letter_by_hand(PROMPTS, "math", entry_id.decode(), "test")
    assert client.hget(first.keys.progress, "math:dead") == str(MANY + 20).encode()
    assert capped(client.xlen(first.keys.dead)), client.xlen(first.keys.dead)


def test_the_caps_default_to_sane_sizes(real_buffer: BufferFactory) -> None:
    defaults = BufferSettings()
    assert (defaults.dead_maxlen, defaults.filtered_maxlen) == (10_000, 100_000)
    buffer = real_buffer("producer-1")
    assert buffer.streams.caps == {buffer.keys.dead: 10_000, buffer.keys.filtered: 100_000}
