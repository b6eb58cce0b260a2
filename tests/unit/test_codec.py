from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import codec
from shared.errors import DecodeError
from shared.records import Group, Prompt, Sample, Status, group_status

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
JSON_SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False)
)
JSON = st.recursive(
    JSON_SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
TEXT_PROMPT = st.text(min_size=1, max_size=30)
CHAT_PROMPT = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}
    ),
    min_size=1,
    max_size=3,
)

prompts = st.builds(
    Prompt,
    uid=st.text(min_size=1, max_size=12),
    task=st.sampled_from(["math", "code"]),
    prompt=TEXT_PROMPT | CHAT_PROMPT,
    prompt_ids=st.none() | st.lists(INT32, max_size=10),
    meta=st.dictionaries(st.text(max_size=8), JSON, max_size=4),
)


@st.composite
def samples(draw: st.DrawFn, prompt_ids: list[int] | None = None) -> Sample:
    n = draw(st.integers(0, 40))
    with_logprobs = draw(st.booleans()) or n == 0
    # versions: a few runs of steps, as partial rollouts continued after weight syncs make
    steps = sorted(draw(st.lists(st.integers(0, 50), min_size=1, max_size=3)))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=len(steps) - 1, max_size=len(steps) - 1)))
    bounds = [0, *cuts, n]
    versions = [s for s, a, b in zip(steps, bounds, bounds[1:], strict=False) for _ in range(b - a)]
    return Sample(
        prompt_ids=prompt_ids if prompt_ids is not None else draw(st.lists(INT32, max_size=12)),
        response_ids=draw(st.lists(INT32, min_size=n, max_size=n)),
        logprobs=draw(st.lists(FLOAT32, min_size=n, max_size=n)) if with_logprobs else [],
        response_versions=versions,
        finish_reason=draw(st.sampled_from([None, "stop", "length", "abort", "tool_calls"])),
        reward=draw(
            st.dictionaries(st.sampled_from(["score", "acc", "format"]), st.floats(-10, 10), max_size=3)
        ),
        status=draw(st.sampled_from(list(Status))),
        text=draw(st.text(max_size=30)),
    )


@st.composite
def groups(draw: st.DrawFn) -> Group:
    prompt = draw(prompts)
    shared = draw(st.booleans())
    ids = draw(st.lists(INT32, max_size=12)) if shared else None
    items = draw(st.lists(samples(ids), max_size=5))
    return Group.for_prompt(
        prompt,
        samples=items,
        model_step=draw(st.integers(-1, 100)),
        attempt=draw(st.integers(1, 5)),
        producer=draw(st.text(max_size=10)),
        created_at=draw(st.floats(0, 2e9)),
        timings=draw(st.dictionaries(st.sampled_from(["generate", "judge"]), st.floats(0, 100), max_size=2)),
        status=draw(st.none() | st.sampled_from(list(Status))),
    )


def through_redis_reply(fields: codec.Fields) -> dict[bytes, bytes]:
    """What a stream read hands back: every name and value as bytes."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


@settings(max_examples=200, deadline=None)
@given(groups())
def test_every_group_round_trips_exactly(group: Group) -> None:
    assert codec.decode_group(through_redis_reply(codec.encode_group(group))) == group


@settings(max_examples=200, deadline=None)
@given(prompts)
def test_every_prompt_round_trips_exactly(prompt: Prompt) -> None:
    assert codec.decode_prompt(through_redis_reply(codec.encode_prompt(prompt))) == prompt


def make_group(n: int = 4, tokens: int = 64) -> Group:
    rng = np.random.default_rng(0)
    prompt = Prompt(uid="u1", task="math", prompt="2+2?", meta={"answer": "4"})
    items = [
        Sample(
            prompt_ids=np.arange(16),
            response_ids=rng.integers(0, 150_000, tokens),
            logprobs=-rng.random(tokens),
            response_versions=[3] * (tokens // 2) + [4] * (tokens - tokens // 2),
            finish_reason="stop",
            reward={"score": float(i % 2)},
        )
        for i in range(n)
    ]
    return Group.for_prompt(prompt, samples=items)


def test_plain_fields_show_metadata_as_text() -> None:
    fields = codec.encode_group(make_group())
    assert fields["task"] == "math"
    assert fields["group_id"] == "math:u1"
    assert fields["model_step"] == 3
    assert fields["status"] == "completed"
    assert fields["n"] == 4
    assert float(fields["reward_mean"]) == 0.5  # type: ignore[arg-type]
    assert fields["response_tokens"] == 256
    assert fields["prompt_tokens"] == 16


def test_packed_tokens_are_smaller_than_json_lists() -> None:
    group = make_group(8, 2048)
    packed = sum(len(v) if isinstance(v, bytes) else len(str(v)) for v in codec.encode_group(group).values())
    as_json = len(
        orjson.dumps(
            [
                [s.response_ids.tolist(), s.logprobs.tolist(), s.response_versions.tolist()]
                for s in group.samples
            ]
        )
    )
    assert packed * 2 < as_json


def test_decoded_arrays_share_the_reply_buffer() -> None:
    raw = through_redis_reply(codec.encode_group(make_group()))
    group = codec.decode_group(raw)
    assert not group.samples[0].response_ids.flags.owndata
    assert group.samples[0].response_ids.dtype == np.dtype("<i4")
    assert group.samples[0].logprobs.dtype == np.dtype("<f4")


def test_model_step_is_the_oldest_token_version() -> None:
    group = make_group()
    group.samples[2].response_versions[0] = 1
    assert Group.for_prompt(group.prompt, samples=group.samples).model_step == 1


def test_group_status_precedence() -> None:
    assert group_status([Status.COMPLETED] * 3) == Status.COMPLETED
    assert group_status([Status.COMPLETED, Status.FILTERED, Status.ABORTED]) == Status.ABORTED
    assert group_status([Status.EXPIRED, Status.FAILED]) == Status.FAILED


def test_sample_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="response_versions"):
        Sample([1], [1, 2], [0.0, 0.0], [0])
    with pytest.raises(ValueError, match="logprobs"):
        Sample([1], [1, 2], [0.0], [0, 0])


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda f: f.pop(b"meta"), "missing field 'meta'"),
        (lambda f: f.__setitem__(b"meta", b"{nope"), "JSONDecodeError"),
        (lambda f: f.__setitem__(b"response_ids", f[b"response_ids"][:-3]), "ValueError"),
        (lambda f: f.__setitem__(b"response_ids", f[b"response_ids"][:-4]), "shorter"),
        (lambda f: f.__setitem__(b"logprobs", f[b"logprobs"] + b"\0\0\0\0"), "longer"),
        (lambda f: f.__setitem__(b"status", b"weird"), "ValueError"),
        (lambda f: f.__setitem__(b"model_step", b"x"), "ValueError"),
    ],
)
def test_undecodable_group_raises_decode_error_with_reason(mutate, reason: str) -> None:  # type: ignore[no-untyped-def]
    raw = through_redis_reply(codec.encode_group(make_group()))
    mutate(raw)
    with pytest.raises(DecodeError, match=reason):
        codec.decode_group(raw)


def test_undecodable_prompt_raises_decode_error() -> None:
    with pytest.raises(DecodeError, match="missing field"):
        codec.decode_prompt({b"uid": b"1"})
    with pytest.raises(DecodeError):
        codec.decode_prompt({b"data": b'{"uid": "1"}'})


def test_nan_logprobs_compare_equal_after_round_trip() -> None:
    group = make_group(1, 4)
    group.samples[0].logprobs[1] = math.nan
    assert codec.decode_group(through_redis_reply(codec.encode_group(group))) == group


def test_prompt_token_ids_shared_with_the_samples_are_stored_once() -> None:
    group = make_group()
    group.prompt.prompt_ids = list(range(16))  # the samples' prompt ids, as a tokenizer gives them
    fields = codec.encode_group(group)
    assert "prompt_ids" not in orjson.loads(fields["meta"])["prompt"]  # type: ignore[arg-type]
    decoded = codec.decode_group(through_redis_reply(fields))
    assert decoded == group
    assert decoded.prompt.prompt_ids == list(range(16))


def test_decoded_versions_are_read_only_views() -> None:
    decoded = codec.decode_group(through_redis_reply(codec.encode_group(make_group(2, 8))))
    versions = decoded.samples[0].response_versions
    assert not versions.flags.writeable
    with pytest.raises(ValueError):
        versions[0] = 9


def test_version_runs_split_at_every_sample_boundary_even_without_a_change() -> None:
    arrays = [[3, 3], [3, 4, 4], [], [4], [5, 5, 6]]
    runs = codec._runs([np.asarray(a, dtype=np.int32) for a in arrays])
    assert runs == [[[3, 2]], [[3, 1], [4, 2]], [], [[4, 1]], [[5, 2], [6, 1]]]
    assert codec._runs([np.zeros(0, dtype=np.int32)] * 2) == [[], []]


def test_samples_with_equal_multi_run_versions_share_one_decoded_array() -> None:
    group = build_group_with_runs()
    decoded = codec.decode_group(through_redis_reply(codec.encode_group(group)))
    first, second = (s.response_versions for s in decoded.samples)
    assert first is second and not first.flags.writeable
    assert first.tolist() == [1, 1, 2]


def build_group_with_runs() -> Group:
    prompt = Prompt(uid="u", task="math", prompt="p")
    samples = [
        Sample(prompt_ids=[1], response_ids=[7, 8, 9], logprobs=[], response_versions=[1, 1, 2]) for _ in "ab"
    ]
    return Group.for_prompt(prompt, samples=samples)


def test_strided_token_arrays_encode_as_their_values() -> None:
    every_other = np.arange(20, dtype=np.int32)[::2]
    sample = Sample(prompt_ids=every_other, response_ids=every_other, logprobs=[], response_versions=[0] * 10)
    group = Group.for_prompt(Prompt(uid="u", task="math", prompt="p"), samples=[sample])
    decoded = codec.decode_group(through_redis_reply(codec.encode_group(group)))
    assert decoded.samples[0].response_ids.tolist() == list(range(0, 20, 2))
