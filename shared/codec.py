"""Stream-entry encoding of the records: orjson for structure, packed bytes for tokens.

Measured on the reference 2-core machine (bench/codec.py prints it again):
an 8 x 2,048-token group round-tripped through Redis about 8x faster with
token ids and logprobs packed as little-endian int32 / float32 bytes than as
JSON lists, and 3x smaller. So a group entry is:

    task group_id model_step status n attempt producer      plain text fields that
    reward_mean prompt_tokens response_tokens               redis-cli XRANGE shows
    meta           orjson: prompt record, per-sample lengths, finish reasons,
                   rewards, statuses, texts, run-length-encoded versions, timings
    prompt_ids     int32 LE bytes, stored once when all samples share them
    response_ids   int32 LE bytes, all samples concatenated
    logprobs       float32 LE bytes, all samples concatenated

Big payloads are split over several fields because hiredis packs one huge
field slower than redis-py does. Decoding slices one buffer per field
(``np.frombuffer``), so no token is copied. ``response_versions`` is nearly
always one or two runs of the same step, so it travels as [step, count] runs.

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
RawFields = Mapping[bytes, bytes]

_EMPTY_IDS = np.zeros(0, dtype=ID_DTYPE)


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


def _runs(versions: IdArray) -> list[list[int]]:
    if len(versions) == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(versions)) + 1))
    counts = np.diff(np.append(starts, len(versions)))
    return np.stack((versions[starts], counts), axis=1).tolist()  # type: ignore[no-any-return]


def _unruns(runs: list[list[int]]) -> IdArray:
    if not runs:
        return _EMPTY_IDS
    values, counts = zip(*runs, strict=True)
    if min(counts) < 1:
        raise ValueError("version run with a count below 1")
    return np.repeat(np.asarray(values, dtype=ID_DTYPE), counts)


def encode_group(group: Group) -> Fields:
    samples = group.samples
    first_prompt = samples[0].prompt_ids if samples else _EMPTY_IDS
    shared_prompt = all(np.array_equal(s.prompt_ids, first_prompt) for s in samples[1:])
    sample_meta = []
    for s in samples:
        item: dict[str, Any] = {
            "len": len(s.response_ids),
            "lp": len(s.logprobs),
            "ver": _runs(s.response_versions),
            "finish": s.finish_reason,
            "reward": s.reward,
            "status": s.status.value,
            "text": s.text,
        }
        if not shared_prompt:
            item["plen"] = len(s.prompt_ids)
        sample_meta.append(item)
    meta = {
        "prompt": prompt_to_dict(group.prompt),
        "samples": sample_meta,
        "shared_prompt": shared_prompt,
        "created_at": group.created_at,
        "timings": group.timings,
    }
    reward_mean = group.reward_mean
    status = group.status or Status.COMPLETED
    prompt_ids = first_prompt if shared_prompt else np.concatenate([s.prompt_ids for s in samples])
    return {
        "task": group.task,
        "group_id": group.group_id,
        "model_step": group.model_step,
        "status": status.value,
        "n": len(samples),
        "attempt": group.attempt,
        "producer": group.producer,
        "reward_mean": "" if reward_mean is None else repr(reward_mean),
        "prompt_tokens": len(first_prompt) if shared_prompt else len(prompt_ids),
        "response_tokens": group.response_tokens,
        "meta": orjson.dumps(meta),
        "prompt_ids": prompt_ids.astype(ID_DTYPE, copy=False).tobytes(),
        "response_ids": b"".join(s.response_ids.astype(ID_DTYPE, copy=False).tobytes() for s in samples),
        "logprobs": b"".join(s.logprobs.astype(LOGPROB_DTYPE, copy=False).tobytes() for s in samples),
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
    samples = []
    r = lp = p = 0
    for item in meta["samples"]:
        n, nlp = item["len"], item["lp"]
        if shared_prompt:
            sample_prompt = prompt_ids
        else:
            sample_prompt = prompt_ids[p : p + item["plen"]]
            p += item["plen"]
        versions = _unruns(item["ver"])
        if r + n > len(response_ids) or lp + nlp > len(logprobs) or len(versions) != n:
            raise DecodeError("token arrays are shorter than the sample lengths say", fields)
        samples.append(
            Sample(
                prompt_ids=sample_prompt,
                response_ids=response_ids[r : r + n],
                logprobs=logprobs[lp : lp + nlp],
                response_versions=versions,
                finish_reason=item["finish"],
                reward=item["reward"],
                status=Status(item["status"]),
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


def field_text(fields: RawFields, name: str, default: str = "") -> str:
    """A plain field as text, for logs and dead letters; never raises."""
    value = fields.get(name.encode())
    return default if value is None else value.decode("utf-8", "replace")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        name = exc.args[0]
        return f"missing field {name.decode() if isinstance(name, bytes) else name!r}"
    return f"{type(exc).__name__}: {exc}"
