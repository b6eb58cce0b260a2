"""Stream-entry encoding of the records: orjson for structure, packed bytes for tokens.

Measured by bench/codec.py (2-core machine, 8 x 2,048 response + 512 prompt
tokens): packing token ids and logprobs as little-endian int32 / float32
bytes makes a group 3.5x smaller than JSON lists (131 KiB against 459 KiB),
encodes and decodes it 12x faster (21x counting the conversion of lists into
records), and round-trips it through Redis about 4x faster. So a group entry is:

    task group_id model_step status n attempt producer      plain text fields that
    reward_mean prompt_tokens response_tokens               redis-cli XRANGE shows
    meta           orjson: prompt record, per-sample lengths, finish reasons,
                   rewards, statuses, texts, run-length-encoded versions, timings
    prompt_ids     int32 LE bytes, stored once when all samples share them
    response_ids   int32 LE bytes, all samples concatenated
    logprobs       float32 LE bytes, all samples concatenated

Decoding slices one buffer per field (``np.frombuffer``), so no token is
copied and the arrays of a decoded group are read-only views.
``response_versions`` is nearly always one or two runs of the same step, so
it travels as [step, count] runs.

A fresh prompt entry is ``uid task data`` with the Prompt as orjson in ``data``.

Token arrays round-trip bit for bit (NaN logprobs included). The JSON parts
(meta, rewards, texts) follow JSON: a non-finite float there becomes null.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from shared.errors import DecodeError
from shared.records import ID_DTYPE, LOGPROB_DTYPE, Group, IdArray, Prompt, Sample, Status

Fields = dict[str, bytes | str | int | float]
WireFields = dict[str, bytes | str | int | float | tuple[np.ndarray, ...]]
RawFields = Mapping[bytes, bytes]

_EMPTY_IDS = np.zeros(0, dtype=ID_DTYPE)
_STATUS = {status.value: status for status in Status}


# --- prompts ---------------------------------------------------------------------------


def prompt_to_dict(prompt: Prompt) -> dict[str, Any]:
    out: dict[str, Any] = {"uid": prompt.uid, "task": prompt.task, "prompt": prompt.prompt}
    if prompt.prompt_ids is not None:
        out["prompt_ids"] = prompt.prompt_ids
    if prompt.meta:
        out["meta"] = prompt.meta
    return out


def prompt_from_dict(data: Mapping[str, Any]) -> Prompt:
    return Prompt(
        uid=data["uid"],
        task=data["task"],
        prompt=data["prompt"],
        prompt_ids=data.get("prompt_ids"),
        meta=data.get("meta", {}),
    )


def encode_prompt(prompt: Prompt) -> Fields:
    return {"uid": prompt.uid, "task": prompt.task, "data": orjson.dumps(prompt_to_dict(prompt))}


def decode_prompt(fields: RawFields) -> Prompt:
    try:
        return prompt_from_dict(orjson.loads(fields[b"data"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise DecodeError(f"undecodable prompt entry: {_reason(exc)}", fields) from None


# --- groups ----------------------------------------------------------------------------


def _runs(arrays: list[IdArray]) -> list[list[list[int]]]:
    """Each sample's versions as [step, count] runs, from one scan of the whole group
    (a few array operations per group rather than per sample)."""
    lengths = [len(a) for a in arrays]
    if not any(lengths):
        return [[] for _ in arrays]
    versions = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    changes = (np.flatnonzero(versions[1:] != versions[:-1]) + 1).tolist()
    out, j, start = [], 0, 0
    for n in lengths:
        end = start + n
        runs: list[list[int]] = []
        if n:
            while j < len(changes) and changes[j] <= start:
                j += 1
            a = start
            while j < len(changes) and changes[j] < end:
                runs.append([int(versions[a]), changes[j] - a])
                a = changes[j]
                j += 1
            runs.append([int(versions[a]), end - a])
        out.append(runs)
        start = end
    return out


def _unruns(runs: list[list[int]], pool: dict[Any, IdArray]) -> IdArray:
    """Versions from runs. A single run (the common case) is a view of one read-only
    array per step and group, and samples with the same runs share one array, so a
    group of n samples allocates once or twice, not n times."""
    if not runs:
        return _EMPTY_IDS
    if len(runs) == 1:
        value, count = runs[0]
        if count < 1:
            raise ValueError("version run with a count below 1")
        return pool[value][:count]
    key = tuple(map(tuple, runs))
    versions = pool.get(key)
    if versions is None:
        values, counts = zip(*runs, strict=True)
        if min(counts) < 1:
            raise ValueError("version run with a count below 1")
        versions = np.repeat(np.asarray(values, dtype=ID_DTYPE), counts)
        versions.flags.writeable = False  # like every other array of a decoded group
        pool[key] = versions
    return versions


def _version_pool(sample_meta: list[dict[str, Any]]) -> dict[Any, IdArray]:
    longest: dict[int, int] = {}
    for item in sample_meta:
        runs = item["ver"]
        if len(runs) == 1:
            value, count = runs[0]
            longest[value] = max(longest.get(value, 0), count)
    pool: dict[Any, IdArray] = {}
    for value, count in longest.items():
        array = np.full(count, value, dtype=ID_DTYPE)
        array.flags.writeable = False
        pool[value] = array
    return pool


def encode_group(group: Group) -> Fields:
    """A group's stream-entry fields, every value as Redis stores it."""
    return {
        name: b"".join(array.data for array in value) if isinstance(value, tuple) else value
        for name, value in encode_group_parts(group).items()
    }


def encode_group_parts(group: Group) -> WireFields:
    """``encode_group`` with each token field left as the tuple of its samples' arrays,
    for a writer that copies them into its buffer once (shared/resp.py)."""
    samples = group.samples
    first = samples[0].prompt_ids if samples else _EMPTY_IDS
    shared_prompt = all(s.prompt_ids is first or np.array_equal(s.prompt_ids, first) for s in samples[1:])
    sample_meta = []
    for s, runs in zip(samples, _runs([s.response_versions for s in samples]), strict=True):
        item: dict[str, Any] = {
            "len": len(s.response_ids),
            "lp": len(s.logprobs),
            "ver": runs,
            "finish": s.finish_reason,
            "reward": s.reward,
            "status": s.status.value,
            "text": s.text,
        }
        if not shared_prompt:
            item["plen"] = len(s.prompt_ids)
        sample_meta.append(item)
    prompt = prompt_to_dict(group.prompt)
    # The prompt's own token ids are nearly always its samples' prompt ids: store them once.
    in_samples = bool(
        shared_prompt
        and samples
        and group.prompt.prompt_ids is not None
        and samples[0].prompt_ids.tolist() == group.prompt.prompt_ids
    )
    if in_samples:
        del prompt["prompt_ids"]
    meta = {
        "prompt": prompt,
        "prompt_ids_in_samples": in_samples,
        "samples": sample_meta,
        "shared_prompt": shared_prompt,
        "created_at": group.created_at,
        "timings": group.timings,
    }
    reward_mean = group.reward_mean
    status = group.status or Status.COMPLETED
    prompt_parts = (first,) if shared_prompt else tuple(s.prompt_ids for s in samples)
    return {
        "task": group.task,
        "group_id": group.group_id,
        "model_step": group.model_step,
        "status": status.value,
        "n": len(samples),
        "attempt": group.attempt,
        "producer": group.producer,
        "reward_mean": "" if reward_mean is None else repr(reward_mean),
        "prompt_tokens": sum(len(p) for p in prompt_parts),
        "response_tokens": group.response_tokens,
        "meta": orjson.dumps(meta),
        # Samples hold little-endian int32 / float32 arrays (records.as_ids): bytes as they are.
        "prompt_ids": prompt_parts,
        "response_ids": tuple(s.response_ids for s in samples),
        "logprobs": tuple(s.logprobs for s in samples),
    }


def decode_group(fields: RawFields) -> Group:
    try:
        return _decode_group(fields)
    except DecodeError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise DecodeError(f"undecodable group entry: {_reason(exc)}", fields) from None


def _decode_group(fields: RawFields) -> Group:
    meta = orjson.loads(fields[b"meta"])
    prompt_ids = np.frombuffer(fields[b"prompt_ids"], dtype=ID_DTYPE)
    response_ids = np.frombuffer(fields[b"response_ids"], dtype=ID_DTYPE)
    logprobs = np.frombuffer(fields[b"logprobs"], dtype=LOGPROB_DTYPE)
    shared_prompt = meta["shared_prompt"]
    if meta.get("prompt_ids_in_samples"):
        meta["prompt"]["prompt_ids"] = prompt_ids.tolist()
    pool = _version_pool(meta["samples"])
    samples = []
    r = lp = p = 0
    for item in meta["samples"]:
        n, nlp = item["len"], item["lp"]
        if shared_prompt:
            sample_prompt = prompt_ids
        else:
            sample_prompt = prompt_ids[p : p + item["plen"]]
            p += item["plen"]
        versions = _unruns(item["ver"], pool)
        if r + n > len(response_ids) or lp + nlp > len(logprobs) or len(versions) != n:
            raise DecodeError("token arrays are shorter than the sample lengths say", fields)
        if nlp not in (0, n):
            raise DecodeError(f"a sample has {nlp} logprobs for {n} tokens", fields)
        samples.append(
            Sample.of_arrays(
                sample_prompt,
                response_ids[r : r + n],
                logprobs[lp : lp + nlp],
                versions,
                finish_reason=item["finish"],
                reward=item["reward"] if item["reward"] is not None else {},
                status=_STATUS.get(item["status"]) or Status(item["status"]),
                text=item["text"],
            )
        )
        r += n
        lp += nlp
    if r != len(response_ids) or lp != len(logprobs) or (not shared_prompt and p != len(prompt_ids)):
        raise DecodeError("token arrays are longer than the sample lengths say", fields)
    return Group(
        group_id=fields[b"group_id"].decode(),
        task=fields[b"task"].decode(),
        prompt=prompt_from_dict(meta["prompt"]),
        samples=samples,
        model_step=int(fields[b"model_step"]),
        status=Status(fields[b"status"].decode()),
        attempt=int(fields[b"attempt"]),
        producer=fields[b"producer"].decode(),
        created_at=meta["created_at"],
        timings=meta["timings"],
    )


def is_group_entry(fields: RawFields) -> bool:
    return b"group_id" in fields


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        name = exc.args[0]
        return f"missing field {name.decode() if isinstance(name, bytes) else name!r}"
    return f"{type(exc).__name__}: {exc}"
