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

With ``summary=True`` (the setting ``buffer.summary``) a group entry also carries
``summary``, one line of ASCII text for a person reading the stream with redis-cli
(``group_summary``): the figures the other fields give only packed or in JSON (reward
spread, response lengths, the prompt's start). It is never read back: decoding ignores
it, and its form may change. Off by default: bench/summary.py measured it at 7-12% of
encoding a group and 1.6-3.5% of the hot path.

An agent trajectory (producer/agents) is a sample whose response holds every turn
after the prompt, the model's and the environment's. Its sample object in ``meta``
adds ``mask`` (the loss mask as [value, count] runs, like the versions), ``turns``
(role, length, text, reward, status of each turn) and ``agent`` (how it ended), and
its entry is format 1.1. Plain responses have none of the three and their entries
stay 1.0, byte for byte: the keys cost nothing where nobody uses them.

A fresh prompt entry is ``uid task data`` with the Prompt as orjson in ``data``.

Token arrays round-trip bit for bit (NaN logprobs included). The JSON parts
(meta, rewards, texts) follow JSON: a non-finite float there becomes null.

Decoding is the one place where an entry read from Redis is checked: a bad one
raises DecodeError with the reason, never another exception, so that the
buffer dead-letters it at its first delivery instead of a producer or trainer
failing on it at every attempt. Every length, count and version run is
checked against the entry's own byte sizes before anything is allocated, and
every value against the type and range its user needs (versions and steps
fit the int32 version dtype, a reward score is a number, a chat message has
content). The checks are comparisons per sample and per run, never per token.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import orjson

from rollstream.shared.errors import DecodeError, FormatError
from rollstream.shared.records import (
    ID_DTYPE,
    ID_MAX,
    ID_MIN,
    LOGPROB_DTYPE,
    MASK_DTYPE,
    MAX_STEP,
    FloatArray,
    Group,
    IdArray,
    MaskArray,
    Prompt,
    Sample,
    Status,
    Turn,
)

T = TypeVar("T")

Fields = dict[str, bytes | str | int | float]
WireFields = dict[str, bytes | str | int | float | tuple[np.ndarray, ...]]
RawFields = Mapping[bytes, bytes]

# docs/stream-format.md: every entry carries "format" = "MAJOR.MINOR". A reader reads
# every minor version of its major (new fields are only ever added), and refuses any
# other major; an entry without the field is from before the field existed: 1.0.
log = logging.getLogger(__name__)
FORMAT_VERSION = "1.0"
FORMAT_MAJOR = FORMAT_VERSION.split(".")[0]
# A group entry with an agent trajectory's fields (a sample's mask, turns, agent status)
# is 1.1; every other entry stays 1.0, byte for byte what it was before 1.1 existed.
TRAJECTORY_FORMAT_VERSION = "1.1"

_EMPTY_IDS = np.zeros(0, dtype=ID_DTYPE)
_STATUS = {status.value: status for status in Status}
_INT64_MAX = 2**63 - 1


# --- prompts ---------------------------------------------------------------------------


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
        raise DecodeError(f"the prompt record is {_shown(data)}, not an object")
    try:
        uid, task, text = data["uid"], data["task"], data["prompt"]
    except KeyError as exc:
        raise DecodeError(f"missing field {exc.args[0]!r}") from None
    if type(uid) is not str:
        raise DecodeError(f"uid is {_shown(uid)}, not text")
    if type(task) is not str:
        raise DecodeError(f"task is {_shown(task)}, not text")
    if type(text) is list:
        _check_chat(text)
    elif type(text) is not str:
        raise DecodeError(f"prompt is {_shown(text)}, not text or chat messages")
    prompt_ids = data.get("prompt_ids")
    if prompt_ids is not None:
        _check_token_ids(prompt_ids, "prompt_ids")
    meta = data.get("meta")
    if meta is None:
        meta = {}
    elif type(meta) is not dict:
        raise DecodeError(f"meta is {_shown(meta)}, not an object")
    return Prompt(uid, task, text, prompt_ids, meta)


def _check_chat(messages: list[Any]) -> None:
    if not messages:
        raise DecodeError("prompt is an empty list of chat messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DecodeError(f"chat message {i} is {_shown(message)}, not an object")
        if not isinstance(message.get("role"), str):
            raise DecodeError(f"chat message {i} has role {_shown(message.get('role'))}, not text")
        if "content" not in message:
            raise DecodeError(f"chat message {i} has no content")
        # a list: the content parts of a multimodal message, as chat templates take them
        if not isinstance(message["content"], str | list):
            raise DecodeError(f"chat message {i} has content {_shown(message['content'])}, not text")


def _check_token_ids(ids: object, name: str) -> None:
    # set(map(type)) and min / max run in C: no Python loop per token
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
        raise DecodeError(f"{name} is {_shown(ids)}, not a list of token ids")
    if ids and (min(ids) < ID_MIN or max(ids) > ID_MAX):
        raise DecodeError(f"{name} holds a token id outside the int32 range")


def encode_prompt(prompt: Prompt) -> Fields:
    return {
        "uid": prompt.uid,
        "task": prompt.task,
        "data": orjson.dumps(prompt_to_dict(prompt)),
        "format": FORMAT_VERSION,
    }


def encode_filtered(group: Group, source: str, source_id: str) -> Fields:
    """The record of a group the producer's filter dropped, for ``rs:{run}:filtered``: no
    samples, only what names the prompt and why it was dropped, so that every prompt's
    outcome can be found by its uid (a trained one by the trainer's record, a dead one in
    the dead letters, an expired one in its pool)."""
    reward_mean = group.reward_mean
    return {
        "format": FORMAT_VERSION,
        "task": group.task,
        "uid": group.prompt.uid,
        "group_id": group.group_id,
        "producer": group.producer,
        "attempt": group.attempt,
        "n": len(group.samples),
        "reward_mean": "" if reward_mean is None else repr(reward_mean),
        "source": source,
        "source_id": source_id,
    }


def check_format(version: bytes | str | None, what: str) -> None:
    """FormatError unless ``version`` (an entry's or the run's "format") is of our major."""
    if version is None:
        return
    text = version.decode("utf-8", "replace") if isinstance(version, bytes) else version
    if text.split(".")[0] != FORMAT_MAJOR:
        raise FormatError(
            f"{what} is in stream format {text!r}; this rollstream reads format {FORMAT_MAJOR}.x "
            "(upgrade rollstream, or use the version that wrote the run)"
        )


def decode_prompt(fields: RawFields) -> Prompt:
    check_format(fields.get(b"format"), "a prompt entry")
    try:
        return prompt_from_dict(orjson.loads(fields[b"data"]))
    except DecodeError as exc:
        raise DecodeError(f"undecodable prompt entry: {exc}", fields) from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
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


def encode_group(group: Group, *, summary: bool = False) -> Fields:
    """A group's stream-entry fields, every value as Redis stores it."""
    return {
        name: b"".join(array.data for array in value) if isinstance(value, tuple) else value
        for name, value in encode_group_parts(group, summary=summary).items()
    }


def encode_group_parts(group: Group, *, summary: bool = False) -> WireFields:
    """``encode_group`` with each token field left as the tuple of its samples' arrays,
    for a writer that copies them into its buffer once (shared/resp.py)."""
    samples = group.samples
    first = samples[0].prompt_ids if samples else _EMPTY_IDS
    shared_prompt = all(s.prompt_ids is first or np.array_equal(s.prompt_ids, first) for s in samples[1:])
    sample_meta = []
    trajectories = False
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
        if s.loss_mask is not None or s.turns is not None or s.agent_status is not None:
            _trajectory_meta(s, item)
            trajectories = True
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
    # Group.reward_mean and .response_tokens, from what the summary uses too
    scores = _scores(samples)
    reward_mean = sum(scores) / len(scores) if scores else None
    lengths = [item["len"] for item in sample_meta]
    status = group.status or Status.COMPLETED
    prompt_parts = (first,) if shared_prompt else tuple(s.prompt_ids for s in samples)
    fields: WireFields = {
        "summary": "",  # first, where redis-cli shows it at the top of the entry
        "format": TRAJECTORY_FORMAT_VERSION if trajectories else FORMAT_VERSION,
        "task": group.task,
        "group_id": group.group_id,
        "model_step": group.model_step,
        "status": status.value,
        "n": len(samples),
        "attempt": group.attempt,
        "producer": group.producer,
        "reward_mean": "" if reward_mean is None else repr(reward_mean),
        "prompt_tokens": sum(len(p) for p in prompt_parts),
        "response_tokens": sum(lengths),
        "meta": orjson.dumps(meta),
        # Samples hold little-endian int32 / float32 arrays (records.as_ids): bytes as they are.
        "prompt_ids": prompt_parts,
        "response_ids": tuple(s.response_ids for s in samples),
        "logprobs": tuple(s.logprobs for s in samples),
    }
    if summary:
        fields["summary"] = _summary(group, status, lengths, scores, reward_mean)
    else:
        del fields["summary"]
    return fields


def _trajectory_meta(sample: Sample, item: dict[str, Any]) -> None:
    """An agent trajectory's keys of its sample object (format 1.1): the loss mask as
    [value, count] runs like the versions, the turns, the agent's status."""
    if sample.loss_mask is not None:
        item["mask"] = _value_runs(sample.loss_mask)
    if sample.turns is not None:
        item["turns"] = [_turn_to_dict(t) for t in sample.turns]
    if sample.agent_status is not None:
        item["agent"] = sample.agent_status


def _value_runs(values: npt.NDArray[Any]) -> list[list[int]]:
    if not len(values):
        return []
    starts = [0, *(np.flatnonzero(values[1:] != values[:-1]) + 1).tolist(), len(values)]
    return [[int(values[a]), b - a] for a, b in itertools.pairwise(starts)]


def _turn_to_dict(turn: Turn) -> dict[str, Any]:
    out: dict[str, Any] = {"role": turn.role, "len": turn.length}
    if turn.text:
        out["text"] = turn.text
    if turn.reward is not None:
        out["reward"] = turn.reward
    if turn.status is not None:
        out["status"] = turn.status
    if turn.name is not None:
        out["name"] = turn.name
    return out


# The summary (group_summary): each text in it escaped and cut, the line at most
# SUMMARY_MAX characters whatever the group holds.
SUMMARY_TASK_CHARS = 64  # the longest task name (settings.NAME_PATTERN)
SUMMARY_UID_CHARS = 40
SUMMARY_PROMPT_CHARS = 60  # enough to recognise a question
SUMMARY_MAX = 512
# C0 controls, DEL, the backslash and the quote escaped; str.encode("ascii",
# "backslashreplace") then writes anything else not ASCII as \xNN, \uNNNN or \UNNNNNNNN.
_ESCAPES = str.maketrans(
    {i: f"\\x{i:02x}" for i in [*range(32), 127]} | {9: "\\t", 10: "\\n", 13: "\\r", 34: '\\"', 92: "\\\\"}
)


def group_summary(group: Group) -> str:
    """One line of plain ASCII about the group, the entry's ``summary`` field, for a
    person reading the stream with redis-cli:

        math step=3 n=8 reward=0.625+-0.484 len=812/1024/2048 completed uid=q17 "What is 2 + 3?"

    task, model step, samples, the reward scores' mean +- standard deviation (``-`` when
    no sample has a score), response lengths min/mean/max (``-`` without samples),
    status, prompt uid, and the prompt's first SUMMARY_PROMPT_CHARS characters (of a
    chat, its last user message: the question, where the first is often a system prompt
    that every prompt shares), ``...`` after a cut. Text anyone wrote is escaped
    (controls, quotes, anything not ASCII), so that the line cannot move a terminal's
    cursor, and cut, so that it is at most SUMMARY_MAX characters.

    Nothing reads it back, so its form may change. Its cost is work per sample, never
    per token: bench/summary.py.
    """
    scores = _scores(group.samples)
    mean = sum(scores) / len(scores) if scores else None
    lengths = [len(s.response_ids) for s in group.samples]
    return _summary(group, group.status or Status.COMPLETED, lengths, scores, mean)


def _scores(samples: list[Sample]) -> list[float]:
    return [x for s in samples if (x := s.score) is not None]


def _summary(
    group: Group, status: Status, lengths: list[int], scores: list[float], mean: float | None
) -> str:
    """group_summary from what the encoder has computed already."""
    if mean is None:
        reward = "-"
    else:
        deviations = [x - mean for x in scores]
        reward = f"{mean:.3g}+-{math.sqrt(sum(map(operator.mul, deviations, deviations)) / len(scores)):.3g}"
    span = f"{min(lengths)}/{sum(lengths) / len(lengths):.0f}/{max(lengths)}" if lengths else "-"
    prompt = group.prompt
    line = (
        f"{_ascii(group.task, SUMMARY_TASK_CHARS)} step={group.model_step} n={len(lengths)} "
        f"reward={reward} len={span} {status.value} uid={_ascii(prompt.uid, SUMMARY_UID_CHARS)} "
        f'"{_ascii(_prompt_text(prompt.prompt), SUMMARY_PROMPT_CHARS)}"'
    )
    # only an absurd number (a model_step of a thousand digits) gets here: the texts are cut
    return line if len(line) <= SUMMARY_MAX else line[: SUMMARY_MAX - 3] + "..."


def _prompt_text(prompt: object) -> str:
    """A text prompt, or a chat's last user message (else its last message of text)."""
    if isinstance(prompt, str):
        return prompt
    last: str | None = None
    for message in reversed(prompt) if isinstance(prompt, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            if message.get("role") == "user":
                return content
            last = content if last is None else last
    return last or ""


def _ascii(text: str, chars: int) -> str:
    """The first ``chars`` characters of ``text`` as printable ASCII, escaped, in at most
    2 * ``chars`` characters (fewer of them when escapes are long: a prompt in another
    script is \\uNNNN escapes), and ``...`` when that left some out."""
    head = text[:chars]
    if head.isascii() and head.isprintable():  # nearly always: nothing to escape but quotes
        if '"' in head or "\\" in head:
            head = head.replace("\\", "\\\\").replace('"', '\\"')
        return head + "..." if len(text) > chars else head
    limit = 2 * chars
    shown = head.translate(_ESCAPES).encode("ascii", "backslashreplace").decode("ascii")
    while len(shown) > limit:  # drop characters, never half an escape
        head = head[: len(head) * limit // len(shown)]
        shown = head.translate(_ESCAPES).encode("ascii", "backslashreplace").decode("ascii")
    return shown + "..." if len(head) < len(text) else shown


def decode_group(fields: RawFields, task: str | None = None, *, trainable: bool = False) -> Group:
    """A group entry, checked as docs/stream-format.md §5.2.2 says: DecodeError (a dead
    letter) for what a reader cannot train on safely, a warning for plain fields that
    disagree with the packed ones. ``task``: the task of the stream it was read from,
    which the entry's own must be. ``trainable``: read from the replay buffer to be
    trained on, so the group and every sample must be completed."""
    check_format(fields.get(b"format"), "a group entry")
    try:
        group = _decode_group(fields)
        if task is not None and group.task != task:
            raise DecodeError(f"task {_shown(group.task)} in a stream of task {_shown(task)}")
        statuses = {group.status, *(s.status for s in group.samples)} if trainable else set()
        if statuses - {Status.COMPLETED}:
            shown = ", ".join(sorted(str(status) for status in statuses))
            raise DecodeError(f"a group with status {shown} in the replay buffer, where all are completed")
        return group
    except DecodeError as exc:
        raise DecodeError(f"undecodable group entry: {exc}", fields) from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
        # MemoryError is not in the list: sizes are checked before anything is allocated, so
        # one would be this process's memory running out, not the entry's fault.
        raise DecodeError(f"undecodable group entry: {_reason(exc)}", fields) from None


def _decode_group(fields: RawFields) -> Group:
    meta = _field(fields, b"meta", orjson.loads)
    if type(meta) is not dict:
        raise DecodeError(f"meta is {_shown(meta)}, not a JSON object")
    prompt_ids = _field(fields, b"prompt_ids", _ids)
    response_ids = _field(fields, b"response_ids", _ids)
    logprobs = _field(fields, b"logprobs", _logprobs)
    shared_prompt, items = meta["shared_prompt"], meta["samples"]
    if type(shared_prompt) is not bool:
        raise DecodeError(f"shared_prompt is {_shown(shared_prompt)}, not true or false")
    if type(items) is not list:
        raise DecodeError(f"samples is {_shown(items)}, not a list")
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
        raise DecodeError(f"created_at is {_shown(created_at)}, not a time")
    if type(timings) is not dict or not set(map(type, timings.values())) <= {int, float}:
        raise DecodeError(f"timings is {_shown(timings)}, not an object of seconds")
    prompt = prompt_from_dict(meta["prompt"])
    in_samples = meta.get("prompt_ids_in_samples", False)
    if type(in_samples) is not bool:
        raise DecodeError(f"prompt_ids_in_samples is {_shown(in_samples)}, not true or false")
    if in_samples:  # int32 from bytes: nothing to check
        prompt.prompt_ids = prompt_ids.tolist()
    model_step = _field(fields, b"model_step", _model_step)
    # staleness is t - model_step - 1: a model_step above its tokens' versions would pass a
    # stale group off as fresh. Without a token (an expired-pool entry, every response
    # empty) it is whatever its writer gave.
    oldest = min((value for runs in runs_of for value, _ in runs), default=None)
    if oldest is not None and model_step != oldest:
        raise DecodeError(f"model_step {model_step} is not its oldest token version, {oldest}")
    group = Group(
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
    _warn_plain(fields, group, len(prompt_ids), len(response_ids))
    return group


# Plain fields of group entries found to disagree with what the entry holds: each is
# warned about once per process (a producer that writes one wrong writes it every time).
_WARNED: set[str] = set()


def _warn_plain(fields: RawFields, group: Group, prompt_tokens: int, response_tokens: int) -> None:
    """The plain fields that only repeat what the packed ones hold (n, the token counts,
    reward_mean) and the group id: a reader takes the packed fields and the prompt record
    as the truth, and says when the copies disagree (§5.2.2)."""
    scores = [s.score for s in group.samples if s.score is not None]
    expected = {
        "n": str(len(group.samples)),
        "prompt_tokens": str(prompt_tokens),
        "response_tokens": str(response_tokens),
        "group_id": f"{group.task}:{group.prompt.uid}",
    }
    wrong = [name for name, value in expected.items() if fields.get(name.encode()) != value.encode()]
    raw_mean = fields.get(b"reward_mean", b"")
    if scores:
        try:
            mean_ok = math.isclose(float(raw_mean), sum(scores) / len(scores), abs_tol=1e-12)
        except ValueError:
            mean_ok = False
    else:
        mean_ok = raw_mean == b""
    if not mean_ok:
        wrong.append("reward_mean")
    new = [name for name in wrong if name not in _WARNED]
    if new:
        _WARNED.update(new)
        log.warning(
            "group entry %s of task %s: %s disagree%s with what the entry holds; read from the "
            "packed fields and the prompt record (said once per field per process)",
            group.group_id, group.task, ", ".join(new), "s" if len(new) == 1 else "",
        )  # fmt: skip


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
            raise DecodeError(f"sample {i} is {_shown(item)}, not an object")
        n, nlp = item["len"], item["lp"]
        if type(n) is not int or n < 0:
            raise DecodeError(f"sample {i} has len {_shown(n)}, not a token count")
        if type(nlp) is not int or nlp < 0:
            raise DecodeError(f"sample {i} has lp {_shown(nlp)}, not a token count")
        if nlp and nlp != n:
            raise DecodeError(f"sample {i} has {nlp} logprobs for {n} tokens")
        if shared_prompt:
            sample_prompt = prompt_ids
        else:
            plen = item["plen"]
            if type(plen) is not int or plen < 0:
                raise DecodeError(f"sample {i} has plen {_shown(plen)}, not a token count")
            sample_prompt = prompt_ids[p : p + plen]
            p += plen
        runs = item["ver"]
        if type(runs) is not list:
            raise DecodeError(f"sample {i} has version runs {_shown(runs)}, not [step, count] pairs")
        counted = 0
        try:
            for value, count in runs:  # one or two runs, rarely more: never one per token
                if type(count) is not int or count < 1:
                    raise DecodeError(f"sample {i} has version runs {_shown(runs)}: a count below 1")
                if type(value) is not int or not 0 <= value <= MAX_STEP:
                    raise DecodeError(f"sample {i} has version {_shown(value)}, not a step in 0..{MAX_STEP}")
                counted += count
        except (TypeError, ValueError):  # not pairs: a run of another length, or no list at all
            raise DecodeError(
                f"sample {i} has version runs {_shown(runs)}, not [step, count] pairs"
            ) from None
        if counted != n:
            raise DecodeError(f"sample {i} has version runs for {counted} tokens, not its {n}")
        if len(runs) == 1 and longest.get(value, 0) < n:
            longest[value] = n
        reward = item["reward"]
        if reward is None:
            reward = {}
        elif type(reward) is not dict:
            raise DecodeError(f"sample {i} has reward {_shown(reward)}, not an object")
        else:
            # the trainer takes float(score): only the score must be a number, other entries
            # are the judge's own (and may be text)
            score = reward.get("score")
            if score is not None and type(score) is not float and type(score) is not int:
                raise DecodeError(f"sample {i} has reward score {_shown(score)}, not a number")
        finish, status, text = item["finish"], item["status"], item["text"]
        if finish is not None and type(finish) is not str:
            raise DecodeError(f"sample {i} has finish {_shown(finish)}, not text")
        if type(status) is not str or status not in _STATUS:
            raise DecodeError(f"sample {i} has status {_shown(status)}, not one of {', '.join(_STATUS)}")
        if type(text) is not str:
            raise DecodeError(f"sample {i} has text {_shown(text)}, not text")
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
            raise DecodeError(f"sample {i} has mask runs {_shown(runs)}, not [value, count] pairs")
        counted = 0
        for run in runs:
            if type(run) is not list or len(run) != 2:
                raise DecodeError(f"sample {i} has mask runs {_shown(runs)}, not [value, count] pairs")
            value, count = run
            if type(value) is not int or value not in (0, 1):
                raise DecodeError(f"sample {i} has mask value {_shown(value)}, not 0 or 1")
            if type(count) is not int or count < 1:
                raise DecodeError(f"sample {i} has mask runs {_shown(runs)}: a count below 1")
            counted += count
        if counted != n:
            raise DecodeError(f"sample {i} has mask runs for {counted} tokens, not its {n}")
    turns = item.get("turns")
    if turns is not None:
        if type(turns) is not list:
            raise DecodeError(f"sample {i} has turns {_shown(turns)}, not a list")
        sample.turns = [_turn(i, j, t) for j, t in enumerate(turns)]
        covered = sum(t.length for t in sample.turns)
        if covered != n:
            raise DecodeError(f"sample {i} has turns of {covered} tokens, not its {n}")
    agent = item.get("agent")
    if agent is not None and type(agent) is not str:
        raise DecodeError(f"sample {i} has agent status {_shown(agent)}, not text")
    sample.agent_status = agent
    return runs


def _turn(i: int, j: int, data: object) -> Turn:
    if type(data) is not dict:
        raise DecodeError(f"sample {i} turn {j} is {_shown(data)}, not an object")
    role, length = data.get("role"), data.get("len")
    if type(role) is not str:
        raise DecodeError(f"sample {i} turn {j} has role {_shown(role)}, not text")
    if type(length) is not int or length < 0:
        raise DecodeError(f"sample {i} turn {j} has len {_shown(length)}, not a token count")
    text, reward = data.get("text", ""), data.get("reward")
    status, name = data.get("status"), data.get("name")
    if type(text) is not str:
        raise DecodeError(f"sample {i} turn {j} has text {_shown(text)}, not text")
    if reward is not None and type(reward) is not float and type(reward) is not int:
        raise DecodeError(f"sample {i} turn {j} has reward {_shown(reward)}, not a number")
    for key, value in (("status", status), ("name", name)):
        if value is not None and type(value) is not str:
            raise DecodeError(f"sample {i} turn {j} has {key} {_shown(value)}, not text")
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
        raise DecodeError(f"{name.decode()}: {_reason(exc)}") from None


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


def is_group_entry(fields: RawFields) -> bool:
    return b"group_id" in fields


def _shown(value: object, limit: int = 40) -> str:
    """A value in a reason, cut short: the entry's fields go to the dead letter in full."""
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        name = exc.args[0]
        return f"missing field {name.decode() if isinstance(name, bytes) else name!r}"
    return f"{type(exc).__name__}: {exc}"
