"""Conformance of docs/stream-format.md §5.2.1: a reader written from that page alone
(redis-py, numpy, orjson; no rollstream import in the reading) decodes the 1.1 group
entries of a multi-turn run made by a real producer, and gets each trajectory's loss
mask, turns and agent status, consistent with its packed tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import pytest
import redis

from rollstream.producer.assembly import build_producer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.settings import load_settings
from tests.helpers import prompts

pytestmark = pytest.mark.integration


def read_entry(f: dict[bytes, bytes]) -> list[dict[str, Any]]:
    """§5.2 and §5.2.1, as the page writes them."""
    version = f.get(b"format", b"1.0").decode()
    assert version.split(".")[0] == "1"
    meta = orjson.loads(f[b"meta"])
    prompt_ids = np.frombuffer(f[b"prompt_ids"], dtype="<i4")
    response_ids = np.frombuffer(f[b"response_ids"], dtype="<i4")
    logprobs = np.frombuffer(f[b"logprobs"], dtype="<f4")
    out = []
    r = lp = 0
    for s in meta["samples"]:
        s_response = response_ids[r : r + s["len"]]
        r += s["len"]
        s_logprobs = logprobs[lp : lp + s["lp"]]
        lp += s["lp"]
        s_versions = np.repeat([v for v, _ in s["ver"]], [c for _, c in s["ver"]]).astype("<i4")
        runs = s.get("mask")
        s_mask = np.repeat([v for v, _ in runs], [c for _, c in runs]) if runs else np.ones(s["len"], "u1")
        out.append(
            {
                "version": version,
                "prompt": prompt_ids,
                "response": s_response,
                "logprobs": s_logprobs,
                "versions": s_versions,
                "mask": s_mask,
                "turns": s.get("turns"),
                "agent": s.get("agent"),
                "text": s["text"],
            }
        )
    assert r == len(response_ids) and lp == len(logprobs)
    return out


def test_a_reader_of_the_page_decodes_agent_trajectories(redis_server: EmbeddedRedis, run_name: str) -> None:
    settings = load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": "math", "n": 3}],
        engines={"count": 1, "sim": {"time_compression": 200.0, "median_tokens": 10, "sigma": 0.3}},
        rollout={"batch_size": 4, "max_staleness": 4},
        producer={
            "agent": "multi_turn",
            "agent_options": {"env": "rollstream.producer.agents.examples:GuessNumber"},
            "judge": "rollstream.producer.agents.rewards:env_return",
            "is_valid": "keep_all",
            "max_turns": 3,
            "heartbeat_s": 0.2,
        },
    )
    producer = build_producer(redis.Redis.from_url(redis_server.url), settings, name="p1")
    producer.buffer.feed(prompts("math", 3))  # "What is i + 1?", answer i + 1
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))

    client = redis.Redis.from_url(redis_server.url)
    entries = client.xrange(f"rs:{{{run_name}}}:groups:math")
    assert len(entries) == 3
    trajectories = [t for _, fields in entries for t in read_entry(fields)]
    assert len(trajectories) == 9
    for t in trajectories:
        assert t["version"] == "1.1"
        turns = t["turns"]
        assert sum(turn["len"] for turn in turns) == len(t["response"])
        expected = np.concatenate([np.full(turn["len"], turn["role"] == "model") for turn in turns])
        assert t["mask"].tolist() == expected.astype(int).tolist()
        assert t["agent"] in ("done", "max_turns")
        assert turns[-1]["role"] == "model" and t["text"] == turns[-1]["text"]
        start = 0
        for turn in turns:
            span = t["response"][start : start + turn["len"]]
            if turn["role"] != "model":  # the byte tokenizer: the observation's text is its ids
                assert bytes(span.tolist()).decode() == turn["text"]
                assert np.all(t["logprobs"][start : start + turn["len"]] == 0)
            start += turn["len"]
