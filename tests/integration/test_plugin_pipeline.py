"""A run whose engine, judge and group filter are plug-ins named by dotted path
(tests/plugins/), on a real redis-server: a producer with the in-process pool makes the
groups, and a trainer written against ``rollstream.consumer`` alone reads two steps,
commits them and publishes weights. The groups in the stream carry the plug-in engine's
tokens and the plug-in judge's rewards, the filter dropped what it should, and the
weight syncs reached the plug-in engines with the trainer's URIs."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import redis

from rollstream.consumer import (
    BatchTimeout,
    Group,
    connect,
    control_for,
    create_reader,
    load_settings,
    publish_weights,
    wait_for_producers,
)
from rollstream.producer.assembly import build_producer
from rollstream.producer.fleet.pool import LocalPool
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import STOP
from tests.helpers import prompts
from tests.plugins.engine import MARK, MarkedEngine

pytestmark = pytest.mark.integration

N, TOKENS, BATCH, FED = 3, 6, 4, 16


def test_a_run_with_a_plugin_engine_judge_and_filter(redis_server: EmbeddedRedis, run_name: str) -> None:
    settings = load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": "math", "n": N}],
        engines={"kind": "tests.plugins.engine:make", "count": 2, "options": {"tokens": TOKENS}},
        rollout={"mode": "async", "batch_size": BATCH, "max_staleness": 0, "on_weight_sync": "partial"},
        producer={
            "judge": "tests.plugins.judge:by_sample_number",
            "is_valid": "tests.plugins.filters:even_answers",
            "heartbeat_s": 0.2,
        },
    )
    pool = LocalPool.start(settings.engines)
    engines = [host.engine for host in pool.hosts]
    assert [type(e) for e in engines] == [MarkedEngine, MarkedEngine]
    producer = build_producer(redis.Redis.from_url(redis_server.url), settings, pool=pool, name="p1")
    fed = prompts("math", FED)  # answers 1..16: the filter keeps the 8 even ones
    producer.buffer.feed(fed)
    failures: list[BaseException] = []

    def produce() -> None:
        try:
            asyncio.run(producer.run())
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=produce, name="producer", daemon=True)
    thread.start()

    # the trainer: public names only
    client = connect(settings)
    reader = create_reader(settings, client=client)
    trained: dict[int, list[Group]] = {}
    try:
        for step in (1, 2):
            try:
                batch = reader.get_batch(step, timeout_s=30)
            except BatchTimeout as exc:
                raise AssertionError(f"step {step}: {exc}; producer failures: {failures}") from exc
            trained[step] = batch.groups
            batch.commit()
            publish_weights(reader.control, step, f"file:///ckpt/{step}")
        assert wait_for_producers(control_for(client, settings), 2, timeout_s=30) == ["p1"]
    finally:
        control_for(client, settings).publish(STOP)
        thread.join(timeout=30)
    assert not thread.is_alive(), "the producer did not stop on the run's stop event"
    assert failures == []

    for step, groups in trained.items():
        assert len(groups) == BATCH
        for group in groups:
            assert int(group.prompt.meta["answer"]) % 2 == 0  # the plug-in filter's choice
            assert group.model_step == step - 1  # made on the weights of the sync before
            for i, sample in enumerate(group.samples):
                assert sample.response_ids.tolist() == [MARK + i] * TOKENS  # the plug-in engine's
                assert np.all(sample.response_versions == step - 1)
                assert sample.text == f"plug-in sample {i}"
                assert sample.reward == {"score": i / 10, "plugin": 1.0}  # the plug-in judge's
    uids = [g.prompt.uid for groups in trained.values() for g in groups]
    assert sorted(uids) == sorted(p.uid for p in fed if int(p.meta["answer"]) % 2 == 0)
    assert producer.stats.outcomes == {"completed": 8, "filtered": 8}
    for engine in engines:
        assert engine.loaded == [(1, "file:///ckpt/1"), (2, "file:///ckpt/2")]
    texts = {p.prompt for p in fed}
    asked = [bytes(ids).decode() for engine in engines for ids in engine.prompts]
    assert len(asked) == FED and set(asked) == texts  # the prompt as UTF-8 bytes, each once
