from __future__ import annotations

import itertools
import math

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.shared import codec
from rollstream.shared.errors import DecodeError
from rollstream.shared.group_encoding import _runs
from rollstream.shared.records import ENV, MODEL, TOOL, Group, Prompt, Sample, Status, Turn, group_status

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
    # model_step is the oldest token version (§5.2.2); only a group without tokens has any
    versions = [int(s.response_versions.min()) for s in items if len(s.response_versions)]
    return Group.for_prompt(
        prompt,
        samples=items,
        model_step=min(versions) if versions else draw(st.integers(-1, 100)),
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
@given(groups())
def test_every_group_has_a_summary_of_bounded_printable_ascii(group: Group) -> None:
    fields = codec.encode_group(group, summary=True)
    summary = fields["summary"]
    assert isinstance(summary, str) and summary.isascii() and summary.isprintable()
    assert len(summary) <= codec.SUMMARY_MAX
    assert summary.startswith(f"{group.task} step={group.model_step} n={group.n} ")
    assert codec.decode_group(through_redis_reply(fields)) == codec.decode_group(
        through_redis_reply(codec.encode_group(group))
    )


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
    runs = _runs([np.asarray(a, dtype=np.int32) for a in arrays])
    assert runs == [[[3, 2]], [[3, 1], [4, 2]], [], [[4, 1]], [[5, 2], [6, 1]]]
    assert _runs([np.zeros(0, dtype=np.int32)] * 2) == [[], []]


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


# --- agent trajectories (format 1.1) -------------------------------------------------------


@st.composite
def trajectories(draw: st.DrawFn) -> Sample:
    """A sample as an agent makes one: turns of the model and of others, a mask."""
    sample = draw(samples([1, 2, 3]))
    n = len(sample.response_ids)
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    bounds = [0, *cuts, n]
    turns = [
        Turn(
            role=draw(st.sampled_from([MODEL, ENV, TOOL])),
            length=b - a,
            text=draw(st.text(max_size=10)),
            reward=draw(st.none() | st.floats(-5, 5)),
            status=draw(st.none() | st.sampled_from(["ok", "timeout", "malformed"])),
            name=draw(st.none() | st.sampled_from(["calculator", "search"])),
        )
        for a, b in itertools.pairwise(bounds)
    ]
    sample.turns = draw(st.none() | st.just(turns))
    mask = [1 if t.role == MODEL else 0 for t in turns for _ in range(t.length)]
    sample.loss_mask = draw(st.none() | st.just(np.asarray(mask, dtype=np.uint8)))
    sample.agent_status = draw(st.none() | st.sampled_from(["done", "max_turns", "env_error"]))
    return sample


@settings(max_examples=100, deadline=None)
@given(st.lists(trajectories(), min_size=1, max_size=4))
def test_every_trajectory_round_trips_exactly(items: list[Sample]) -> None:
    group = Group.for_prompt(Prompt(uid="u", task="math", prompt="q"), samples=items)
    fields = codec.encode_group(group)
    decoded = codec.decode_group(through_redis_reply(fields))
    assert decoded == group
    agentic = any(s.turns is not None or s.loss_mask is not None or s.agent_status for s in items)
    assert fields["format"] == ("1.1" if agentic else "1.0")
    for sample in decoded.samples:
        if sample.loss_mask is not None:
            assert sample.loss_mask.dtype == np.uint8 and not sample.loss_mask.flags.writeable


def trajectory_group() -> Group:
    # prompt [1, 2]; model [10, 11], tool [20, 21, 22], model [12]
    sample = Sample(
        [1, 2],
        [10, 11, 20, 21, 22, 12],
        [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3],
        [0, 0, 0, 0, 0, 1],
        "stop",
        loss_mask=[1, 1, 0, 0, 0, 1],
        turns=[
            Turn(MODEL, 2, "call"),
            Turn(TOOL, 3, "result", status="ok", name="calculator"),
            Turn(MODEL, 1, "42", reward=1.0),
        ],
        agent_status="done",
    )
    return Group.for_prompt(Prompt(uid="u", task="math", prompt="q"), samples=[sample])


def test_a_trajectory_carries_its_mask_as_runs_turns_and_status_in_meta() -> None:
    fields = codec.encode_group(trajectory_group())
    assert fields["format"] == "1.1"
    (item,) = orjson.loads(fields["meta"])["samples"]
    assert item["mask"] == [[1, 2], [0, 3], [1, 1]]
    assert item["turns"] == [
        {"role": "model", "len": 2, "text": "call"},
        {"role": "tool", "len": 3, "text": "result", "status": "ok", "name": "calculator"},
        {"role": "model", "len": 1, "text": "42", "reward": 1.0},
    ]
    assert item["agent"] == "done"
    # the token fields are what they always were: the whole response, packed
    assert np.frombuffer(fields["response_ids"], "<i4").tolist() == [10, 11, 20, 21, 22, 12]


def test_a_plain_group_has_no_trajectory_keys_and_stays_1_0() -> None:
    fields = codec.encode_group(make_group())
    assert fields["format"] == "1.0"
    for item in orjson.loads(fields["meta"])["samples"]:
        assert not {"mask", "turns", "agent"} & set(item)


def test_sample_mask_and_turns_must_cover_the_response() -> None:
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 tokens"):
        Sample([1], [1, 2], [], [0, 0], loss_mask=[1])
    with pytest.raises(ValueError, match="turns cover 3 tokens"):
        Sample([1], [1, 2], [], [0, 0], turns=[Turn(MODEL, 3)])


def _set_item(key: str, value: object) -> object:
    def mutate(raw: dict[bytes, bytes]) -> None:
        meta = orjson.loads(raw[b"meta"])
        meta["samples"][0][key] = value
        raw[b"meta"] = orjson.dumps(meta)

    return mutate


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (_set_item("mask", [[1, 2], [0, 3]]), "mask runs for 5 tokens, not its 6"),
        (_set_item("mask", [[2, 6]]), "mask value 2, not 0 or 1"),
        (_set_item("mask", [[1, 0], [1, 6]]), "a count below 1"),
        (_set_item("mask", [[1, 1e11]]), "a count below 1"),
        (_set_item("mask", {"a": 1}), "not \\[value, count\\] pairs"),
        (_set_item("mask", [[1, 2, 3]]), "not \\[value, count\\] pairs"),
        (_set_item("turns", [{"role": "model", "len": 5}]), "turns of 5 tokens, not its 6"),
        (_set_item("turns", [{"role": 3, "len": 6}]), "turn 0 has role 3"),
        (_set_item("turns", [{"role": "model", "len": -1}, {"role": "env", "len": 7}]), "len -1"),
        (_set_item("turns", [{"role": "model", "len": 6, "reward": "high"}]), "reward 'high'"),
        (_set_item("turns", [{"role": "model", "len": 6, "status": 1}]), "status 1"),
        (_set_item("turns", ["model"]), "turn 0 is 'model', not an object"),
        (_set_item("agent", 7), "agent status 7, not text"),
    ],
)
def test_undecodable_trajectory_fields_raise_decode_error(mutate, reason: str) -> None:  # type: ignore[no-untyped-def]
    raw = through_redis_reply(codec.encode_group(trajectory_group()))
    mutate(raw)
    with pytest.raises(DecodeError, match=reason):
        codec.decode_group(raw)
