"""Garbage written by hand into every stream and key of a run, read through the real paths
on a real redis-server: a bad entry is dead-lettered with its reason and acknowledged at
its first delivery, the good entries read beside it are used as usual, nothing raises; a
bad event is skipped; a corrupt state or progress value is a clear error."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis

from rollstream.consumer.assembly import create_reader
from rollstream.consumer.progress import ProduceProgress
from rollstream.producer.assembly import build_producer
from rollstream.shared import codec
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import CorruptValueError
from rollstream.shared.events import STOP, WEIGHT_SYNC, Event, EventFollower, RunControl
from rollstream.shared.keys import MODEL_STEP, PRODUCERS, TRAIN_STEP, TRAINER, Keys
from rollstream.shared.records import Group, Sample, Status
from rollstream.shared.runconfig import open_buffer, task_quota
from rollstream.shared.settings import Settings, load_settings
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts, wait_for, wait_idle

pytestmark = pytest.mark.integration

Raw = dict[bytes, bytes]


def settings_for(url: str, run: str, **overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "run": run,
        "redis": {"url": url},
        "tasks": [{"name": "math", "n": 2}],
        "buffer": {"claim_idle_ms": 400, "max_attempts": 3},
        "engines": {"count": 1, "sim": {"time_compression": 50.0, "median_tokens": 50, "sigma": 0.5}},
        "rollout": {"mode": "async", "batch_size": 2, "max_staleness": 0},
        "producer": {"max_tokens": 100, "is_valid": "keep_all", "heartbeat_s": 0.2, "max_inflight": 8},
    }
    base.update(overrides)
    return load_settings(**base)


@pytest.fixture
def settings(redis_server: EmbeddedRedis, run_name: str) -> Settings:
    return settings_for(redis_server.url, run_name)


@pytest.fixture
def client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def raw(fields: codec.Fields) -> Raw:
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


def bad_prompt(**data: Any) -> Raw:
    body: dict[str, Any] = {"uid": "bad", "task": "math", "prompt": "1 + 1?"}
    body.update(data)
    return {b"uid": b"bad", b"task": b"math", b"data": orjson.dumps(body)}


def group_entry(step: int = 0, status: Status = Status.COMPLETED, uid: int = 90) -> Raw:
    """A well-formed group entry (completed, or aborted with a partial sample)."""
    (prompt,) = prompts("math", 1, start=uid)
    if status is Status.COMPLETED:
        return raw(codec.encode_group(group_for(prompt, n=2, tokens=4, step=step)))
    partial = Sample([1, 2], [7, 8, 9], [-0.1, -0.2, -0.3], [step] * 3, status=Status.ABORTED)
    return raw(codec.encode_group(Group.for_prompt(prompt, samples=[partial], status=status)))


def garbled(entry: Raw, **sample: Any) -> Raw:
    """The entry with its first sample's meta changed."""
    meta = orjson.loads(entry[b"meta"])
    meta["samples"][0].update(sample)
    return {**entry, b"meta": orjson.dumps(meta)}


def garbled_prompt(entry: Raw, **prompt: Any) -> Raw:
    meta = orjson.loads(entry[b"meta"])
    meta["prompt"].update(prompt)
    return {**entry, b"meta": orjson.dumps(meta)}


def dead_letters(
    client: redis.Redis, keys: Keys, source: str | None = None
) -> dict[bytes, dict[bytes, bytes]]:
    """The dead letters (from ``source`` only, if given: ids of two streams may be equal)
    by the id their entry had in its source stream."""
    return {
        fields[b"source_id"]: fields
        for _, fields in client.xrange(keys.dead)
        if source is None or fields[b"source"] == source.encode()
    }


def pending_ids(client: redis.Redis, stream: str, group: str) -> set[bytes]:
    return {p["message_id"] for p in client.xpending_range(stream, group, "-", "+", 1000)}


def assert_dead_at_first_delivery(
    client: redis.Redis, keys: Keys, stream: str, group: str, bad: dict[bytes, str], attempts: bytes = b"1"
) -> None:
    """Each bad entry is a dead letter whose reason names what is wrong, acked and gone."""
    dead = dead_letters(client, keys, stream)
    assert set(dead) == set(bad)
    for entry_id, reason in bad.items():
        assert reason.encode() in dead[entry_id][b"reason"], (reason, dead[entry_id][b"reason"])
        assert dead[entry_id][b"attempts"] == attempts
        assert dead[entry_id][b"source"] == stream.encode()
        assert b"delivered" not in dead[entry_id][b"reason"]
    assert not set(bad) & pending_ids(client, stream, group)
    assert not set(bad) & {entry_id for entry_id, _ in client.xrange(stream)}  # deleted too


# --- producers' pools ---------------------------------------------------------------------------


def test_bad_prompts_are_dead_lettered_at_their_first_claim_and_the_good_ones_claimed(
    real_buffer: BufferFactory,
) -> None:
    buffer = real_buffer("p1")
    stream = buffer.keys.prompts("math")
    buffer.feed(prompts("math", 1))
    add = buffer.client.xadd
    bad = {
        add(stream, bad_prompt(prompt=5)): "prompt is 5, not text or chat messages",  # type: ignore[arg-type]
        add(stream, bad_prompt(meta="answer: 2")): "meta is 'answer: 2', not an object",  # type: ignore[arg-type]
        add(stream, bad_prompt(prompt=[{"role": "user"}])): "chat message 0 has no content",  # type: ignore[arg-type]
        add(stream, bad_prompt(prompt_ids=[1, 10**11])): "prompt_ids holds a token id outside",  # type: ignore[arg-type]
        add(stream, {b"uid": b"x", b"data": b"\xff{"}): "JSONDecodeError",  # type: ignore[dict-item]
    }
    buffer.feed(prompts("math", 1, start=1))

    claims = buffer.claim("math", 10)

    assert [c.prompt.uid for c in claims] == ["u0", "u1"]
    assert_dead_at_first_delivery(buffer.client, buffer.keys, stream, PRODUCERS, bad)
    assert buffer.client.hget(buffer.keys.progress, "math:dead") == b"5"
    assert pending_ids(buffer.client, stream, PRODUCERS) == {c.entry.id.encode() for c in claims}


def test_bad_aborted_and_expired_entries_are_dead_lettered_and_the_good_ones_claimed(
    real_buffer: BufferFactory,
) -> None:
    buffer = real_buffer("p1")
    buffer.ensure("math")
    aborted, expired = buffer.keys.aborted("math"), buffer.keys.expired("math")
    add = buffer.client.xadd
    good = group_entry(step=1, status=Status.ABORTED)
    bad_aborted = {
        add(aborted, garbled(good, ver=[[1, 10**11]])): "version runs for 100000000000 tokens, not its 3",
        add(aborted, garbled(good, ver=[[10**11, 3]])): "version 100000000000, not a step",
        add(aborted, garbled(good, reward=[1.0])): "reward [1.0], not an object",
        add(aborted, garbled_prompt(good, prompt=[{"role": "user"}])): "chat message 0 has no content",
        add(aborted, {**good, b"model_step": b"100000000000"}): "model_step 100000000000 is outside",
    }
    good_id = add(aborted, good)
    expired_entry = group_entry(status=Status.EXPIRED, uid=91)
    bad_expired = {
        add(expired, garbled(expired_entry, len=10**11, lp=10**11, ver=[[0, 10**11]])): "shorter than",
        add(expired, garbled_prompt(expired_entry, meta="none")): "meta is 'none'",
    }
    expired_good_id = add(expired, expired_entry)

    claims = buffer.claim("math", 10, include_expired=True)

    assert [(c.source, c.entry.id) for c in claims] == [
        ("aborted", good_id.decode()),
        ("expired", expired_good_id.decode()),
    ]
    assert [len(c.partial) for c in claims] == [1, 1]
    assert buffer.client.xlen(buffer.keys.dead) == len(bad_aborted) + len(bad_expired)
    for stream, bad in ((aborted, bad_aborted), (expired, bad_expired)):
        assert_dead_at_first_delivery(buffer.client, buffer.keys, stream, PRODUCERS, bad)
        assert buffer.client.xlen(stream) == 1  # the good one, claimed, waits for its settle


def test_a_bad_entry_left_pending_by_a_dead_producer_is_dead_lettered_when_reclaimed(
    real_buffer: BufferFactory,
) -> None:
    knobs = {"claim_idle_ms": 400, "max_attempts": 3}
    doomed, survivor = real_buffer("doomed", buffer=knobs), real_buffer("survivor", buffer=knobs)
    doomed.ensure("math")
    stream = doomed.keys.prompts("math")
    bad_id = doomed.client.xadd(stream, bad_prompt(prompt=None))  # type: ignore[arg-type]
    doomed.feed(prompts("math", 1))
    # the dead producer read both and died before it decoded them
    doomed.client.xreadgroup(PRODUCERS, "doomed", {stream: ">"}, count=10)
    wait_idle(doomed.client, stream, PRODUCERS, 400)

    claims = survivor.claim("math", 10)

    assert [c.prompt.uid for c in claims] == ["u0"]
    assert_dead_at_first_delivery(
        survivor.client, survivor.keys, stream, PRODUCERS, {bad_id: "prompt is None"}, attempts=b"2"
    )


def test_an_eval_prompt_naming_no_batch_is_dead_lettered_when_claimed(real_buffer: BufferFactory) -> None:
    buffer = real_buffer("p1")
    buffer.ensure("math")
    stream = buffer.keys.evals("math")
    bad_id = buffer.client.xadd(stream, bad_prompt())  # type: ignore[arg-type]
    good = bad_prompt(uid="e1", meta={"rollstream_batch": "b1"})
    good_id = buffer.client.xadd(stream, good)  # type: ignore[arg-type]

    claims = buffer.claim("math", 5)

    assert [c.entry.id for c in claims] == [good_id.decode()]
    assert_dead_at_first_delivery(buffer.client, buffer.keys, stream, PRODUCERS, {bad_id: "names no batch"})


def test_a_burst_producer_finishes_past_bad_prompts_and_bad_aborted_entries(
    redis_server: EmbeddedRedis, run_name: str, client: redis.Redis
) -> None:
    # before: each of these failed in the producer on every attempt and stayed pending for
    # ever, so that `produce --burst` never exited
    settings = settings_for(redis_server.url, run_name)
    producer = build_producer(redis.Redis.from_url(redis_server.url), settings, name="p1")
    keys = producer.buffer.keys
    bad = [
        client.xadd(keys.prompts("math"), bad_prompt(prompt=7)),  # type: ignore[arg-type]
        client.xadd(keys.prompts("math"), bad_prompt(meta="x")),  # type: ignore[arg-type]
        client.xadd(keys.prompts("math"), bad_prompt(prompt=[{"role": "user", "text": "hi"}])),  # type: ignore[arg-type]
        client.xadd(keys.aborted("math"), garbled(group_entry(status=Status.ABORTED), ver=[[0, 10**11]])),
        client.xadd(keys.aborted("math"), garbled_prompt(group_entry(status=Status.ABORTED), prompt=3)),
    ]
    producer.buffer.feed(prompts("math", 2))  # behind the bad ones: the admission bound stops at 2

    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))

    assert producer.stats.outcomes == {"completed": 2}
    dead = client.xrange(keys.dead)
    assert sorted((f[b"source"], f[b"source_id"], f[b"attempts"]) for _, f in dead) == sorted(
        [(keys.prompts("math").encode(), i, b"1") for i in bad[:3]]
        + [(keys.aborted("math").encode(), i, b"1") for i in bad[3:]]
    )
    assert producer.buffer.running("math") == 0
    assert client.xlen(keys.prompts("math")) == client.xlen(keys.aborted("math")) == 0
    assert client.xlen(keys.groups("math")) == 2


# --- the trainer --------------------------------------------------------------------------------


def produce(buffer: ReplayBuffer, count: int, start: int = 0) -> None:
    buffer.feed(prompts("math", count, start=start))
    for claim in buffer.claim("math", count):
        buffer.complete(claim, group_for(claim.prompt))


def test_bad_groups_are_dead_lettered_and_the_trainer_batch_fills_with_good_ones(
    settings: Settings, client: redis.Redis
) -> None:
    producer = open_buffer(client, settings, "p1")
    groups = producer.keys.groups("math")
    produce(producer, 1)
    good = group_entry(step=0)
    add = client.xadd
    bad = {
        add(groups, garbled(good, reward={"score": "1.0"})): "reward score '1.0', not a number",
        add(groups, garbled(good, reward=[1.0])): "reward [1.0], not an object",
        add(groups, garbled(good, ver=[[0, 10**11]])): "version runs for 100000000000 tokens",
        add(groups, garbled(good, ver=[[10**11, 4]])): "version 100000000000, not a step",
        add(groups, {**good, b"model_step": b"99999999999"}): "model_step 99999999999 is outside",
        add(groups, {**good, b"response_ids": good[b"response_ids"][:-4]}): "shorter than",
        add(groups, {**good, b"meta": b"[]"}): "meta is [], not a JSON object",
    }
    produce(producer, 1, start=1)
    reader = create_reader(settings, client=client)

    batch = reader.get_batch(1, timeout_s=10)

    assert sorted(g.prompt.uid for g in batch.groups) == ["u0", "u1"]
    assert_dead_at_first_delivery(client, producer.keys, groups, TRAINER, bad)
    assert len(pending_ids(client, groups, TRAINER)) == 2  # the good ones, until the commit
    batch.commit()
    assert pending_ids(client, groups, TRAINER) == set()
    assert client.xlen(groups) == 0


def test_a_restarted_trainer_dead_letters_a_bad_pending_group_and_keeps_the_good_ones(
    settings: Settings, client: redis.Redis
) -> None:
    # A trainer that read these and crashed on the bad one (as a string score did, at every
    # restart) re-reads them all: before, the good ones went to the dead letters too once
    # "delivered N times"; now the bad one is dead-lettered on this first re-read.
    producer = open_buffer(client, settings, "p1")
    groups = producer.keys.groups("math")
    produce(producer, 1)
    bad_id = client.xadd(groups, garbled(group_entry(), reward={"score": "high"}))
    produce(producer, 1, start=1)
    open_buffer(client, settings, "trainer").ensure("math")
    client.xreadgroup(TRAINER, "trainer", {groups: ">"}, count=10)  # read, then the crash

    batch = create_reader(settings, client=client).get_batch(1, timeout_s=10)

    assert sorted(g.prompt.uid for g in batch.groups) == ["u0", "u1"]
    dead = dead_letters(client, producer.keys)
    assert list(dead) == [bad_id]
    assert b"reward score 'high', not a number" in dead[bad_id][b"reason"]
    assert bad_id not in pending_ids(client, groups, TRAINER)
    assert len(pending_ids(client, groups, TRAINER)) == 2


# --- events, state and progress ----------------------------------------------------------------


def test_the_follower_skips_malformed_events_with_one_warning_each_and_goes_on(
    client: redis.Redis, run_name: str, followers: list[EventFollower], caplog: pytest.LogCaptureFixture
) -> None:
    control = RunControl(client, Keys(run_name))
    start = control.last_event_id()
    events = control.keys.events
    bad = {
        client.xadd(events, {"type": WEIGHT_SYNC, "model_step": 99999999999, "ts": 1.0}): "model_step",
        client.xadd(events, {"type": WEIGHT_SYNC, "model_step": "2.5", "ts": 1.0}): "model_step",
        client.xadd(events, {"type": "pause", "model_step": -1, "ts": "soon"}): "ts",
    }
    sync = control.publish(WEIGHT_SYNC, 2, uri="/ckpt/2")
    trailing = client.xadd(events, {"type": STOP, "model_step": "x"})
    seen: list[Event] = []
    errors: list[BaseException] = []

    with caplog.at_level(logging.WARNING, logger="rollstream.shared.events"):
        follower = EventFollower(control, start, seen.append, errors.append, block_ms=100).start()
        followers.append(follower)
        wait_for(lambda: seen, timeout=10)
        wait_for(lambda: len(caplog.records) >= 4, timeout=10)
        stop = control.publish(STOP)
        wait_for(lambda: len(seen) >= 2, timeout=10)

    assert [(e.id, e.type, e.model_step) for e in seen] == [(sync, WEIGHT_SYNC, 2), (stop, STOP, -1)]
    assert errors == [] and follower._thread.is_alive()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4  # one each: the trailing bad event is not read again
    for (entry_id, field), warning in zip([*bad.items(), (trailing, "model_step")], warnings, strict=True):
        assert entry_id.decode() in warning and f"field {field} is" in warning


@pytest.mark.parametrize("field", [MODEL_STEP, TRAIN_STEP])
def test_a_corrupt_step_in_the_state_is_a_clear_error_for_its_readers(
    settings: Settings, client: redis.Redis, field: str
) -> None:
    keys = Keys(settings.run)
    client.hset(keys.state, field, "abc")
    expected = f"rs:{{{settings.run}}}:state field {field} is 'abc', not a step number"
    control = RunControl(client, keys)
    read = control.model_step if field == MODEL_STEP else control.train_step
    with pytest.raises(CorruptValueError) as info:
        read()
    assert str(info.value).startswith(expected)
    if field == MODEL_STEP:  # what a producer's supervisor log shows on every restart: the repair
        assert "repair it with `rollstream steps --model-step N --yes`" in str(info.value)
    with pytest.raises(CorruptValueError, match="not a step number"):
        ProduceProgress(client, Keys(settings.run), task_quota(settings)).state_dict()


def test_a_producer_starting_on_a_corrupt_model_step_names_it(
    redis_server: EmbeddedRedis, run_name: str, client: redis.Redis
) -> None:
    settings = settings_for(redis_server.url, run_name)
    client.hset(Keys(run_name).state, MODEL_STEP, "99999999999")
    producer = build_producer(redis.Redis.from_url(redis_server.url), settings, name="p1")
    with pytest.raises(CorruptValueError, match="field model_step is '99999999999', not a step number"):
        asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))


def test_a_corrupt_progress_counter_is_a_clear_error(settings: Settings, client: redis.Redis) -> None:
    keys = Keys(settings.run)
    client.hset(keys.progress, "math:completed", "lots")
    buffer = open_buffer(client, settings, "p1")
    expected = f"rs:{{{settings.run}}}:progress field math:completed is 'lots', not a count"
    with pytest.raises(CorruptValueError) as info:
        buffer.admitted("math")
    assert str(info.value) == expected
    with pytest.raises(CorruptValueError, match="math:completed is 'lots'"):
        ProduceProgress(client, Keys(settings.run), task_quota(settings)).counts("math")
