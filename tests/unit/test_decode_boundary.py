"""The decoding boundary: whatever is read from Redis is checked where it is decoded.

A bad stream entry raises DecodeError with its reason (and nothing else, however
garbled it is), before anything is allocated from the sizes it claims; a bad
event is skipped with one warning; a bad state or progress value raises
CorruptValueError naming the key and the field.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstream.consumer.progress import ProduceProgress
from rollstream.shared import codec
from rollstream.shared.errors import CorruptValueError, DecodeError, RollstreamError
from rollstream.shared.events import PAUSE, STOP, WEIGHT_SYNC, RunControl
from rollstream.shared.keys import EVALS, MODEL_STEP, PRODUCERS, TRAIN_STEP, Keys
from rollstream.shared.records import MAX_STEP, Group, Prompt, Sample, Status
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts

Raw = dict[bytes, bytes]


def raw_fields(fields: codec.Fields) -> Raw:
    """What a stream read hands back: every name and value as bytes."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


def good_group(n: int = 3, tokens: int = 6) -> Group:
    prompt = Prompt(uid="u1", task="math", prompt="2+2?", meta={"answer": "4"})
    samples = [
        Sample(
            prompt_ids=[1, 2, 3],
            response_ids=list(range(tokens)),
            logprobs=[-0.5] * tokens,
            response_versions=[2] * (tokens // 2) + [3] * (tokens - tokens // 2),
            finish_reason="stop",
            reward={"score": float(i % 2)},
        )
        for i in range(n)
    ]
    return Group.for_prompt(prompt, samples=samples)


def group_raw(group: Group | None = None) -> Raw:
    return raw_fields(codec.encode_group(group or good_group()))


def aborted_raw(step: int = 4) -> Raw:
    """An aborted group as the aborted pool holds it: its prompt and a partial sample."""
    partial = Sample([1, 2], [7, 8, 9], [-0.1, -0.2, -0.3], [step] * 3, status=Status.ABORTED)
    group = Group.for_prompt(prompts("math", 1)[0], samples=[partial], status=Status.ABORTED)
    return group_raw(group)


def with_meta(raw: Raw, change: Callable[[dict[str, Any]], object]) -> Raw:
    meta = orjson.loads(raw[b"meta"])
    change(meta)
    return {**raw, b"meta": orjson.dumps(meta)}


def sample_meta(**values: Any) -> Callable[[dict[str, Any]], None]:
    def change(meta: dict[str, Any]) -> None:
        meta["samples"][0].update(values)

    return change


def decode_error(raw: Raw) -> str:
    with pytest.raises(DecodeError) as info:
        codec.decode_group(raw)
    return str(info.value)


# --- group entries: sizes before allocation ------------------------------------------------


def test_a_version_run_of_1e11_tokens_is_refused_before_anything_is_allocated() -> None:
    # the corpus case: the decoder tried to allocate 373 GiB for this one
    raw = with_meta(group_raw(), sample_meta(len=6, ver=[[3, 100_000_000_000]]))
    assert "version runs" in decode_error(raw)


def test_a_huge_run_among_several_is_refused() -> None:
    raw = with_meta(group_raw(), sample_meta(ver=[[2, 3], [3, 100_000_000_000]]))
    assert "version runs" in decode_error(raw)


def test_a_huge_sample_length_is_refused() -> None:
    raw = with_meta(group_raw(), sample_meta(len=10**11, lp=10**11, ver=[[3, 10**11]]))
    assert "shorter than the sample lengths say" in decode_error(raw)


def test_a_huge_prompt_length_is_refused() -> None:
    group = good_group()
    group.samples[1].prompt_ids = np.asarray([9, 9], dtype=np.int32)  # not shared: per-sample lengths
    raw = with_meta(group_raw(group), sample_meta(plen=100_000_000_000))
    assert "prompt" in decode_error(raw)


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ({"len": -6}, "len"),
        ({"len": "6"}, "len"),
        ({"len": 6.0}, "len"),
        ({"len": True}, "len"),
        ({"lp": -6}, "lp"),
        ({"lp": 3}, "logprobs for 6 tokens"),
        ({"ver": [[3, 0], [3, 6]]}, "version runs"),
        ({"ver": [[3, -6], [2, 12]]}, "version runs"),
        ({"ver": [[3, 5]]}, "version runs"),
        ({"ver": [[3, "6"]]}, "version runs"),
        ({"ver": [[3, 6, 1]]}, "version runs"),
        ({"ver": [3, 6]}, "version runs"),
        ({"ver": "3x6"}, "version runs"),
        ({"ver": [["3", 6]]}, "version"),
        ({"ver": [[3.5, 6]]}, "version"),
        ({"ver": [[100_000_000_000, 6]]}, "version"),
        ({"ver": [[2**31, 6]]}, "version"),
        ({"ver": [[-1, 6]]}, "version"),
        ({"ver": [[2, 3], [-5, 3]]}, "version"),
    ],
)
def test_bad_sample_sizes_and_version_runs_are_decode_errors(values: dict[str, Any], reason: str) -> None:
    assert reason in decode_error(with_meta(group_raw(), sample_meta(**values)))


def test_the_largest_int32_version_still_decodes() -> None:
    group = codec.decode_group(with_meta(group_raw(), sample_meta(ver=[[MAX_STEP, 6]])))
    assert int(group.samples[0].response_versions.max()) == MAX_STEP


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        (b"model_step", b"100000000000", "model_step"),
        (b"model_step", b"-2", "model_step"),
        (b"model_step", b"abc", "model_step"),
        (b"attempt", b"-1", "attempt"),
        (b"attempt", b"lots", "attempt"),
        (b"prompt_ids", b"\x01\x02\x03", "prompt_ids"),
        (b"response_ids", b"\x01", "response_ids"),
        (b"group_id", b"\xff\xfe", "group_id"),
        (b"producer", b"\xc3", "producer"),
        (b"status", b"weird", "status"),
    ],
)
def test_bad_plain_fields_are_decode_errors_naming_the_field(field: bytes, value: bytes, reason: str) -> None:
    raw = {**group_raw(), field: value}
    assert reason in decode_error(raw)


# --- group entries: rewards and the rest of meta ---------------------------------------------


@pytest.mark.parametrize(
    ("reward", "reason"),
    [
        ({"score": "1.0"}, "score"),
        ({"score": [1.0]}, "score"),
        ({"score": True}, "score"),
        ([1.0], "reward"),
        ("1.0", "reward"),
        (1.0, "reward"),
    ],
)
def test_a_reward_that_is_not_a_dict_of_numeric_score_is_a_decode_error(reward: Any, reason: str) -> None:
    # the corpus case: a string score crashed the trainer on every restart, never dead-lettered
    assert reason in decode_error(with_meta(group_raw(), sample_meta(reward=reward)))


def test_rewards_that_the_judges_write_still_decode() -> None:
    raw = with_meta(group_raw(), sample_meta(reward={"score": 1, "format": 1.0, "pred": "4"}))
    assert codec.decode_group(raw).samples[0].score == 1.0
    assert codec.decode_group(with_meta(group_raw(), sample_meta(reward=None))).samples[0].reward == {}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (sample_meta(finish=3), "finish"),
        (sample_meta(text=None), "text"),
        (sample_meta(status="great"), "status"),
        (lambda m: m.update(samples={"0": {}}), "samples"),
        (lambda m: m["samples"].__setitem__(0, [6, 6]), "sample"),
        (lambda m: m.update(shared_prompt="yes"), "shared_prompt"),
        (lambda m: m.update(created_at="yesterday"), "created_at"),
        (lambda m: m.update(timings=[1.0]), "timings"),
        (lambda m: m.update(timings={"judge": "slow"}), "timings"),
        (lambda m: m.update(prompt=7), "prompt"),
        (lambda m: m["prompt"].update(prompt=7), "prompt"),
        (lambda m: m["prompt"].update(meta="answer: 4"), "meta"),
        (lambda m: m["prompt"].update(prompt_ids=[1, 100_000_000_000]), "prompt_ids"),
    ],
)
def test_bad_meta_is_a_decode_error(change: Callable[[dict[str, Any]], object], reason: str) -> None:
    assert reason in decode_error(with_meta(group_raw(), change))


def test_meta_that_is_not_a_json_object_is_a_decode_error() -> None:
    assert "meta" in decode_error({**group_raw(), b"meta": b"[1, 2]"})
    assert "JSONDecodeError" in decode_error({**group_raw(), b"meta": b"\xff{"})


@pytest.mark.parametrize(
    "change",
    [
        sample_meta(ver=[[4, 100_000_000_000]]),
        sample_meta(ver=[[100_000_000_000, 3]]),
        sample_meta(reward="lots"),
        lambda m: m["prompt"].update(prompt=[{"role": "user"}]),
    ],
)
def test_aborted_and_expired_entries_are_checked_the_same_way(
    change: Callable[[dict[str, Any]], object],
) -> None:
    for status in (b"aborted", b"expired"):
        raw = {**with_meta(aborted_raw(), change), b"status": status}
        decode_error(raw)


# --- prompts ----------------------------------------------------------------------------------


def prompt_raw(**data: Any) -> Raw:
    base: dict[str, Any] = {"uid": "u1", "task": "math", "prompt": "1 + 1?"}
    base.update(data)
    return {b"uid": b"u1", b"task": b"math", b"data": orjson.dumps(base)}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [{"role": "user"}]}, "content"),
        ({"prompt": [{"content": "hi"}]}, "role"),
        ({"prompt": ["hi"]}, "message"),
        ({"prompt": [{"role": "user", "content": 5}]}, "content"),
        ({"meta": "answer: 2"}, "meta"),
        ({"meta": [1]}, "meta"),
        ({"uid": 1}, "uid"),
        ({"task": None}, "task"),
        ({"prompt_ids": "1 2 3"}, "prompt_ids"),
        ({"prompt_ids": [1, "2"]}, "prompt_ids"),
        ({"prompt_ids": [1, 2.5]}, "prompt_ids"),
        ({"prompt_ids": [1, True]}, "prompt_ids"),
        ({"prompt_ids": [[1], [2]]}, "prompt_ids"),
        ({"prompt_ids": [1, 2**31]}, "prompt_ids"),
        ({"prompt_ids": [1, 100_000_000_000]}, "prompt_ids"),
    ],
)
def test_bad_prompt_entries_are_decode_errors(data: dict[str, Any], reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        codec.decode_prompt(prompt_raw(**data))


def test_prompt_data_that_is_not_an_object_or_not_utf8_is_a_decode_error() -> None:
    for data in (b"[1]", b"5", b'"text"', b"\xff\xfe", b""):
        with pytest.raises(DecodeError, match="undecodable prompt entry"):
            codec.decode_prompt({b"data": data})


def test_good_prompts_of_every_shape_still_decode() -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text"}]}]
    prompt = codec.decode_prompt(prompt_raw(prompt=chat, prompt_ids=[0, -1, 2**31 - 1], meta=None))
    assert prompt.prompt == chat
    assert prompt.prompt_ids == [0, -1, 2**31 - 1]
    assert prompt.meta == {}
    assert codec.decode_prompt(prompt_raw(prompt_ids=[])).prompt_ids == []


# --- nothing but DecodeError, whatever the garbage ----------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)  # all orjson writes, past int64 too
    | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
PATHS = st.sampled_from(
    [
        ("samples", 0, "len"), ("samples", 0, "lp"), ("samples", 0, "ver"), ("samples", 0, "ver", 0),
        ("samples", 0, "ver", 0, 0), ("samples", 0, "ver", 0, 1), ("samples", 0, "reward"),
        ("samples", 0, "reward", "score"), ("samples", 0, "finish"), ("samples", 0, "status"),
        ("samples", 0, "text"), ("samples", 0, "plen"), ("samples", 0), ("samples",), ("prompt",),
        ("prompt", "prompt"), ("prompt", "meta"), ("prompt", "uid"), ("prompt", "prompt_ids"),
        ("shared_prompt",), ("prompt_ids_in_samples",), ("created_at",), ("timings",),
    ]
)  # fmt: skip


def set_path(meta: Any, path: tuple[Any, ...], value: Any) -> None:
    for step in path[:-1]:
        meta = meta[step]
    meta[path[-1]] = value


def usable(group: Group) -> None:
    """What the producer and the trainer do with a decoded group, without crashing."""
    assert isinstance(group.model_step, int) and -1 <= group.model_step <= MAX_STEP
    assert isinstance(group.attempt, int) and group.attempt >= 0
    for s in group.samples:
        assert len(s.response_versions) == len(s.response_ids)
        assert not len(s.response_versions) or int(s.response_versions.min()) >= 0
        assert len(s.logprobs) in (0, len(s.response_ids))
        assert s.response_versions.dtype == np.int32
        assert isinstance(s.score, float | None)
        assert isinstance(s.text, str)
    _ = group.reward_mean, group.prompt.group_id, dict(group.prompt.meta), group.response_tokens


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=PATHS, value=JSON, shared=st.booleans())
def test_garbage_anywhere_in_meta_is_a_decode_error_or_a_usable_group(
    path: tuple[Any, ...], value: Any, shared: bool
) -> None:
    group = good_group(n=2)
    if not shared:
        group.samples[1].prompt_ids = np.asarray([4, 5], dtype=np.int32)
    raw = group_raw(group)
    try:
        garbled = with_meta(raw, lambda m: set_path(m, path, value))
    except (KeyError, IndexError, TypeError):
        return  # the path does not exist in this shape of group
    try:
        decoded = codec.decode_group(garbled)
    except DecodeError:
        return
    usable(decoded)


PLAIN_FIELDS = [
    b"meta", b"prompt_ids", b"response_ids", b"logprobs", b"model_step", b"status", b"attempt",
    b"group_id", b"task", b"producer",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(PLAIN_FIELDS),
    value=st.binary(max_size=24) | st.sampled_from([b"99999999999", b"-1", b"nan", b"1e11", b"\xff"]),
)
def test_garbage_in_any_plain_field_is_a_decode_error_or_a_usable_group(field: bytes, value: bytes) -> None:
    try:
        decoded = codec.decode_group({**aborted_raw(), field: value})
    except DecodeError:
        return
    usable(decoded)


@settings(max_examples=300, deadline=None)
@given(data=st.dictionaries(st.sampled_from(["uid", "task", "prompt", "prompt_ids", "meta"]), JSON))
def test_any_json_as_prompt_data_is_a_decode_error_or_a_usable_prompt(data: dict[str, Any]) -> None:
    try:
        prompt = codec.decode_prompt({b"data": orjson.dumps(data)})
    except DecodeError:
        return
    assert isinstance(prompt.uid, str) and isinstance(prompt.task, str) and isinstance(prompt.meta, dict)
    if isinstance(prompt.prompt, list):
        assert prompt.prompt and all(isinstance(m["content"], str | list) for m in prompt.prompt)
    else:
        assert isinstance(prompt.prompt, str)


# --- the buffer: one bad entry is dead-lettered at once, the rest flow ---------------------------


def test_a_bad_prompt_is_dead_lettered_and_acked_at_its_first_delivery(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.feed(prompts("math", 1))
    stream = buffer.keys.prompts("math")
    bad = buffer.client.xadd(stream, prompt_raw(prompt=5))  # type: ignore[arg-type]
    buffer.feed(prompts("math", 1, start=1))

    claims = buffer.claim("math", 3)

    assert [c.prompt.uid for c in claims] == ["u0", "u1"]
    ((_, dead),) = buffer.client.xrange(buffer.keys.dead)
    assert dead[b"source_id"] == bad and dead[b"attempts"] == b"1"
    assert b"prompt" in dead[b"reason"] and b"undecodable prompt entry" in dead[b"reason"]
    pending = buffer.client.xpending_range(stream, PRODUCERS, "-", "+", 10)
    assert bad not in [p["message_id"] for p in pending] and len(pending) == 2


def test_an_eval_prompt_that_names_no_batch_is_dead_lettered(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.ensure("math")
    stream = buffer.keys.evals("math")
    buffer.client.xadd(stream, prompt_raw())  # type: ignore[arg-type]
    buffer.client.xadd(stream, prompt_raw(uid="u2", meta={"rollstream_batch": "b1"}))  # type: ignore[arg-type]

    claims = buffer.claim("math", 2)

    assert [(c.prompt.uid, c.source) for c in claims] == [("u2", EVALS)]
    ((_, dead),) = buffer.client.xrange(buffer.keys.dead)
    assert b"names no batch" in dead[b"reason"]
    assert buffer.client.xpending(stream, PRODUCERS)["pending"] == 1


def test_a_group_with_a_string_score_is_dead_lettered_and_the_batch_keeps_the_rest(
    fake_buffer: BufferFactory,
) -> None:
    producer, trainer = fake_buffer("p1"), fake_buffer("trainer")
    producer.feed(prompts("math", 2))
    for claim in producer.claim("math", 2):
        producer.complete(claim, group_for(claim.prompt))
    groups = trainer.keys.groups("math")
    bad = trainer.client.xadd(groups, with_meta(group_raw(), sample_meta(reward={"score": "1"})))  # type: ignore[arg-type]

    batch = trainer.read_batch("math", 5)

    assert [g.prompt.uid for g in batch.groups] == ["u0", "u1"]
    ((_, dead),) = trainer.client.xrange(trainer.keys.dead)
    assert dead[b"source_id"] == bad and b"score" in dead[b"reason"]
    assert trainer.client.xpending(groups, "trainer")["pending"] == 2


# --- events and the state hash --------------------------------------------------------------------


def test_malformed_events_are_skipped_once_with_a_warning_naming_id_and_field(
    fake_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    control = RunControl(fake_client, Keys("exp"))
    start = control.last_event_id()
    events = control.keys.events
    bad_step = fake_client.xadd(
        events, {"type": WEIGHT_SYNC, "model_step": 99999999999, "uri": "", "ts": 1.0}
    )
    control.publish(WEIGHT_SYNC, 2)
    bad_int = fake_client.xadd(events, {"type": WEIGHT_SYNC, "model_step": "two", "ts": 1.0})
    bad_ts = fake_client.xadd(events, {"type": PAUSE, "model_step": -1, "ts": "soon"})
    no_step = fake_client.xadd(events, {"type": WEIGHT_SYNC, "ts": 1.0})
    control.publish(STOP)

    with caplog.at_level(logging.WARNING, logger="rollstream.shared.events"):
        got = control.events(start)

    assert [(e.type, e.model_step) for e in got] == [(WEIGHT_SYNC, 2), (STOP, -1)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4
    for entry_id, field, warning in zip(
        (bad_step, bad_int, bad_ts, no_step),
        ("model_step", "model_step", "ts", "model_step"),
        warnings,
        strict=True,
    ):
        assert entry_id.decode() in warning and field in warning


def test_trailing_malformed_events_are_read_and_warned_about_only_once(
    fake_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    control = RunControl(fake_client, Keys("exp"))
    first = control.publish(WEIGHT_SYNC, 1)
    fake_client.xadd(control.keys.events, {"type": WEIGHT_SYNC, "model_step": "x", "ts": 1.0})
    with caplog.at_level(logging.WARNING, logger="rollstream.shared.events"):
        assert control.events(first) == []
        assert control.events(first) == []  # the caller's cursor did not move: no second warning
        later = control.publish(WEIGHT_SYNC, 3)
        assert [e.id for e in control.events(first)] == [later]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.parametrize("value", [b"abc", b"99999999999", b"-3", b"1.5", b"", b"\xff"])
@pytest.mark.parametrize("field", [MODEL_STEP, TRAIN_STEP])
def test_a_corrupt_step_in_the_state_hash_names_key_and_field(
    fake_client: redis.Redis, field: str, value: bytes
) -> None:
    control = RunControl(fake_client, Keys("exp"))
    fake_client.hset(control.keys.state, field, value)
    read = control.model_step if field == MODEL_STEP else control.train_step
    with pytest.raises(CorruptValueError) as info:
        read()
    assert isinstance(info.value, RollstreamError)
    assert f"rs:{{exp}}:state field {field} is " in str(info.value)
    assert "not a step number" in str(info.value)


def test_the_example_message_of_a_corrupt_model_step(fake_client: redis.Redis) -> None:
    control = RunControl(fake_client, Keys("exp"))
    fake_client.hset(control.keys.state, MODEL_STEP, "abc")
    with pytest.raises(
        CorruptValueError, match=r"^rs:\{exp\}:state field model_step is 'abc', not a step number"
    ):
        control.model_step()


def test_steps_in_range_read_back(fake_client: redis.Redis) -> None:
    control = RunControl(fake_client, Keys("exp"))
    assert (control.model_step(), control.train_step()) == (0, 0)
    fake_client.hset(control.keys.state, mapping={MODEL_STEP: MAX_STEP, TRAIN_STEP: 7})
    assert (control.model_step(), control.train_step()) == (MAX_STEP, 7)


# --- progress counters ---------------------------------------------------------------------------

QUOTA = {"math": 1, "code": 1}  # the fixtures' two tasks; the targets are not what these tests check


@pytest.mark.parametrize("value", [b"many", b"1.5", b"1e3", b"\xff"])
def test_a_corrupt_progress_counter_names_key_and_field(fake_buffer: BufferFactory, value: bytes) -> None:
    buffer = fake_buffer("p1")
    buffer.client.hset(buffer.keys.progress, "math:completed", value)
    with pytest.raises(CorruptValueError, match=r"progress field math:completed is .*, not a count"):
        buffer.accepted("math")
    with pytest.raises(CorruptValueError, match=r"progress field math:completed is "):
        ProduceProgress(buffer.client, buffer.keys, QUOTA).counts("math")


def test_a_corrupt_reward_sum_names_key_and_field(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    progress = ProduceProgress(buffer.client, buffer.keys, QUOTA)
    buffer.client.hset(buffer.keys.progress, "math:reward_sum", "2.5")
    assert progress.counts("math")["reward_sum"] == 2.5
    buffer.client.hset(buffer.keys.progress, "math:reward_sum", "nan")
    with pytest.raises(CorruptValueError, match="math:reward_sum is 'nan', not a number"):
        progress.counts("math")


def test_a_corrupt_step_breaks_the_progress_snapshot_with_a_clear_error(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    progress = ProduceProgress(buffer.client, buffer.keys, QUOTA)
    buffer.client.hset(buffer.keys.state, TRAIN_STEP, "later")
    with pytest.raises(CorruptValueError, match="field train_step is 'later', not a step number"):
        progress.state_dict()


def test_good_counters_still_count(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.client.hset(buffer.keys.progress, mapping={"math:completed": 5, "math:expired": 2})
    assert buffer.accepted("math") == 3
    assert ProduceProgress(buffer.client, buffer.keys, QUOTA).counts("math")["completed"] == 5
