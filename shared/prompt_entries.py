"""Prompt entries (``uid task data``, the Prompt as orjson in ``data``) and the prompt
record that a group entry's ``meta`` carries too: written as they are, read back checked,
so that a bad one is a DecodeError naming what is wrong rather than a TypeError in a
producer at every attempt at it."""

from __future__ import annotations

from typing import Any

import orjson

from rollstream.shared.errors import DecodeError
from rollstream.shared.records import ID_MAX, ID_MIN, Prompt
from rollstream.shared.wire import FORMAT_VERSION, Fields, RawFields, check_format, reason, shown


def prompt_to_dict(prompt: Prompt) -> dict[str, Any]:
    out: dict[str, Any] = {"uid": prompt.uid, "task": prompt.task, "prompt": prompt.prompt}
    if prompt.prompt_ids is not None:
        out["prompt_ids"] = prompt.prompt_ids
    if prompt.meta:
        out["meta"] = prompt.meta
    return out


def prompt_from_dict(data: object) -> Prompt:
    """A Prompt from its JSON form, checked: DecodeError names what is wrong, here, rather
    than a TypeError in a producer at every attempt at the prompt."""
    if type(data) is not dict:
        raise DecodeError(f"the prompt record is {shown(data)}, not an object")
    try:
        uid, task, text = data["uid"], data["task"], data["prompt"]
    except KeyError as exc:
        raise DecodeError(f"missing field {exc.args[0]!r}") from None
    if type(uid) is not str:
        raise DecodeError(f"uid is {shown(uid)}, not text")
    if type(task) is not str:
        raise DecodeError(f"task is {shown(task)}, not text")
    if type(text) is list:
        _check_chat(text)
    elif type(text) is not str:
        raise DecodeError(f"prompt is {shown(text)}, not text or chat messages")
    prompt_ids = data.get("prompt_ids")
    if prompt_ids is not None:
        _check_token_ids(prompt_ids, "prompt_ids")
    meta = data.get("meta")
    if meta is None:
        meta = {}
    elif type(meta) is not dict:
        raise DecodeError(f"meta is {shown(meta)}, not an object")
    return Prompt(uid, task, text, prompt_ids, meta)


def _check_chat(messages: list[Any]) -> None:
    if not messages:
        raise DecodeError("prompt is an empty list of chat messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DecodeError(f"chat message {i} is {shown(message)}, not an object")
        if not isinstance(message.get("role"), str):
            raise DecodeError(f"chat message {i} has role {shown(message.get('role'))}, not text")
        if "content" not in message:
            raise DecodeError(f"chat message {i} has no content")
        # a list: the content parts of a multimodal message, as chat templates take them
        if not isinstance(message["content"], str | list):
            raise DecodeError(f"chat message {i} has content {shown(message['content'])}, not text")


def _check_token_ids(ids: object, name: str) -> None:
    # set(map(type)) and min / max run in C: no Python loop per token
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
        raise DecodeError(f"{name} is {shown(ids)}, not a list of token ids")
    if ids and (min(ids) < ID_MIN or max(ids) > ID_MAX):
        raise DecodeError(f"{name} holds a token id outside the int32 range")


def encode_prompt(prompt: Prompt) -> Fields:
    return {
        "uid": prompt.uid,
        "task": prompt.task,
        "data": orjson.dumps(prompt_to_dict(prompt)),
        "format": FORMAT_VERSION,
    }


def decode_prompt(fields: RawFields) -> Prompt:
    check_format(fields.get(b"format"), "a prompt entry")
    try:
        return prompt_from_dict(orjson.loads(fields[b"data"]))
    except DecodeError as exc:
        raise DecodeError(f"undecodable prompt entry: {exc}", fields) from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise DecodeError(f"undecodable prompt entry: {reason(exc)}", fields) from None
