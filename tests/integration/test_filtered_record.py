"""Every outcome names its prompt: a group the producer's filter drops leaves a small
record with its uid in rs:{run}:filtered, in the transaction that acks its claim, so that
an auditor reconciles prompt by prompt and not only against the filtered counter."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import orjson
import pytest
import redis

from rollstream.producer.assembly import build_producer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.records import Group
from rollstream.shared.settings import load_settings
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts

pytestmark = pytest.mark.integration


def reject_all(group: Group) -> bool:
    return False


def test_each_filtered_group_leaves_its_uid(redis_server: EmbeddedRedis, run_name: str) -> None:
    settings = load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": "math", "n": 2}],
        engines={"count": 1, "sim": {"time_compression": 50.0, "median_tokens": 50, "sigma": 0.5}},
        rollout={"mode": "async", "batch_size": 4, "max_staleness": 0},
        producer={"max_tokens": 100, "is_valid": f"{__name__}:reject_all", "heartbeat_s": 0.2},
    )
    client = redis.Redis.from_url(redis_server.url)
    producer = build_producer(client, settings, name="p1")
    producer.buffer.feed(prompts("math", 3))
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))

    assert producer.stats.outcomes == {"filtered": 3}
    records = [fields for _, fields in client.xrange(producer.buffer.keys.filtered)]
    assert sorted(r[b"uid"] for r in records) == [b"u0", b"u1", b"u2"]
    for r in records:
        assert r[b"group_id"] == b"math:" + r[b"uid"]
        assert (r[b"task"], r[b"n"], r[b"format"]) == (b"math", b"2", b"1.0")
        assert r[b"producer"] == producer.buffer.consumer.encode()
        assert r[b"source"] == producer.buffer.keys.prompts("math").encode()
        assert 0.0 <= float(r[b"reward_mean"]) <= 1.0  # the judge scored it before the filter
    progress = client.hgetall(producer.buffer.keys.progress)
    assert progress[b"math:filtered"] == b"3"
    client.close()


def test_a_fenced_drop_writes_no_record(real_buffer: BufferFactory) -> None:
    """A drop of a claim that is no longer ours (taken over meanwhile) writes nothing."""
    a, b = real_buffer("producer-a"), real_buffer("producer-b")
    a.feed(prompts("math", 1))
    (claim,) = a.claim("math", 1)
    a.client.xgroup_delconsumer(a.keys.prompts("math"), "producers", "producer-a")  # not a's any more
    assert a.drop(claim, group_for(claim.prompt)) is False
    assert b.client.xlen(b.keys.filtered) == 0


def test_show_filtered_lists_them_by_uid(
    real_buffer: BufferFactory, run_name: str, redis_server: EmbeddedRedis
) -> None:
    producer = real_buffer("producer-a")
    producer.feed(prompts("math", 2))
    for claim in producer.claim("math", 2):
        assert producer.drop(claim, group_for(claim.prompt)) is True
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env |= {"ROLLSTREAM_REDIS__URL": redis_server.url, "ROLLSTREAM_RUN": run_name}
    done = subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", "show", "filtered", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = [orjson.loads(line)["fields"] for line in done.stdout.splitlines()]
    assert [(s["uid"], s["group_id"], s["n"], s["reward_mean"]) for s in shown] == [
        ("u0", "math:u0", 4, 0.5), ("u1", "math:u1", 4, 0.5),
    ]  # fmt: skip
