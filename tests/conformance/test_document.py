"""docs/stream-format.md is normative: its statements and examples are checked here
against what the bundled reader and writers do on a real Redis. Where the two differ, one
of them is a bug (and this test says which statement)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import redis

from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import Keys

DOC = Path(__file__).resolve().parents[2] / "docs" / "stream-format.md"
TASK = "math"


def document() -> str:
    return DOC.read_text(encoding="utf-8")


def section(text: str, number: str) -> str:
    """The text of section ``number`` ("11.4"), up to the next heading of any level."""
    found = re.search(rf"^#+ {re.escape(number)}\b.*?$(.*?)(?=^#+ )", text + "\n# end", re.M | re.S)
    assert found, f"no section {number} in {DOC.name}"
    return found.group(1)


def blocks(text: str, lang: str = "") -> list[str]:
    """The fenced code blocks of ``text`` in language ``lang`` ("" = no language given)."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)


def paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def counted(block: str) -> set[str]:
    """The progress fields a command block increments, for task TASK."""
    return {
        field.replace("{task}", TASK)
        for field in re.findall(r"^HINCRBY rs:\{run\}:progress (\S+) \S+$", block, re.M)
    }


def undecodable(buffer: ReplayBuffer) -> None:
    """An entry in the replay buffer that nobody can decode, read (and so dead-lettered)
    by the bundled reader."""
    buffer.ensure(TASK)
    buffer.client.xadd(buffer.keys.groups(TASK), {"format": "1.0", "group_id": f"{TASK}:junk", "meta": b"{"})
    assert buffer.read_batch(TASK, 1).items == []


def progress(client: redis.Redis, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(float(v)) for k, v in client.hgetall(keys.progress).items()}


# --- dead letters and their counters (§7, §11.2, §11.4, §12) ---------------------------


def test_every_statement_of_how_a_dead_letter_is_counted_names_both_counters() -> None:
    """§7 and §12 say a group's dead letter counts in dead and groups_dead: a paragraph or
    command block that names the dead counter names groups_dead too."""
    text = document()
    alone = [p.strip()[:120] for p in paragraphs(text) if "{task}:dead" in p and "groups_dead" not in p]
    assert alone == []


@pytest.mark.integration
def test_the_dead_letter_commands_count_what_the_bundled_reader_counts(
    real_buffer: Any, redis_server: EmbeddedRedis
) -> None:
    (block,) = [b for b in blocks(section(document(), "11.4")) if "MULTI" in b]
    buffer: ReplayBuffer = real_buffer("trainer")
    before = progress(buffer.client, buffer.keys)
    undecodable(buffer)
    after = progress(buffer.client, buffer.keys)
    moved = {k for k in after if after[k] != before.get(k, 0)}
    assert moved == counted(block) == {f"{TASK}:dead", f"{TASK}:groups_dead"}
