"""``rollstream demo``: a first try in one process on an embedded Redis.

Until the engines, the producer and the reference trainer land, it shows the
replay buffer itself: prompts fed from a JSONL file (and fed again: stored
once), claimed and completed as groups of placeholder responses, read by the
trainer side and committed, with ``rollstream status`` after each stage.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from cli.commands import example_prompts, format_status
from producer.prompts import read_prompt_file
from shared.buffer import ReplayBuffer
from shared.connection import connect
from shared.embedded import EmbeddedRedis
from shared.records import Group, Prompt, Sample, as_ids, as_logprobs
from shared.settings import load_settings
from shared.status import run_status


def placeholder_group(prompt: Prompt, n: int, rng: np.random.Generator) -> Group:
    """Random tokens in place of an engine's responses: the buffer does not care."""
    samples = []
    for _ in range(n):
        length = int(rng.integers(16, 256))
        samples.append(
            Sample(
                prompt_ids=as_ids(np.arange(32)),
                response_ids=as_ids(rng.integers(0, 32_000, length)),
                logprobs=as_logprobs(-rng.random(length)),
                response_versions=as_ids(np.zeros(length)),
                finish_reason="stop",
                reward={"score": float(rng.integers(0, 2))},
            )
        )
    return Group.for_prompt(prompt, samples=samples)


def demo(prompts: int = 64) -> int:
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        print(f"embedded redis-server ({server.binary}) at {server.url}\n")
        settings = load_settings(run="demo", redis={"url": server.url}, tasks=[{"name": "math", "n": 8}])
        client = connect(settings.redis)
        producer = ReplayBuffer(client, settings, "demo-producer")
        trainer = ReplayBuffer(client, settings, "demo-trainer")

        path = example_prompts(Path(tmp) / "math.jsonl", prompts)
        rows = read_prompt_file(path, "math")
        first, again = producer.feed(rows), producer.feed(rows)
        print(f"feed {path.name}: {first.added} added")
        print(f"fed again: {again.added} added, {again.existing} already there (idempotent by uid)\n")
        print(format_status(run_status(client, producer.keys)) + "\n")

        rng = np.random.default_rng(0)
        claims = producer.claim("math", prompts // 2)
        for claim in claims:
            producer.complete(claim, placeholder_group(claim.prompt, settings.task("math").n, rng))
        print(f"claimed and completed {len(claims)} groups of 8 placeholder responses")
        batch = trainer.read_batch("math", 16)
        tokens = sum(len(s.response_ids) for g in batch.groups for s in g.samples)
        print(f"trainer read a batch of {len(batch)} groups ({tokens} response tokens); before commit:")
        print(format_status(run_status(client, producer.keys)) + "\n")
        trainer.commit(batch)
        print("after commit (acked groups are deleted):")
        print(format_status(run_status(client, producer.keys)))
    return 0
