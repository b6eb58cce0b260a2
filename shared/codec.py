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

This module is the codec's one door: every name is imported from here. The parts live
beside it, one concept each: shared/wire.py (the format version, the field types),
shared/prompt_entries.py, shared/group_encoding.py, shared/group_decoding.py (the
structure of a group entry, checked) and shared/summary.py. ``decode_group`` is here:
what a reader checks across the whole entry (its format, its stream's task, its plain
fields against the packed ones).
"""

from __future__ import annotations

import logging
import math

from rollstream.shared.errors import DecodeError
from rollstream.shared.group_decoding import read_group
from rollstream.shared.group_encoding import (
    encode_filtered,
    encode_group,
    encode_group_parts,
    turn_to_dict,
)
from rollstream.shared.prompt_entries import decode_prompt, encode_prompt, prompt_from_dict, prompt_to_dict
from rollstream.shared.records import ID_DTYPE, Group, Status
from rollstream.shared.summary import (
    SUMMARY_MAX,
    SUMMARY_PROMPT_CHARS,
    SUMMARY_TASK_CHARS,
    SUMMARY_UID_CHARS,
    group_summary,
)
from rollstream.shared.wire import (
    FORMAT_MAJOR,
    FORMAT_VERSION,
    TRAJECTORY_FORMAT_VERSION,
    Fields,
    RawFields,
    WireFields,
    check_format,
    reason,
    shown,
)

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_VERSION",
    "SUMMARY_MAX",
    "SUMMARY_PROMPT_CHARS",
    "SUMMARY_TASK_CHARS",
    "SUMMARY_UID_CHARS",
    "TRAJECTORY_FORMAT_VERSION",
    "Fields",
    "RawFields",
    "WireFields",
    "check_format",
    "decode_group",
    "decode_prompt",
    "encode_filtered",
    "encode_group",
    "encode_group_parts",
    "encode_prompt",
    "group_summary",
    "is_group_entry",
    "prompt_from_dict",
    "prompt_to_dict",
    "turn_to_dict",
]

log = logging.getLogger(__name__)


def decode_group(fields: RawFields, task: str | None = None, *, trainable: bool = False) -> Group:
    """A group entry, checked as docs/stream-format.md §5.2.2 says: DecodeError (a dead
    letter) for what a reader cannot train on safely, a warning for plain fields that
    disagree with the packed ones. ``task``: the task of the stream it was read from,
    which the entry's own must be. ``trainable``: read from the replay buffer to be
    trained on, so the group and every sample must be completed."""
    check_format(fields.get(b"format"), "a group entry")
    try:
        group = read_group(fields)
        _warn_plain(fields, group)
        if task is not None and group.task != task:
            raise DecodeError(f"task {shown(group.task)} in a stream of task {shown(task)}")
        statuses = {group.status, *(s.status for s in group.samples)} if trainable else set()
        if statuses - {Status.COMPLETED}:
            listed = ", ".join(sorted(str(status) for status in statuses))
            raise DecodeError(f"a group with status {listed} in the replay buffer, where all are completed")
        return group
    except DecodeError as exc:
        raise DecodeError(f"undecodable group entry: {exc}", fields) from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
        # MemoryError is not in the list: sizes are checked before anything is allocated, so
        # one would be this process's memory running out, not the entry's fault.
        raise DecodeError(f"undecodable group entry: {reason(exc)}", fields) from None


# Plain fields of group entries found to disagree with what the entry holds: each is
# warned about once per process (a producer that writes one wrong writes it every time).
_WARNED: set[str] = set()


def _warn_plain(fields: RawFields, group: Group) -> None:
    """The plain fields that only repeat what the packed ones hold (n, the token counts,
    reward_mean) and the group id: a reader takes the packed fields and the prompt record
    as the truth, and says when the copies disagree (§5.2.2)."""
    scores = [s.score for s in group.samples if s.score is not None]
    # the token counts of the packed fields: read_group has read them as int32 arrays, so
    # their sizes are whole numbers of ids
    expected = {
        "n": str(len(group.samples)),
        "prompt_tokens": str(len(fields[b"prompt_ids"]) // ID_DTYPE.itemsize),
        "response_tokens": str(len(fields[b"response_ids"]) // ID_DTYPE.itemsize),
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


def is_group_entry(fields: RawFields) -> bool:
    return b"group_id" in fields
