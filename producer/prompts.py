"""Prompt files: JSONL, one prompt per line.

A line is an object with ``prompt`` (a string) or ``messages`` (a chat list
of ``{"role": ..., "content": ...}``), and optionally ``uid`` and ``meta``
(what the judge needs, e.g. ``{"answer": "42"}``). Other keys are folded into
``meta`` so that common dataset rows (``{"prompt": ..., "answer": ...}``)
feed as they are. A line without ``uid`` gets one from a hash of its content,
so feeding the same file twice stores each prompt once.

A bad line raises PromptFileError naming the file, the line and the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from rollstream.shared.errors import InputError, PromptFileError
from rollstream.shared.records import Prompt

KNOWN = ("uid", "prompt", "messages", "meta", "prompt_ids")
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32


def _messages(value: Any) -> str | None:
    """What is wrong with a chat list, or None."""
    if not isinstance(value, list) or not value:
        return "field 'messages' must be a non-empty list of {role, content} objects"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"field 'messages[{i}]' must be an object, got {type(message).__name__}"
        role = message.get("role")
        if not isinstance(role, str):
            return f"field 'messages[{i}].role' must be a string"
        if role not in ROLES:
            return f"field 'messages[{i}].role' is {role!r}; allowed: {', '.join(ROLES)}"
        content = message.get("content")
        if not isinstance(content, str | list):
            return f"field 'messages[{i}].content' must be a string or a list of parts"
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    return f"field 'messages[{i}].content[{j}]' must be an object with a 'type'"
    return None


def parse_prompt(raw: bytes, *, path: str, line: int, task: str) -> Prompt:
    def bad(what: str) -> PromptFileError:
        return PromptFileError(path, line, what)

    try:
        row = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad(f"not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise bad(f"expected a JSON object, got {type(row).__name__}")
    has_prompt, has_messages = "prompt" in row, "messages" in row
    if has_prompt == has_messages:
        raise bad("needs exactly one of the fields 'prompt' (text) and 'messages' (chat list)")
    if has_prompt:
        text = row["prompt"]
        if not isinstance(text, str) or not text:
            raise bad(f"field 'prompt' must be a non-empty string, got {type(text).__name__}")
    else:
        problem = _messages(row["messages"])
        if problem:
            raise bad(problem)
        text = row["messages"]
    meta = row.get("meta", {})
    if not isinstance(meta, dict):
        raise bad(f"field 'meta' must be an object, got {type(meta).__name__}")
    extra = {k: v for k, v in row.items() if k not in KNOWN}
    clash = sorted(k for k in extra if k in meta and meta[k] != extra[k])
    if clash:
        raise bad(f"field {clash[0]!r} is given at the top level and in 'meta' with different values")
    meta = {**extra, **meta}
    prompt_ids = row.get("prompt_ids")
    if prompt_ids is not None and not (
        isinstance(prompt_ids, list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids)
    ):
        raise bad("field 'prompt_ids' must be a list of integers")
    if prompt_ids and not 0 <= min(prompt_ids) <= max(prompt_ids) <= MAX_TOKEN_ID:
        raise bad(f"field 'prompt_ids' must hold token ids from 0 to {MAX_TOKEN_ID}")
    uid = row.get("uid")
    if uid is None:
        digest = hashlib.sha1(orjson.dumps([text, meta], option=orjson.OPT_SORT_KEYS)).hexdigest()
        uid = digest[:20]
    elif isinstance(uid, bool) or not isinstance(uid, str | int) or uid == "":
        raise bad(f"field 'uid' must be a non-empty string or an integer, got {uid!r}")
    return Prompt(uid=str(uid), task=task, prompt=text, prompt_ids=prompt_ids, meta=meta)


def iter_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, content) of every non-blank line."""
    offset = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                yield number, offset, raw
            offset += len(raw)


def check_readable(path: Path) -> None:
    """A regular file, or InputError saying what it is instead."""
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a prompt file")
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        raise InputError(f"{path}: not a regular file (a pipe or device cannot be read twice); save it first")


class UidCheck:
    """Two lines of one file with the same uid are an error naming both lines, or, with
    ``first_wins``, the later ones are skipped."""

    def __init__(self, path: str, first_wins: bool = False) -> None:
        self.path = path
        self.first_wins = first_wins
        self.seen: dict[str, int] = {}

    def keep(self, prompt: Prompt, line: int) -> bool:
        first = self.seen.setdefault(prompt.uid, line)
        if first == line:
            return True
        if self.first_wins:
            return False
        raise PromptFileError(self.path, line, f"uid {prompt.uid!r} again: line {first} has it already")


def read_prompt_file(path: str | Path, task: str, *, first_uid_wins: bool = False) -> list[Prompt]:
    """Every prompt of the file, or PromptFileError at the first bad line (a uid twice
    included, unless ``first_uid_wins``); an empty file is an InputError."""
    path = Path(path)
    check_readable(path)
    uids = UidCheck(str(path), first_uid_wins)
    prompts = []
    for n, _, raw in iter_lines(path):
        prompt = parse_prompt(raw, path=str(path), line=n, task=task)
        if uids.keep(prompt, n):
            prompts.append(prompt)
    if not prompts:
        raise InputError(f"{path}: no prompts in the file")
    return prompts
