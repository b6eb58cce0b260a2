"""What the archiver writes of each entry it reads (consumer/archive.py): rows of the
archive's schema (consumer/archive_files.py), one per sample with the whole lineage in
every row, and the partition they go to: file set, run, task, and the train step's
folder or the fate."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from rollstream.shared import codec
from rollstream.shared.keys import Keys
from rollstream.shared.records import Group, Prompt
from rollstream.shared.scripts import DEAD_HEADER
from rollstream.shared.streams import text

TRAINED, UNTRAINED = "trained", "untrained"  # the two file sets
# sources: the stream kind in file names, and whether the archiver deletes what it acked
SOURCE_TRAINED, SOURCE_DEAD, SOURCE_FILTERED = "trained", "dead", "filtered"

Partition = tuple[str, ...]
Rows = list[dict[str, Any]]


def _json(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _prompt_columns(prompt: Prompt) -> dict[str, Any]:
    text_: str | None
    messages: str | None
    if isinstance(prompt.prompt, str):
        text_, messages = prompt.prompt, None
    else:
        users = [m.get("content") for m in prompt.prompt if m.get("role") == "user"]
        last = users[-1] if users else None
        text_ = last if isinstance(last, str) else _json(last)
        messages = _json(prompt.prompt)
    return {
        "uid": prompt.uid,
        "prompt": text_,
        "prompt_messages": messages,
        "prompt_ids": prompt.prompt_ids,
        "prompt_meta": _json(prompt.meta),
    }


def group_rows(run: str, group: Group, common: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per sample of ``group``, with ``common`` (fate, reason, steps, ids, times)."""
    train_step = common.get("train_step")
    base = {
        "run": run,
        "task": group.task,
        "group_id": group.group_id,
        "n": group.n,
        **_prompt_columns(group.prompt),
        "producer": group.producer,
        "attempt": group.attempt,
        "model_step": group.model_step,
        "staleness": None if train_step is None else train_step - group.model_step - 1,
        "created_at": group.created_at,
        "timings": _json(group.timings),
        **common,
    }
    if not group.samples:
        return [base]
    rows = []
    for i, s in enumerate(group.samples):
        rows.append(
            {
                **base,
                "sample_index": i,
                "prompt_ids": s.prompt_ids,
                "response": s.text,
                "response_ids": s.response_ids,
                "logprobs": s.logprobs,
                "versions": s.response_versions,
                "loss_mask": s.loss_mask,
                "turns": None if s.turns is None else _json([codec.turn_to_dict(t) for t in s.turns]),
                "agent_status": s.agent_status,
                "finish_reason": s.finish_reason,
                "sample_status": str(s.status),
                "reward": s.score,
                "reward_details": _json(s.reward),
                "response_tokens": len(s.response_ids),
            }
        )
    return rows


def _float(value: bytes | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:
        return None


def _int(value: bytes | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def original_fields(fields: Mapping[bytes, bytes], header: Iterable[str]) -> dict[bytes, bytes]:
    """An entry's own fields under a header of a copy (a dead letter's, a trained log's):
    the header's fields left out and ``orig.NAME`` named NAME again."""
    names = {h.encode() for h in header}
    out = {}
    for name, value in fields.items():
        if name in names:
            continue
        out[name[5:] if name.startswith(b"orig.") else name] = value
    return out


def _task_of(source: str, keys: Keys) -> str:
    parsed = keys.parse_stream(source)
    return parsed[1] if parsed else ""


def entry_rows(
    run: str,
    keys: Keys,
    kind: str,
    groups: str,
    entry_id: str,
    fields: Mapping[bytes, bytes],
    payload: Mapping[bytes, bytes],
) -> tuple[Partition, Rows]:
    """The rows of one entry of a source of ``kind``: ``fields`` the entry's, ``payload``
    the group's (the same but for a trained log's entry, whose group is in the groups
    stream ``groups``). DecodeError or FormatError when the entry does not decode."""
    common: dict[str, Any] = {"entry_id": entry_id, "archived_at": time.time()}
    if kind == SOURCE_TRAINED and fields.get(b"fate") == b"expired":
        group = codec.decode_group(payload)
        step = _int(fields.get(b"train_step"))
        common.update(
            fate="expired",
            reason=text(fields.get(b"reason", b"expired")),
            train_step=step if step is not None and step >= 0 else None,
            trained_at=_float(fields.get(b"trained_at")),
            trained_by=text(fields.get(b"trained_by", b"")),
            source=groups,
            source_id=text(fields.get(b"source_id", b"")),
            format=text(payload.get(b"format", b"1.0")),
        )
        return (UNTRAINED, run, group.task, "expired"), group_rows(run, group, common)
    if kind == SOURCE_TRAINED:
        group = codec.decode_group(payload)
        step = _int(fields.get(b"train_step"))
        common.update(
            fate="trained",
            train_step=step if step is not None and step >= 0 else None,
            trained_at=_float(fields.get(b"trained_at")),
            trained_by=text(fields.get(b"trained_by", b"")),
            source=groups,
            source_id=text(fields.get(b"source_id", b"")),
            format=text(payload.get(b"format", b"1.0")),
        )
        folder = f"step-{step:08d}" if step is not None and step >= 0 else "step-none"
        return (TRAINED, run, group.task, folder), group_rows(run, group, common)
    if kind == SOURCE_DEAD:
        own = original_fields(fields, DEAD_HEADER)
        origin = text(fields.get(b"source", b""))
        common.update(
            fate="dead",
            reason=f"dead letter: {text(fields.get(b'reason', b''))} "
            f"(after {text(fields.get(b'attempts', b'0'))} deliveries)",
            source=origin,
            source_id=text(fields.get(b"source_id", b"")),
            format=text(own.get(b"format", b"1.0")),
        )
        task = _task_of(origin, keys) or text(own.get(b"task", b"")) or "_unknown"
        partition = (UNTRAINED, run, task, "dead")
        if codec.is_group_entry(own):
            return partition, group_rows(run, codec.decode_group(own), common)
        prompt = codec.decode_prompt(own)
        row = {"run": run, "task": prompt.task, "group_id": prompt.group_id, **_prompt_columns(prompt)}
        return partition, [{**row, **common}]
    # filtered: a small record, no samples
    task = text(fields.get(b"task", b"")) or "_unknown"
    reward_mean = text(fields.get(b"reward_mean", b""))
    common.update(
        fate="filtered",
        reason=f"filtered: rejected by the producers' is_valid (reward mean {reward_mean or 'none'})",
        source=text(fields.get(b"source", b"")),
        source_id=text(fields.get(b"source_id", b"")),
        format=text(fields.get(b"format", b"1.0")),
    )
    row = {
        "run": run,
        "task": task,
        "uid": text(fields.get(b"uid", b"")),
        "group_id": text(fields.get(b"group_id", b"")),
        "n": _int(fields.get(b"n")),
        "producer": text(fields.get(b"producer", b"")),
        "attempt": _int(fields.get(b"attempt")),
        **common,
    }
    return (UNTRAINED, run, task, "filtered"), [row]


def undecodable_row(
    run: str, keys: Keys, kind: str, key: str, entry_id: str, fields: Mapping[bytes, bytes], why: str
) -> tuple[Partition, Rows]:
    """An entry of ``key``, a source of ``kind``, that does not decode: one row naming why,
    in the untrained set."""
    task = text(fields.get(b"task", b"")) or _task_of(text(fields.get(b"source", b"")), keys) or "_unknown"
    row = {
        "run": run,
        "task": task,
        "group_id": text(fields.get(b"group_id", b"")) or None,
        "fate": kind if kind != SOURCE_TRAINED else "trained",
        "reason": f"undecodable: {why}",
        "source": text(fields.get(b"source", b"")) or key,
        "source_id": text(fields.get(b"source_id", b"")) or entry_id,
        "entry_id": entry_id,
        "archived_at": time.time(),
    }
    return (UNTRAINED, run, task, "undecodable"), [row]
