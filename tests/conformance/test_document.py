"""docs/stream-format.md is normative: its statements and examples are checked here
against what the bundled reader and writers do on a real Redis. Where the two differ, one
of them is a bug (and this test says which statement)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis

from rollstream.shared import codec
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import FormatError
from rollstream.shared.events import STOP, WEIGHT_SYNC, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.records import Group, Prompt, Sample
from tests.conformance import test_foreign_trainer as foreign
from tests.helpers import group_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "stream-format.md"
TASK = "math"


def document() -> str:
    return DOC.read_text(encoding="utf-8")


def section(text: str, number: str) -> str:
    """The text of section ``number`` ("11.4"), up to the next heading of any level (a
    line starting with # inside a code block is not one)."""
    out: list[str] | None = None
    fenced = False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#+ (\S+)", line)
        if heading:
            if out is not None:
                break
            if heading.group(1) == number:
                out = []
                continue
        if out is not None:
            out.append(line)
    assert out is not None, f"no section {number} in {DOC.name}"
    return "".join(out)


def blocks(text: str, lang: str = "") -> list[str]:
    """The fenced code blocks of ``text`` in language ``lang`` ("" = no language given)."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)


def paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def counted(block: str) -> set[str]:
    """The progress fields a command block increments, for task TASK."""
    return {
        field.replace("{task}", TASK)
        for field in re.findall(r"^HINCRBY rs:\{run\}:progress (\S+) \S+$", block, re.M)
    }


def undecodable(buffer: ReplayBuffer) -> None:
    """An entry in the replay buffer that nobody can decode, read (and so dead-lettered)
    by the bundled reader."""
    buffer.ensure(TASK)
    buffer.client.xadd(buffer.keys.groups(TASK), {"format": "1.0", "group_id": f"{TASK}:junk", "meta": b"{"})
    assert buffer.read_batch(TASK, 1).items == []


def progress(client: redis.Redis, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(float(v)) for k, v in client.hgetall(keys.progress).items()}


# --- dead letters and their counters (§7, §11.2, §11.4, §12) ---------------------------


def test_every_statement_of_how_a_dead_letter_is_counted_names_both_counters() -> None:
    """§7 and §12 say a group's dead letter counts in dead and groups_dead: a paragraph or
    command block that names the dead counter names groups_dead too."""
    text = document()
    alone = [p.strip()[:120] for p in paragraphs(text) if "{task}:dead" in p and "groups_dead" not in p]
    assert alone == []


@pytest.mark.integration
def test_the_dead_letter_commands_count_what_the_bundled_reader_counts(
    real_buffer: Any, redis_server: EmbeddedRedis
) -> None:
    (block,) = [b for b in blocks(section(document(), "11.4")) if "MULTI" in b]
    buffer: ReplayBuffer = real_buffer("trainer")
    before = progress(buffer.client, buffer.keys)
    undecodable(buffer)
    after = progress(buffer.client, buffer.keys)
    moved = {k for k in after if after[k] != before.get(k, 0)}
    assert moved == counted(block) == {f"{TASK}:dead", f"{TASK}:groups_dead"}


# --- §5.2.2 what a reader checks: every row, on the bundled reader and the page's -------

ROW = re.compile(r"^\| `([\w.\[\]]+)` = `([^`]*)` \| (dead letter|read, warning|read|stop) \|", re.M)
SAMPLE_KEY = re.compile(r"meta\.samples\[(\d+)\]\.(\w+)")


def changed(fields: dict[bytes, bytes], name: str, value: str) -> dict[bytes, bytes]:
    """The example entry with one row's change: a plain field, or a key of one sample in
    ``meta`` (``meta.samples[1].status``)."""
    sample = SAMPLE_KEY.fullmatch(name)
    if sample is None:
        return {**fields, name.encode(): value.encode()}
    meta = orjson.loads(fields[b"meta"])
    meta["samples"][int(sample.group(1))][sample.group(2)] = value
    return {**fields, b"meta": orjson.dumps(meta)}


def reader_rows() -> list[tuple[str, str, str]]:
    return ROW.findall(section(document(), "5.2.2"))


def example_entry() -> dict[bytes, bytes]:
    """§5.2.2's entry: math:q1, 4 samples of 8 tokens of version 2, scores 0 1 0 1."""
    group = group_for(Prompt(uid="q1", task=TASK, prompt="What is 1 + 1?"), n=4, tokens=8, step=2)
    fields = {
        k.encode(): v if isinstance(v, bytes) else str(v).encode()
        for k, v in codec.encode_group(group).items()
    }
    assert (fields[b"model_step"], fields[b"n"], fields[b"prompt_tokens"], fields[b"reward_mean"]) == (
        b"2", b"4", b"3", b"0.5",
    )  # fmt: skip
    return fields


def test_the_reader_table_has_its_rows() -> None:
    fields = {name for name, _, _ in reader_rows()}
    assert {
        "format",
        "model_step",
        "task",
        "n",
        "prompt_tokens",
        "response_tokens",
        "reward_mean",
        "group_id",
        "meta.samples[1].status",
    } <= fields


@pytest.mark.integration
@pytest.mark.parametrize(("name", "value", "outcome"), reader_rows())
def test_each_row_of_what_a_reader_checks(
    name: str,
    value: str,
    outcome: str,
    real_buffer: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fields = changed(example_entry(), name, value)
    # the bundled reader
    monkeypatch.setattr(codec, "_WARNED", set())
    buffer: ReplayBuffer = real_buffer("trainer")
    buffer.ensure(TASK)
    buffer.client.xadd(buffer.keys.groups(TASK), fields)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger=codec.__name__):
        try:
            items = buffer.read_batch(TASK, 1).items
        except FormatError:
            got = "stop"
        else:
            dead = buffer.client.xlen(buffer.keys.dead)
            got = "dead letter" if dead and not items else "read" if items and not dead else f"{items} {dead}"
    warned = [r.getMessage() for r in caplog.records if r.name == codec.__name__]
    if got == "read" and warned:
        assert name in warned[0], warned
        got = "read, warning"
    assert got == outcome
    # the trainer written from the page
    try:
        group = foreign.decode_group("1-1", fields, TASK)
    except foreign.Undecodable:
        got = "dead letter"
    except RuntimeError:
        got = "stop"
    else:
        got = (
            "read, warning"
            if group.warnings == [name]
            else "read"
            if not group.warnings
            else str(group.warnings)
        )
    assert got == outcome


# --- the page's examples (§5.2 decoding, §11.3 expiry, §11.6 and §11.8 events) --------


def decoded_by_the_page(fields: dict[bytes, bytes]) -> tuple[list[tuple[Any, ...]], tuple[int, int, int]]:
    """§5.2's "Decoding, in full", run as written, with each sample's arrays collected."""
    (snippet,) = [b for b in blocks(section(document(), "5.2"), "python") if "np.frombuffer" in b]
    collect = re.sub(
        r"^(    )(s_mask = .*)$",
        r"\1\2\n\1out.append((s_prompt, s_response, s_logprobs, s_versions, s_mask))",
        snippet,
        flags=re.M,
    )
    assert "out.append" in collect, "the snippet no longer ends its loop with s_mask"
    scope: dict[str, Any] = {"np": np, "orjson": orjson, "f": fields, "out": []}
    exec(compile(collect, "stream-format.md §5.2", "exec"), scope)
    return scope["out"], (scope["r"], scope["l"], scope["p"])


def as_entry(group: Group) -> dict[bytes, bytes]:
    encoded = codec.encode_group(group).items()
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in encoded}


def page_groups() -> list[Group]:
    prompt = Prompt(uid="q1", task=TASK, prompt="What is 1 + 1?")
    shared = group_for(prompt, n=3, tokens=5, step=4)
    own_prompts = Group.for_prompt(
        prompt,
        samples=[
            Sample(
                [1, 2], [7, 8, 9], [-0.5, -0.25, -1.0], [3, 3, 4], finish_reason="stop", reward={"score": 1}
            ),
            Sample([5, 6, 7, 8], [], [], [], finish_reason="length", reward={}),
            Sample([9], [4, 4], [], [5, 5], finish_reason="stop", reward={"score": 0.0}),
        ],
    )
    return [shared, own_prompts]


@pytest.mark.parametrize("group", page_groups(), ids=["shared-prompt", "own-prompts"])
def test_the_decoding_snippet_gives_what_the_bundled_decoder_gives(group: Group) -> None:
    fields = as_entry(group)
    samples, (r, lp, p) = decoded_by_the_page(fields)
    bundled = codec.decode_group(fields)
    assert len(samples) == len(bundled.samples) == len(group.samples)
    for (s_prompt, s_response, s_logprobs, s_versions, s_mask), s in zip(
        samples, bundled.samples, strict=True
    ):
        assert s_prompt.tolist() == s.prompt_ids.tolist()
        assert s_response.tolist() == s.response_ids.tolist()
        assert s_logprobs.tolist() == s.logprobs.tolist()
        assert s_versions.tolist() == s.response_versions.tolist()
        assert s_mask.tolist() == [1] * len(s.response_ids)
    # "then r == len(response_ids), l == len(logprobs), and p == len(prompt_ids) when not shared"
    meta = orjson.loads(fields[b"meta"])
    assert r * 4 == len(fields[b"response_ids"]) and lp * 4 == len(fields[b"logprobs"])
    assert meta["shared_prompt"] or p * 4 == len(fields[b"prompt_ids"])


TOKEN = re.compile(r'<[^>]*>|"[^"]*"|\S+')


def xadd_fields(block: str, key: str) -> list[tuple[str, str]]:
    """The (field, value) pairs of the block's XADD to ``key``, values as written
    (``<...>`` a placeholder, ``""`` empty text)."""
    (line,) = [ln for ln in block.splitlines() if ln.startswith(f"XADD {key} ")]
    words = TOKEN.findall(line.split("#")[0])
    after = words[words.index("*") + 1 :]
    return list(zip(after[::2], after[1::2], strict=True))


def literal(value: str) -> bytes | None:
    """What a value as written stores: None for a placeholder."""
    if value.startswith("<"):
        return None
    return b"" if value == '""' else value.encode()


@pytest.mark.integration
def test_the_expired_pool_entry_is_what_the_bundled_trainer_writes(real_buffer: Any) -> None:
    (block,) = [b for b in blocks(section(document(), "11.3")) if "MULTI" in b]
    page = xadd_fields(block, "rs:{run}:expired:{task}")
    producer: ReplayBuffer = real_buffer("producer-1")
    trainer: ReplayBuffer = real_buffer("trainer")
    producer.feed([Prompt(uid="q1", task=TASK, prompt="What is 1 + 1?")])
    (claim,) = producer.claim(TASK, 1)
    assert producer.complete(claim, group_for(claim.prompt, step=0)) is not None
    (item,) = trainer.read_batch(TASK, 1).items
    assert trainer.expire(item) is not None
    ((_, written),) = trainer.client.xrange(trainer.keys.expired(TASK))
    assert [name for name, _ in page] == [k.decode() for k in written if k != b"summary"]
    for name, value in page:
        expected = literal(value)
        assert expected is None or written[name.encode()] == expected, name
    # and the meta the page spells out
    meta = orjson.loads(written[b"meta"])
    assert set(meta) == {
        "prompt",
        "prompt_ids_in_samples",
        "samples",
        "shared_prompt",
        "created_at",
        "timings",
    }
    assert (meta["prompt_ids_in_samples"], meta["samples"], meta["shared_prompt"], meta["timings"]) == (
        False, [], True, {},
    )  # fmt: skip
    assert meta["prompt"]["uid"] == "q1"
    assert counted(block) == {f"{TASK}:expired"}


@pytest.mark.integration
@pytest.mark.parametrize(("number", "kind"), [("11.6", WEIGHT_SYNC), ("11.8", STOP)])
def test_the_events_are_what_the_bundled_code_publishes(
    number: str, kind: str, redis_server: EmbeddedRedis, run_name: str
) -> None:
    (block,) = [b for b in blocks(section(document(), number)) if "XADD rs:{run}:events" in b]
    page = xadd_fields(block, "rs:{run}:events")
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    control = RunControl(client, keys)
    control.publish(kind, 7 if kind == WEIGHT_SYNC else None, "file:///w/7" if kind == WEIGHT_SYNC else "")
    ((_, written),) = client.xrange(keys.events)
    assert [name for name, _ in page] == [k.decode() for k in written]
    for name, value in page:
        expected = literal(value)
        assert expected is None or written[name.encode()] == expected, name
    if kind == WEIGHT_SYNC:  # "HSET rs:{run}:state model_step <t>" in the same MULTI
        assert "HSET rs:{run}:state model_step <t>" in block
        assert client.hget(keys.state, "model_step") == b"7" == written[b"model_step"]
    client.close()


# --- the scripts the page prints are the bundled ones (§11.6, §11.9, §13) ---------------


@pytest.mark.parametrize(
    ("number", "module", "name"),
    [
        ("11.6", "events", "_WEIGHT_SYNC"),
        ("11.9", "events", "_STATUS"),
        ("11.9.1", "scripts", "CLAIM_BOUNDED"),
        ("11.9.2", "scripts", "TOUCH"),
        ("13.", "scripts", "COMMIT_LOGGED"),
    ],
)
def test_a_script_the_page_prints_is_the_bundled_one(number: str, module: str, name: str) -> None:
    import importlib

    code = getattr(importlib.import_module(f"rollstream.shared.{module}"), name)
    printed = [b.strip() for b in blocks(section(document(), number), "lua")]
    assert code.strip() in printed, f"§{number} does not print {name} as the code has it"


def test_the_protocol_table_names_every_published_number(make_settings: Any) -> None:
    """§10: every name the run publishes under "protocol" has its row, archive.keep first
    among what a foreign trainer must not miss."""
    from rollstream.shared.runconfig import protocol_settings

    text = section(document(), "10.")
    names = set(protocol_settings(make_settings()))
    assert "archive.keep" in names
    assert {n for n in names if f"| `{n}` |" not in text} == set()
