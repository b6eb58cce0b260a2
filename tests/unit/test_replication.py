"""The replica barrier (consumer/replication.py) is the one docs/stream-format.md §11.5.1
gives other trainers, and it is a no-op without redis.wait_replicas."""

from __future__ import annotations

import re
from pathlib import Path

import fakeredis

from rollstream.consumer import replication
from rollstream.shared.keys import Keys
from rollstream.shared.settings import RedisSettings

SPEC = Path(__file__).resolve().parents[2] / "docs" / "stream-format.md"


def _code_lines(lua: str) -> list[str]:
    lines = [line.split("--")[0].strip() for line in lua.strip().splitlines()]
    return [line for line in lines if line]


def test_the_stream_format_gives_the_barrier_the_code_runs() -> None:
    text = SPEC.read_text(encoding="utf-8")
    body = re.search(r"^#+ 11\.5\.1\b.*?$(.*?)(?=^#+ )", text, re.M | re.S)
    assert body is not None
    (lua,) = re.findall(r"^```lua\n(.*?)^```$", body.group(1), re.M | re.S)
    assert _code_lines(lua) == _code_lines(replication._BARRIER)


def test_without_wait_replicas_nothing_is_sent() -> None:
    client = fakeredis.FakeRedis()
    assert replication.wait_for_replicas(client, Keys("r"), RedisSettings(), "a commit") == 0
    assert client.keys("*") == []
