"""Prompt files: the small arithmetic one that the simulated demo and the benchmarks feed,
and a task's train and held-out splits as `rollstream feed` reads them."""

from __future__ import annotations

from pathlib import Path

import orjson

from rollstream.shared.records import Prompt


def example_prompts(path: Path, count: int) -> Path:
    """A small arithmetic prompt file with answers, for the demo."""
    rows = [
        {"uid": f"add-{i}", "prompt": f"What is {i} + {2 * i + 1}?", "meta": {"answer": str(3 * i + 1)}}
        for i in range(count)
    ]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def write_prompt_files(
    directory: str | Path, train: list[Prompt], held_out: list[Prompt]
) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl in ``directory`` (the prompt-file format of
    ``rollstream feed`` and ``rollstream train --eval-file``); returns their paths."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, prompts in (("train", train), ("eval", held_out)):
        path = folder / f"{name}.jsonl"
        # a chat prompt is a line's "messages", a text one its "prompt"
        rows = (
            {"uid": p.uid, "messages" if isinstance(p.prompt, list) else "prompt": p.prompt, "meta": p.meta}
            for p in prompts
        )
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]
