"""Group entries read back into Groups, every value checked on the way: the one place
where what a group entry holds is checked (shared/codec.py's ``decode_group`` adds the
format, the stream's task and the plain fields that repeat the packed ones). A bad entry
is a DecodeError with the reason, never another exception. Every length, count and
version run is checked against the entry's own byte sizes before anything is allocated,
and every value against the type and range its user needs; the checks are comparisons
per sample and per run, never per token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import orjson

from rollstream.shared.errors import DecodeError
from rollstream.shared.prompt_entries import prompt_from_dict
from rollstream.shared.records import (
    ID_DTYPE,
    LOGPROB_DTYPE,
    MASK_DTYPE,
    MAX_STEP,
    FloatArray,
    Group,
    IdArray,
    MaskArray,
    Sample,
    Status,
    Turn,
)
from rollstream.shared.wire import RawFields, reason, shown

T = TypeVar("T")

_EMPTY_IDS = np.zeros(0, dtype=ID_DTYPE)
_STATUS = {status.value: status for status in Status}
_INT64_MAX = 2**63 - 1


def read_group(fields: RawFields) -> Group:
    """The Group a group entry holds, each of its values checked (DecodeError: why not)."""
    meta = _field(fields, b"meta", orjson.loads)
    if type(meta) is not dict:
        raise DecodeError(f"meta is {shown(meta)}, not a JSON object")
    prompt_ids = _field(fields, b"prompt_ids", _ids)
    response_ids = _field(fields, b"response_ids", _ids)
    logprobs = _field(fields, b"logprobs", _logprobs)
    shared_prompt, items = meta["shared_prompt"], meta["samples"]
    if type(shared_prompt) is not bool:
        raise DecodeError(f"shared_prompt is {shown(shared_prompt)}, not true or false")
    if type(items) is not list:
        raise DecodeError(f"samples is {shown(items)}, not a list")
    samples, runs_of, longest, masks_of = _samples(items, shared_prompt, prompt_ids, response_ids, logprobs)
    # only now, with every count checked against the entry's own sizes, allocate versions
    # (and the loss masks of agent trajectories)
    pool = _version_pool(longest)
    for sample, runs in zip(samples, runs_of, strict=True):
        sample.response_versions = _unruns(runs, pool)
    for i, mask_runs in masks_of.items():
        samples[i].loss_mask = _mask(mask_runs)
    created_at, timings = meta["created_at"], meta["timings"]
    if type(created_at) is not float and type(created_at) is not int:
        raise DecodeError(f"created_at is {shown(created_at)}, not a time")
    if type(timings) is not dict or not set(map(type, timings.values())) <= {int, float}:
        raise DecodeError(f"timings is {shown(timings)}, not an object of seconds")
    prompt = prompt_from_dict(meta["prompt"])
    in_samples = meta.get("prompt_ids_in_samples", False)
    if type(in_samples) is not bool:
        raise DecodeError(f"prompt_ids_in_samples is {shown(in_samples)}, not true or false")
    if in_samples:  # int32 from bytes: nothing to check
        prompt.prompt_ids = prompt_ids.tolist()
    model_step = _field(fields, b"model_step", _model_step)
    # staleness is t - model_step - 1: a model_step above its tokens' versions would pass a
    # stale group off as fresh. Without a token (an expired-pool entry, every response
    # empty) it is whatever its writer gave.
    oldest = min((value for runs in runs_of for value, _ in runs), default=None)
    if oldest is not None and model_step != oldest:
        raise DecodeError(f"model_step {model_step} is not its oldest token version, {oldest}")
    return Group(
        group_id=_field(fields, b"group_id", _utf8),
        task=_field(fields, b"task", _utf8),
        prompt=prompt,
        samples=samples,
        model_step=model_step,
        status=_field(fields, b"status", _status),
        attempt=_field(fields, b"attempt", _attempt),
        producer=_field(fields, b"producer", _utf8),
        created_at=created_at,
        timings=timings,
    )


def _unruns(runs: list[list[int]], pool: dict[Any, IdArray]) -> IdArray:
    """Versions from runs (checked by _samples). A single run (the common case) is a
    view of one read-only array per step and group, and samples with the same runs share
    one array, so a group of n samples allocates once or twice, not n times."""
    if not runs:
        return _EMPTY_IDS
    if len(runs) == 1:
        value, count = runs[0]
        return pool[value][:count]
    key = tuple(map(tuple, runs))
    versions = pool.get(key)
    if versions is None:
        values, counts = zip(*runs, strict=True)
        versions = np.repeat(np.asarray(values, dtype=ID_DTYPE), counts)
        versions.flags.writeable = False  # like every other array of a decoded group
        pool[key] = versions
    return versions


def _version_pool(longest: dict[int, int]) -> dict[Any, IdArray]:
    pool: dict[Any, IdArray] = {}
    for value, count in longest.items():
        array = np.full(count, value, dtype=ID_DTYPE)
        array.flags.writeable = False
        pool[value] = array
    return pool


def _samples(
    items: list[Any], shared_prompt: bool, prompt_ids: IdArray, response_ids: IdArray, logprobs: FloatArray
) -> tuple[list[Sample], list[list[list[int]]], dict[int, int], dict[int, list[list[int]]]]:
    """The samples, each checked, as views of the token arrays (a slice allocates nothing,
    whatever its bounds), with their version runs still to be turned into arrays; the
    longest single run per step, what the version pool allocates; and the loss-mask runs
    of the samples that have one, by sample index, also still to be made arrays. Every size and run is
    checked against the entry's own token arrays first: a run claiming 1e11 tokens would
    otherwise ask numpy for hundreds of GiB. ``type(x) is`` checks in one loop: this runs
    for every group a trainer reads (bench/codec.py)."""
    samples: list[Sample] = []
    runs_of: list[list[list[int]]] = []
    longest: dict[int, int] = {}
    masks_of: dict[int, list[list[int]]] = {}
    r = lp = p = 0
    for i, item in enumerate(items):
        if type(item) is not dict:
            raise DecodeError(f"sample {i} is {shown(item)}, not an object")
        n, nlp = item["len"], item["lp"]
        if type(n) is not int or n < 0:
            raise DecodeError(f"sample {i} has len {shown(n)}, not a token count")
        if type(nlp) is not int or nlp < 0:
            raise DecodeError(f"sample {i} has lp {shown(nlp)}, not a token count")
        if nlp and nlp != n:
            raise DecodeError(f"sample {i} has {nlp} logprobs for {n} tokens")
        if shared_prompt:
            sample_prompt = prompt_ids
        else:
            plen = item["plen"]
            if type(plen) is not int or plen < 0:
                raise DecodeError(f"sample {i} has plen {shown(plen)}, not a token count")
            sample_prompt = prompt_ids[p : p + plen]
            p += plen
        runs = item["ver"]
        if type(runs) is not list:
            raise DecodeError(f"sample {i} has version runs {shown(runs)}, not [step, count] pairs")
        counted = 0
        try:
            for value, count in runs:  # one or two runs, rarely more: never one per token
                if type(count) is not int or count < 1:
                    raise DecodeError(f"sample {i} has version runs {shown(runs)}: a count below 1")
                if type(value) is not int or not 0 <= value <= MAX_STEP:
                    raise DecodeError(f"sample {i} has version {shown(value)}, not a step in 0..{MAX_STEP}")
                counted += count
        except (TypeError, ValueError):  # not pairs: a run of another length, or no list at all
            raise DecodeError(f"sample {i} has version runs {shown(runs)}, not [step, count] pairs") from None
        if counted != n:
            raise DecodeError(f"sample {i} has version runs for {counted} tokens, not its {n}")
        if len(runs) == 1 and longest.get(value, 0) < n:
            longest[value] = n
        reward = item["reward"]
        if reward is None:
            reward = {}
        elif type(reward) is not dict:
            raise DecodeError(f"sample {i} has reward {shown(reward)}, not an object")
        else:
            # the trainer takes float(score): only the score must be a number, other entries
            # are the judge's own (and may be text)
            score = reward.get("score")
            if score is not None and type(score) is not float and type(score) is not int:
                raise DecodeError(f"sample {i} has reward score {shown(score)}, not a number")
        finish, status, text = item["finish"], item["status"], item["text"]
        if finish is not None and type(finish) is not str:
            raise DecodeError(f"sample {i} has finish {shown(finish)}, not text")
        if type(status) is not str or status not in _STATUS:
            raise DecodeError(f"sample {i} has status {shown(status)}, not one of {', '.join(_STATUS)}")
        if type(text) is not str:
            raise DecodeError(f"sample {i} has text {shown(text)}, not text")
        sample = Sample.of_arrays(
            sample_prompt,
            response_ids[r : r + n],
            logprobs[lp : lp + nlp],
            _EMPTY_IDS,
            finish_reason=finish,
            reward=reward,
            status=_STATUS[status],
            text=text,
        )
        if "mask" in item or "turns" in item or "agent" in item:  # format 1.1: a trajectory
            mask_runs = _trajectory_fields(i, item, n, sample)
            if mask_runs is not None:
                masks_of[i] = mask_runs
        samples.append(sample)
        runs_of.append(runs)
        r += n
        lp += nlp
    for name, have, want in (
        ("response_ids", len(response_ids), r),
        ("logprobs", len(logprobs), lp),
        ("prompt_ids", len(prompt_ids), len(prompt_ids) if shared_prompt else p),
    ):
        if have != want:
            which = "shorter" if have < want else "longer"
            raise DecodeError(
                f"token arrays are {which} than the sample lengths say: {name} holds {have}, not {want}"
            )
    return samples, runs_of, longest, masks_of


def _trajectory_fields(i: int, item: dict[str, Any], n: int, sample: Sample) -> list[list[int]] | None:
    """An agent trajectory's turns and status set on ``sample``, checked against its ``n``
    response tokens; its mask returned as checked runs (``_mask`` makes the array once
    the entry's sizes are checked too), None when it has none."""
    runs = item.get("mask")
    if runs is not None:
        if type(runs) is not list:
            raise DecodeError(f"sample {i} has mask runs {shown(runs)}, not [value, count] pairs")
        counted = 0
        for run in runs:
            if type(run) is not list or len(run) != 2:
                raise DecodeError(f"sample {i} has mask runs {shown(runs)}, not [value, count] pairs")
            value, count = run
            if type(value) is not int or value not in (0, 1):
                raise DecodeError(f"sample {i} has mask value {shown(value)}, not 0 or 1")
            if type(count) is not int or count < 1:
                raise DecodeError(f"sample {i} has mask runs {shown(runs)}: a count below 1")
            counted += count
        if counted != n:
            raise DecodeError(f"sample {i} has mask runs for {counted} tokens, not its {n}")
    turns = item.get("turns")
    if turns is not None:
        if type(turns) is not list:
            raise DecodeError(f"sample {i} has turns {shown(turns)}, not a list")
        sample.turns = [_turn(i, j, t) for j, t in enumerate(turns)]
        covered = sum(t.length for t in sample.turns)
        if covered != n:
            raise DecodeError(f"sample {i} has turns of {covered} tokens, not its {n}")
    agent = item.get("agent")
    if agent is not None and type(agent) is not str:
        raise DecodeError(f"sample {i} has agent status {shown(agent)}, not text")
    sample.agent_status = agent
    return runs


def _turn(i: int, j: int, data: object) -> Turn:
    if type(data) is not dict:
        raise DecodeError(f"sample {i} turn {j} is {shown(data)}, not an object")
    role, length = data.get("role"), data.get("len")
    if type(role) is not str:
        raise DecodeError(f"sample {i} turn {j} has role {shown(role)}, not text")
    if type(length) is not int or length < 0:
        raise DecodeError(f"sample {i} turn {j} has len {shown(length)}, not a token count")
    text, reward = data.get("text", ""), data.get("reward")
    status, name = data.get("status"), data.get("name")
    if type(text) is not str:
        raise DecodeError(f"sample {i} turn {j} has text {shown(text)}, not text")
    if reward is not None and type(reward) is not float and type(reward) is not int:
        raise DecodeError(f"sample {i} turn {j} has reward {shown(reward)}, not a number")
    for key, value in (("status", status), ("name", name)):
        if value is not None and type(value) is not str:
            raise DecodeError(f"sample {i} turn {j} has {key} {shown(value)}, not text")
    return Turn(role, length, text, None if reward is None else float(reward), status, name)


def _mask(runs: list[list[int]]) -> MaskArray:
    if runs:
        values, counts = zip(*runs, strict=True)
        mask = np.repeat(np.asarray(values, dtype=MASK_DTYPE), counts)
    else:
        mask = np.zeros(0, dtype=MASK_DTYPE)
    mask.flags.writeable = False  # like every other array of a decoded group
    return mask


def _field(fields: RawFields, name: bytes, parse: Callable[[Any], T]) -> T:
    """One field parsed, its name in the reason when it does not parse (a missing one is
    a KeyError: "missing field")."""
    value = fields[name]
    try:
        return parse(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise DecodeError(f"{name.decode()}: {reason(exc)}") from None


def _ids(value: bytes) -> IdArray:
    return np.frombuffer(value, dtype=ID_DTYPE)


def _logprobs(value: bytes) -> FloatArray:
    return np.frombuffer(value, dtype=LOGPROB_DTYPE)


def _utf8(value: bytes) -> str:
    return value.decode()


def _status(value: bytes) -> Status:
    return Status(value.decode())


def _model_step(value: bytes) -> int:
    step = int(value)
    # -1: a group without a response token (an aborted one, say) has no step yet
    if not -1 <= step <= MAX_STEP:
        raise DecodeError(f"model_step {step} is outside -1..{MAX_STEP}")
    return step


def _attempt(value: bytes) -> int:
    attempt = int(value)
    if not 0 <= attempt <= _INT64_MAX:
        raise DecodeError(f"attempt {attempt} is outside 0..{_INT64_MAX}")
    return attempt
