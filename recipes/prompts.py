"""The small arithmetic prompt file that the simulated demo and the benchmarks feed."""

from __future__ import annotations

from pathlib import Path

import orjson


def example_prompts(path: Path, count: int) -> Path:
    """A small arithmetic prompt file with answers, for the demo."""
    rows = [
        {"uid": f"add-{i}", "prompt": f"What is {i} + {2 * i + 1}?", "meta": {"answer": str(3 * i + 1)}}
        for i in range(count)
    ]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path
