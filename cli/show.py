"""``rollstream show``: the entries of one stream of a run, decoded for a person (or, with
``--json``, one JSON object per entry for scripts).

Entries are decoded with the same codec calls the producers and the trainer use, so
what an entry shows here is what they would read: a group, a prompt, or the DecodeError
that would dead-letter it. Token arrays are shown as counts: a group holds thousands of
ids that say nothing to a reader and would bury the fields that do.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
import redis

from rollstream.shared import codec
from rollstream.shared.connection import connect
from rollstream.shared.errors import InputError, RollstreamError
from rollstream.shared.keys import ABORTED, EVALS, EXPIRED, GROUPS, PROMPTS, STREAM_KINDS, Keys
from rollstream.shared.records import Group, IdArray, Prompt
from rollstream.shared.settings import Settings

# Streams of the run as a whole; the others are per task (shared/keys.py).
RUN_KINDS = ("events", "dead", "filtered", "metrics")
KINDS = (PROMPTS, ABORTED, EXPIRED, EVALS, GROUPS, *RUN_KINDS)
TEXT_CHARS = 80  # of each sample's text
PROMPT_CHARS = 200  # of a prompt, or of each chat message
VALUE_CHARS = 120  # of a plain field's value
SUMMARY_CHARS = codec.SUMMARY_MAX  # of a group entry's summary: what our writer may write
# Fields of a group entry (a dead letter carries them too) that hold packed token arrays.
TOKEN_FIELDS = frozenset({"prompt_ids", "response_ids", "logprobs"})
_ENTRY_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")
_INTEGER = re.compile(r"-?[0-9]{1,19}")
_DECIMAL = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")
# The fields of plain entries that hold numbers, as their writers set them (RunControl.publish,
# ReplayBuffer.dead_letter): --json gives these as numbers and every other field as the text
# Redis holds, so that a value like a format version "1.0" is never taken for a number.
# Metrics records (Producer.record_metrics) are numbers but for their producer's name.
NUMBERS = {"events": {"model_step", "ts"}, "dead": {"attempts"}, "filtered": {"attempt", "n", "reward_mean"}}
METRICS_TEXT = {"producer"}


def stream_key(keys: Keys, kind: str, task: str) -> str:
    if kind in RUN_KINDS:
        key: str = getattr(keys, kind)
        return key
    if kind not in STREAM_KINDS:
        raise InputError(f"unknown stream kind {kind!r}; known: {', '.join(KINDS)}")
    return keys.stream(kind, task)


def read_entries(
    client: redis.Redis, key: str, *, count: int, last: bool, entry_id: str | None
) -> list[tuple[str, dict[bytes, bytes]]]:
    reply: Any  # redis-py types a reply as whatever RESP could hold
    if entry_id is not None:
        if not _ENTRY_ID.fullmatch(entry_id):
            raise InputError(f"--id {entry_id!r} is not a stream entry id (like 1718000000000-0)")
        reply = client.xrange(key, min=entry_id, max=entry_id)
    elif last:
        reply = client.xrevrange(key, max="+", min="-", count=count)
    else:
        reply = client.xrange(key, min="-", max="+", count=count)
    return [(_text(i), dict(fields)) for i, fields in reply]


# --- one entry as a JSON-able record ------------------------------------------------------


def describe(kind: str, entry_id: str, fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    """An entry as a record of plain values: what --json prints and the text is made of,
    so that both carry the same numbers."""
    out: dict[str, Any] = {"id": entry_id}
    if kind in RUN_KINDS:
        out.update(_dead(fields) if kind == "dead" else {"kind": "fields", "fields": _plain(kind, fields)})
        return out
    try:
        # the library's own dispatch: the groups stream is read as groups (read_batch),
        # the pools as groups or prompts by their fields (ReplayBuffer._claims)
        if kind == GROUPS or codec.is_group_entry(fields):
            out.update(_group(codec.decode_group(fields)))
            # §5.2's field: the int32 values of the packed prompt_ids, once for a shared
            # prompt (the group's samples each hold the shared ids: n times as many)
            out["prompt_tokens"] = len(fields.get(b"prompt_ids", b"")) // 4
            # the writer's line about the group (codec.group_summary); older writers, and
            # buffer.summary off, wrote none
            summary = fields.get(b"summary")
            out["summary"] = None if summary is None else _text(summary)
        else:
            out.update(_prompt(codec.decode_prompt(fields)))
    except RollstreamError as exc:
        # a DecodeError, or an entry in a stream format this version does not read: either
        # way one entry's story, and the entries beside it are still worth showing
        out.update(kind="undecodable", error=str(exc), fields=_sizes(fields))
    return out


def _group(group: Group) -> dict[str, Any]:
    return {
        "kind": "group",
        "task": group.task,
        "group_id": group.group_id,
        "model_step": group.model_step,
        "status": group.status.value if group.status is not None else None,
        "n": group.n,
        "attempt": group.attempt,
        "producer": group.producer,
        "reward_mean": group.reward_mean,
        "prompt_tokens": group.prompt_tokens,
        "response_tokens": group.response_tokens,
        "created_at": group.created_at,
        "timings": group.timings,
        "prompt": _prompt(group.prompt),
        "samples": [
            {
                "tokens": len(s.response_ids),
                "prompt_tokens": len(s.prompt_ids),
                "logprobs": len(s.logprobs),
                "versions": version_runs(s.response_versions),
                "reward": s.reward,
                "finish": s.finish_reason,
                "status": s.status.value,
                "text": s.text,
            }
            for s in group.samples
        ],
    }


def _prompt(prompt: Prompt) -> dict[str, Any]:
    return {
        "kind": "prompt",
        "uid": prompt.uid,
        "task": prompt.task,
        "prompt": prompt.prompt,
        "prompt_tokens": None if prompt.prompt_ids is None else len(prompt.prompt_ids),
        "meta": prompt.meta,
    }


def _dead(fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    """A dead letter: why, how often and where from, and which prompt it was; the original
    entry's other fields by size (they are what failed to decode)."""
    names = {_text(name): value for name, value in fields.items()}
    out: dict[str, Any] = {"kind": "dead_letter"}
    for name in ("reason", "attempts", "source", "source_id"):
        if name in names:
            out[name] = _value(names.pop(name), name in NUMBERS["dead"])
    original = {name: _value(names[name], False) for name in ("task", "group_id", "uid") if name in names}
    out["original"] = original
    out["fields"] = {name: len(value) for name, value in names.items() if name not in original}
    return out


def version_runs(versions: IdArray) -> list[list[int]]:
    """[step, count] runs of a sample's token versions, as the codec stores them."""
    if not len(versions):
        return []
    starts = [0, *(np.flatnonzero(versions[1:] != versions[:-1]) + 1).tolist(), len(versions)]
    return [[int(versions[a]), b - a] for a, b in itertools.pairwise(starts)]


def _plain(kind: str, fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    out = {}
    for raw, value in fields.items():
        name = _text(raw)
        number = name not in METRICS_TEXT if kind == "metrics" else name in NUMBERS.get(kind, ())
        # token bytes can be valid UTF-8 (small ids are control characters): sized by name
        out[name] = {"bytes": len(value)} if name in TOKEN_FIELDS else _value(value, number)
    return out


def _value(value: bytes, number: bool) -> Any:
    """A plain field as text, or as a number where its writer stores one (text still when
    it does not parse: a hand-written value is shown as it is); a binary value as its size,
    which is all a reader can use of it."""
    try:
        shown = value.decode()
    except UnicodeDecodeError:
        return {"bytes": len(value)}
    if not number:
        return shown
    if _INTEGER.fullmatch(shown):
        return int(shown)
    # float() alone would take "nan", "inf", "1_0" and " 1" too
    if _DECIMAL.fullmatch(shown) and np.isfinite(parsed := float(shown)):
        return parsed
    return shown


def _sizes(fields: Mapping[bytes, bytes]) -> dict[str, int]:
    return {_text(name): len(value) for name, value in fields.items()}


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def entry_json(kind: str, entry_id: str, fields: Mapping[bytes, bytes]) -> str:
    """One line of --json: the entry's record, or, where that cannot be written as JSON,
    the entry as an undecodable one with the reason."""
    try:
        return orjson.dumps(describe(kind, entry_id, fields)).decode()
    except orjson.JSONEncodeError as exc:
        error = f"the decoded entry cannot be written as JSON: {exc}"
        return orjson.dumps(
            {"id": entry_id, "kind": "undecodable", "error": error, "fields": _sizes(fields)}
        ).decode()


# --- the text a person reads ------------------------------------------------------------


def format_entry(record: Mapping[str, Any]) -> str:
    head = str(record["id"])
    kind = record["kind"]
    if kind == "undecodable":
        return "\n".join(
            [f"{head}  UNDECODABLE: {_safe(record['error'])}", f"  fields: {_format_sizes(record['fields'])}"]
        )
    if kind == "group":
        return _format_group(head, record)
    if kind == "prompt":
        return "\n".join([head, *_format_prompt(record)])
    if kind == "dead_letter":
        return _format_dead(head, record)
    return f"{head}  " + "  ".join(f"{_safe(k)} {_shown_value(v)}" for k, v in record["fields"].items())


def _format_group(head: str, g: Mapping[str, Any]) -> str:
    mean = "-" if g["reward_mean"] is None else f"{g['reward_mean']:.4g}"
    lines = [
        f"{head}  task {_safe(g['task'])}  group_id {_safe(g['group_id'])}  model_step {g['model_step']}  "
        f"status {g['status']}  n {g['n']}  attempt {g['attempt']}  producer {_safe(g['producer']) or '-'}",
        f"  prompt_tokens {g['prompt_tokens']}  response_tokens {g['response_tokens']}  reward_mean {mean}",
    ]
    if g.get("summary") is not None:
        lines.append(f"  summary {_cut(_safe(g['summary']), SUMMARY_CHARS)}")
    lines += _format_prompt(g["prompt"])
    for i, s in enumerate(g["samples"]):
        # "3 x120, 4 x8": step 3 made the first 120 tokens, step 4 the 8 after them
        versions = ", ".join(f"{step} x{count}" for step, count in s["versions"]) or "-"
        lines.append(
            f"  sample {i}: {s['tokens']} tokens  versions {versions}  reward {_format_reward(s['reward'])}  "
            f"finish {_safe(s['finish'] or '-')}  status {s['status']}  "
            f"text {_snippet(s['text'], TEXT_CHARS)}"
        )
    return "\n".join(lines)


def _format_prompt(p: Mapping[str, Any]) -> list[str]:
    tokens = "" if p["prompt_tokens"] is None else f"  ({p['prompt_tokens']} prompt tokens)"
    meta = f"  meta {_cut(_json(p['meta']), VALUE_CHARS)}" if p["meta"] else ""
    uid = _safe(p["uid"])
    if isinstance(p["prompt"], str):
        return [f"  uid {uid}  prompt {_snippet(p['prompt'], PROMPT_CHARS)}{tokens}{meta}"]
    lines = [f"  uid {uid}  chat of {len(p['prompt'])} messages{tokens}{meta}"]
    for message in p["prompt"]:
        content = message["content"]
        shown = _snippet(content, PROMPT_CHARS) if isinstance(content, str) else f"[{len(content)} parts]"
        lines.append(f"    {_safe(message['role'])}: {shown}")
    return lines


def _format_dead(head: str, d: Mapping[str, Any]) -> str:
    original = "  ".join(f"{k} {_shown_value(v)}" for k, v in d["original"].items()) or "-"
    source = f"{_shown_value(d.get('source', '-'))} {_shown_value(d.get('source_id', ''))}".rstrip()
    return "\n".join(
        [
            f"{head}  DEAD LETTER  reason {_safe(str(d.get('reason', '-')))}",
            f"  attempts {_shown_value(d.get('attempts', '-'))}  source {source}",
            f"  original entry: {original}",
            f"  its other fields: {_format_sizes(d['fields']) or '-'}",
        ]
    )


def _format_reward(reward: Mapping[str, Any]) -> str:
    if not reward:
        return "-"
    return " ".join(f"{_safe(k)}={_cut(_json(v), 40)}" for k, v in reward.items())


def _format_sizes(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{_safe(name)} ({size} B)" for name, size in sizes.items())


def _shown_value(value: Any) -> str:
    if isinstance(value, dict):
        return f"<{value['bytes']} bytes>"
    return _cut(_safe(str(value)), VALUE_CHARS)


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError as exc:  # JSON nested deeper than orjson writes (it reads deeper)
        return f"<{exc}>"


def _safe(text: str) -> str:
    """Text written by anyone (a judge, a hand-made entry) as one line that cannot move
    the terminal's cursor: quoted and escaped when it holds a control character."""
    return text if text.isprintable() else orjson.dumps(text).decode()


def _snippet(text: str, limit: int) -> str:
    """The start of a text, quoted with its newlines escaped: one line per sample."""
    return orjson.dumps(text[:limit]).decode() + ("..." if len(text) > limit else "")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the command ------------------------------------------------------------------------


def show(
    settings: Settings,
    kind: str,
    *,
    task: str | None,
    count: int,
    last: bool,
    entry_id: str | None,
    as_json: bool,
) -> int:
    """Print ``count`` entries of the stream (oldest first, or newest first with ``last``),
    or the one entry ``entry_id``; exit 1 when that entry is not there."""
    task = task or settings.tasks[0].name
    key = stream_key(Keys(settings.run), kind, task)
    client = connect(settings.redis)
    entries = read_entries(client, key, count=count, last=last, entry_id=entry_id)
    if entry_id is not None and not entries:
        print(f"rollstream: {key} has no entry {entry_id}", file=sys.stderr)
        return 1
    if as_json:
        for id_, fields in entries:
            sys.stdout.write(entry_json(kind, id_, fields) + "\n")
        return 0
    if not entries:
        known = [t.name for t in settings.tasks]
        # an empty stream of a task the settings do not name is most likely a typo of --task
        hint = (
            f" (the settings' tasks: {', '.join(known)})"
            if kind not in RUN_KINDS and task not in known
            else ""
        )
        print(f"{key}: no entries{hint}")
        return 0
    length = int(client.xlen(key))
    which = "newest first" if last else "oldest first"
    print(f"{key}: {len(entries)} of {length} entries, {which}")
    for id_, fields in entries:
        print(format_entry(describe(kind, id_, fields)))
    return 0
