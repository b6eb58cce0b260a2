"""The ``summary`` field of a group entry (the setting ``buffer.summary``): one line of
ASCII text for a person reading the stream with redis-cli. It is never read back: decoding
ignores it, and its form may change."""

from __future__ import annotations

import math
import operator

from rollstream.shared.records import Group, Sample, Status

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
    scores = sample_scores(group.samples)
    mean = sum(scores) / len(scores) if scores else None
    lengths = [len(s.response_ids) for s in group.samples]
    return summary_line(group, group.status or Status.COMPLETED, lengths, scores, mean)


def sample_scores(samples: list[Sample]) -> list[float]:
    return [x for s in samples if (x := s.score) is not None]


def summary_line(
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
