"""``rollstream demo``: a first try in one process on an embedded Redis.

Until the producer and trainer land, it shows the feed -> status round trip:
prompts fed from a JSONL file, fed again (idempotent by uid), then the
stream status as ``rollstream status`` prints it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from cli.commands import example_prompts, format_status
from producer.prompts import read_prompt_file
from shared.buffer import ReplayBuffer
from shared.connection import connect
from shared.embedded import EmbeddedRedis
from shared.settings import load_settings
from shared.status import run_status


def demo(prompts: int = 64) -> int:
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        print(f"embedded redis-server ({server.binary}) at {server.url}")
        settings = load_settings(run="demo", redis={"url": server.url}, tasks=[{"name": "math", "n": 8}])
        buffer = ReplayBuffer(connect(settings.redis), settings, "demo")
        path = example_prompts(Path(tmp) / "math.jsonl", prompts)
        rows = read_prompt_file(path, "math")
        first = buffer.feed(rows)
        again = buffer.feed(rows)
        print(f"feed {path.name}: {first.added} added")
        print(f"fed again: {again.added} added, {again.existing} already there (idempotent by uid)")
        print(format_status(run_status(buffer.client, buffer.keys)))
    return 0
