"""The ``summary`` field of a group entry: one line of ASCII for people using redis-cli,
bounded, escaped, left out when ``buffer.summary`` is off, and never read back."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from rollstream.shared import codec
from rollstream.shared.records import Group, Prompt, Sample, Status
from rollstream.shared.settings import load_settings
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts
from tests.unit.test_codec import through_redis_reply

LENGTHS = [3, 5, 10]
SCORES = [1.0, 0.0, 1.0]


def known_group(prompt: str | list[dict[str, str]] = "What is 2 + 3?", uid: str = "q17") -> Group:
    samples = [
        Sample([1, 2], list(range(n)), [-0.5] * n, [4] * n, finish_reason="stop", reward={"score": s})
        for n, s in zip(LENGTHS, SCORES, strict=True)
    ]
    return Group.for_prompt(Prompt(uid, "math", prompt), samples=samples)


def test_the_summary_of_a_known_group() -> None:
    fields = codec.encode_group(known_group(), summary=True)
    mean, std = statistics.mean(SCORES), statistics.pstdev(SCORES)  # 0.667 +- 0.471
    lengths = f"{min(LENGTHS)}/{round(statistics.mean(LENGTHS))}/{max(LENGTHS)}"  # 3/6/10
    assert fields["summary"] == (
        f'math step=4 n=3 reward={mean:.3g}+-{std:.3g} len={lengths} completed uid=q17 "What is 2 + 3?"'
    )
    assert next(iter(fields)) == "summary"  # first: redis-cli shows it at the top of the entry
    assert codec.group_summary(known_group()) == fields["summary"]


def test_a_group_without_samples_or_scores() -> None:
    prompt = Prompt("q1", "math", "Why?")
    empty = Group.for_prompt(prompt, samples=[], status=Status.EXPIRED)
    assert codec.group_summary(empty) == 'math step=-1 n=0 reward=- len=- expired uid=q1 "Why?"'
    unjudged = Group.for_prompt(prompt, samples=[Sample([1], [2, 3], [], [7, 7])])
    assert "step=7 n=1 reward=- len=2/2/2 completed" in codec.group_summary(unjudged)


def test_some_samples_without_a_score_are_left_out_of_the_reward() -> None:
    group = known_group()
    group.samples[1].reward = {}
    assert "reward=1+-0 " in codec.group_summary(group)  # the two scored samples: 1.0 and 1.0


def test_a_chat_prompt_shows_its_last_user_message() -> None:
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "42"},
    ]
    assert codec.group_summary(known_group(chat)).endswith('"What is 6 * 7?"')
    assert codec.group_summary(known_group(chat[:1])).endswith('"Be brief."')


def test_a_long_prompt_is_cut_to_its_first_characters() -> None:
    prompt = "x" * (codec.SUMMARY_PROMPT_CHARS - 1) + "yz"
    line = codec.group_summary(known_group(prompt))
    assert line.endswith(' "' + "x" * (codec.SUMMARY_PROMPT_CHARS - 1) + 'y..."')


@pytest.mark.parametrize(
    "text",
    [
        "What is 2 + 3?" * 100_000,  # 1.4 MB
        "\x1b[2J\x07\r\n" * 10_000,  # controls: each escaped to 4 characters
        "\U0001f600" * 10_000,  # outside the BMP: 10 characters escaped
        "你好" * 10_000,
        '"\\' * 10_000,
    ],
)
def test_the_summary_is_bounded_printable_ascii_whatever_the_texts(text: str) -> None:
    group = known_group(text, uid=text)
    group.task = text  # a decoded entry's task is any text
    line = codec.group_summary(group)
    assert len(line) <= codec.SUMMARY_MAX
    assert line.isascii() and line.isprintable(), line[:200]
    assert line.endswith('..."')  # the prompt was cut, and said so


def test_control_characters_and_quotes_are_escaped() -> None:
    line = codec.group_summary(known_group('Say "hi"\n\x1b[31mred\\ é 你\x00', uid="a b\tc"))
    assert line.isascii() and line.isprintable()
    assert line.endswith(r'"Say \"hi\"\n\x1b[31mred\\ \xe9 \u4f60\x00"')
    assert r" uid=a b\tc " in line
    # a prompt of printable ASCII needs its quotes and backslashes escaped only
    assert codec.group_summary(known_group(r'a "b" \c')).endswith(r'"a \"b\" \\c"')


def test_decoding_ignores_the_summary_and_round_trips() -> None:
    group = known_group()
    fields = through_redis_reply(codec.encode_group(group, summary=True))
    assert codec.decode_group(fields) == group
    # whatever it holds: nothing reads it
    for junk in (b"", b"\xff\xfe not UTF-8", b"x" * 100_000):
        assert codec.decode_group({**fields, b"summary": junk}) == group


def test_entries_without_it_still_decode() -> None:
    group = known_group()
    fields = through_redis_reply(codec.encode_group(group))
    assert b"summary" not in fields  # as an older writer, or one with buffer.summary off, wrote it
    assert codec.decode_group(fields) == group
    assert set(codec.encode_group(group, summary=True)) - set(codec.encode_group(group)) == {"summary"}


def test_the_setting_is_off_unless_asked_for() -> None:
    # off by default: it cost more than the 2-3% of encoding that would have made it free
    assert load_settings(run="r").buffer.summary is False
    assert load_settings(run="r", buffer={"summary": True}).buffer.summary is True


@pytest.mark.parametrize("on", [True, False])
def test_the_setting_decides_for_every_group_entry_the_buffer_writes(
    fake_buffer: BufferFactory, on: bool
) -> None:
    options = {"claim_idle_ms": 1000, "max_attempts": 3, "block_ms": 100, "summary": on}
    producer, trainer = fake_buffer("p1", buffer=options), fake_buffer("trainer", buffer=options)
    producer.feed(prompts("math", 2))
    done, aborted = producer.claim("math", 2)
    assert producer.complete(done, group_for(done.prompt, step=2)) is not None
    assert producer.abort(aborted, group_for(aborted.prompt, n=1).samples) is not None
    (item,) = trainer.read_batch("math", 1).items
    assert trainer.expire(item) is not None
    for stream, status in (
        (producer.keys.aborted("math"), "aborted"),
        (producer.keys.expired("math"), "expired"),
    ):
        client: Any = producer.client  # replies are bytes; redis-py types them loosely
        ((_, fields),) = client.xrange(stream)
        assert (b"summary" in fields) is on, stream
        if on:
            assert f" {status} uid=".encode() in fields[b"summary"]
    assert (b"summary" in item.entry.fields) is on
    if on:
        assert item.entry.fields[b"summary"].startswith(b"math step=2 n=4 ")


def test_the_stream_format_documents_the_field_and_its_bound() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "stream-format.md").read_text(encoding="utf-8")
    (row,) = [line for line in doc.splitlines() if line.startswith("| `summary` |")]
    assert f"at most {codec.SUMMARY_MAX} characters" in row
    assert "must not parse it" in row
