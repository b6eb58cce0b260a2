"""`rollstream show` as a user runs it, on entries the library wrote to a real redis-server:
groups, pools, prompts, a dead letter, an event, and a group entry that does not decode."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis

from rollstream.shared import codec
from rollstream.shared.buffer_types import BATCH_META
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import DecodeError
from rollstream.shared.events import WEIGHT_SYNC, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.records import Group, Prompt, Sample
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import documentation, group_for, prompts

pytestmark = pytest.mark.integration

LONG_TEXT = "The answer is 2. " * 10  # 170 characters: the output shows the first 80
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 * 7?"}]


@dataclass
class Run:
    url: str
    name: str
    ids: dict[str, str]  # what each written entry is -> its id
    bad_reason: str  # the DecodeError of the hand-written group entry
    dead_reason: str


def rollstream(run: Run, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env |= {"ROLLSTREAM_REDIS__URL": run.url, "ROLLSTREAM_RUN": run.name}
    result = subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def shown(run: Run, *args: str) -> str:
    result = rollstream(run, "show", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def shown_json(run: Run, *args: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in shown(run, *args, "--json").splitlines()]


def landed(entry_id: str | None) -> str:
    assert entry_id is not None, "a settle of this test's own claim did not land"
    return entry_id


def mixed_group(prompt: Prompt) -> Group:
    """Two samples: one whose tokens two model steps made, one cut off at the length limit."""
    samples = [
        Sample([1, 2, 3], [10, 11, 12], [-0.1] * 3, [1, 1, 2], finish_reason="stop",
               reward={"score": 0.25, "judge": "exact"}, text="first line\nsecond line"),
        Sample([1, 2, 3], [20] * 7, [-0.2] * 7, [2] * 7, finish_reason="length",
               reward={"score": 0.75}, text=LONG_TEXT),
    ]  # fmt: skip
    return Group.for_prompt(prompt, samples=samples, producer="producer-1")


@pytest.fixture(scope="module")
def run(redis_server: EmbeddedRedis) -> Iterator[Run]:
    """One run holding an entry of every kind, written through the library."""
    name = f"t{uuid.uuid4().hex[:10]}"
    settings = load_settings(
        run=name,
        redis={"url": redis_server.url},
        tasks=[{"name": "default", "n": 2}, {"name": "code", "n": 2}],
        buffer={"claim_idle_ms": 1000, "max_attempts": 3, "block_ms": 100, "summary": True},
    )
    client: Any = redis.Redis.from_url(redis_server.url)  # replies are bytes; redis-py types them loosely
    keys = Keys(name)
    producer = open_buffer(client, settings, "producer-1")
    trainer = open_buffer(client, settings, "trainer")
    producer.ensure("default")
    bad_prompt = {b"uid": b"bad", b"task": b"default", b"data": b"[1, 2]"}
    ids = {"bad prompt": client.xadd(keys.prompts("default"), bad_prompt).decode()}
    producer.feed(prompts("default", 5))
    claims = {c.prompt.uid: c for c in producer.claim("default", 5)}  # the bad prompt is dead-lettered
    assert sorted(claims) == ["u0", "u1", "u2", "u3"]
    # u2 first: the trainer reads it first and expires it
    ids["u2"] = landed(producer.complete(claims["u2"], group_for(claims["u2"].prompt, n=3, tokens=2)))
    ids["u0"] = landed(producer.complete(claims["u0"], group_for(claims["u0"].prompt, n=2, tokens=5, step=3)))
    ids["u1"] = landed(producer.complete(claims["u1"], mixed_group(claims["u1"].prompt)))
    partial = Sample([1, 2, 3], [5, 6, 7, 8], [-0.3] * 4, [4] * 4, status="aborted", text="partial")
    ids["aborted"] = landed(producer.abort(claims["u3"], [partial], model_step=4))
    (expired,) = trainer.read_batch("default", 1).items
    ids["expired"] = landed(trainer.expire(expired))

    bad_group = {
        b"task": b"default",
        b"group_id": b"default:broken",
        b"meta": b"{not json",
        b"response_ids": np.arange(6, dtype="<i4").tobytes(),
    }
    ids["bad group"] = client.xadd(keys.groups("default"), bad_group).decode()
    with pytest.raises(DecodeError) as bad:
        codec.decode_group(bad_group)

    # as a writer from before the summary field (or with buffer.summary off) wrote it
    older = codec.encode_group(group_for(prompts("code", 1)[0], n=2, tokens=4, step=1), summary=False)
    ids["no summary"] = client.xadd(keys.groups("code"), older).decode()

    ids["event"] = RunControl(client, keys).publish(WEIGHT_SYNC, model_step=3, uri="file:///weights/3")
    chat = Prompt("q1", "code", CHAT, prompt_ids=[7, 8, 9, 10], meta={BATCH_META: "b1", "answer": "42"})
    producer.feed([chat], pool="evals")
    # orjson reads JSON nested deeper than it writes: the library cannot feed this one
    deep = b'{"uid":"deep","task":"code","prompt":"deep?","meta":{"x":' + b"[" * 300 + b"]" * 300 + b"}}"
    client.xadd(keys.prompts("code"), {"uid": "deep", "task": "code", "data": deep})
    metrics = {"producer": "producer-1", "model_step": 3, "groups": 2, "groups_per_s": 1.5, "reward_mean": ""}
    ids["metrics"] = client.xadd(keys.metrics, metrics).decode()
    (dead,) = client.xrange(keys.dead)
    yield Run(redis_server.url, name, ids, str(bad.value), dead[1][b"reason"].decode())
    client.close()


def test_groups_show_ids_token_counts_versions_rewards_and_the_undecodable_entry(run: Run) -> None:
    out = shown(run, "groups")

    assert f"rs:{{{run.name}}}:groups:default: 3 of 3 entries, oldest first" in out
    u0, rest = out.split(run.ids["u1"] + "  ")
    u1, bad = rest.split(run.ids["bad group"] + "  ")
    assert f"{run.ids['u0']}  task default  group_id default:u0  model_step 3  status completed  n 2" in u0
    assert "prompt_tokens 3  response_tokens 10  reward_mean 0.5" in u0
    # the writer's summary line, as stored (its content: tests/unit/test_summary.py)
    assert '  summary default step=3 n=2 reward=0.5+-0.5 len=5/5/5 completed uid=u0 "What is 0 + 1?"\n' in u0
    assert 'uid u0  prompt "What is 0 + 1?"' in u0
    assert "sample 0: 5 tokens  versions 3 x5  reward score=0.0  finish stop" in u0
    assert "sample 1: 5 tokens  versions 3 x5  reward score=1.0  finish stop" in u0

    assert "group_id default:u1  model_step 1  status completed  n 2  attempt 1  producer producer-1" in u1
    assert "reward_mean 0.5" in u1
    assert 'sample 0: 3 tokens  versions 1 x2, 2 x1  reward score=0.25 judge="exact"' in u1
    assert r'text "first line\nsecond line"' in u1  # one line per sample
    assert "sample 1: 7 tokens  versions 2 x7  reward score=0.75  finish length" in u1
    assert f'text "{LONG_TEXT[:80]}"...' in u1
    assert LONG_TEXT[:81] not in u1

    assert f"UNDECODABLE: {run.bad_reason}" in bad
    assert "JSONDecodeError" in run.bad_reason
    assert "fields: task (7 B), group_id (14 B), meta (9 B), response_ids (24 B)" in bad
    # token arrays as counts, never as ids
    assert "[10, 11, 12]" not in out and "\\x00" not in out


def test_groups_as_json_carry_the_same_numbers(run: Run) -> None:
    u0, u1, bad = shown_json(run, "groups")

    assert (u0["id"], u0["kind"], u0["group_id"], u0["task"]) == (
        run.ids["u0"],
        "group",
        "default:u0",
        "default",
    )
    assert (u0["model_step"], u0["status"], u0["n"], u0["reward_mean"]) == (3, "completed", 2, 0.5)
    assert (u0["prompt_tokens"], u0["response_tokens"]) == (3, 10)  # the field: shared, once
    assert [s["tokens"] for s in u0["samples"]] == [5, 5]
    assert [s["versions"] for s in u0["samples"]] == [[[3, 5]], [[3, 5]]]
    assert [s["reward"] for s in u0["samples"]] == [{"score": 0.0}, {"score": 1.0}]
    assert u0["prompt"]["prompt"] == "What is 0 + 1?"
    assert u0["summary"] == 'default step=3 n=2 reward=0.5+-0.5 len=5/5/5 completed uid=u0 "What is 0 + 1?"'

    assert [s["tokens"] for s in u1["samples"]] == [3, 7]
    assert [s["versions"] for s in u1["samples"]] == [[[1, 2], [2, 1]], [[2, 7]]]
    assert [s["finish"] for s in u1["samples"]] == ["stop", "length"]
    assert [s["reward"]["score"] for s in u1["samples"]] == [0.25, 0.75]
    assert u1["samples"][1]["text"] == LONG_TEXT
    assert "response_ids" not in str(u1)

    assert bad == {
        "id": run.ids["bad group"],
        "kind": "undecodable",
        "error": run.bad_reason,
        "fields": {"task": 7, "group_id": 14, "meta": 9, "response_ids": 24},
    }


def test_a_group_entry_without_a_summary_shows_the_rest(run: Run) -> None:
    out = shown(run, "groups", "--task", "code")
    assert f"{run.ids['no summary']}  task code  group_id code:u0  model_step 1  status completed  n 2" in out
    assert "sample 1: 4 tokens  versions 1 x4" in out
    assert "summary" not in out
    (entry,) = shown_json(run, "groups", "--task", "code")
    assert (entry["kind"], entry["n"], entry["summary"]) == ("group", 2, None)


def test_the_readme_redis_cli_line_prints_the_newest_summaries(run: Run, redis_server: EmbeddedRedis) -> None:
    """The documentation's cookbook line, run as written (shell, redis-cli, awk) on this run."""
    cli = shutil.which("redis-cli") or str(Path(redis_server.binary).with_name("redis-cli"))
    if not Path(cli).is_file():
        pytest.skip("no redis-cli")
    (line,) = [line for line in documentation().splitlines() if '"summary"' in line]
    command = line.replace("redis-cli", f"{cli} -u {run.url}", 1).replace("{exp1}", f"{{{run.name}}}")
    out = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    client = redis.Redis.from_url(run.url)
    newest = client.xrevrange(Keys(run.name).groups("default"), count=3)
    client.close()
    summaries = [fields[b"summary"].decode() for _, fields in newest if b"summary" in fields]
    assert len(summaries) == 2  # u1 and u0; the hand-written bad entry has none
    assert out.splitlines() == summaries


def test_last_count_and_id_pick_the_entries(run: Run) -> None:
    newest = shown_json(run, "groups", "--last", "--count", "2")
    assert [e["id"] for e in newest] == [run.ids["bad group"], run.ids["u1"]]
    out = shown(run, "groups", "--last", "--count", "1")
    assert "1 of 3 entries, newest first" in out and "default:u0" not in out

    (one,) = shown_json(run, "groups", "--id", run.ids["u1"])
    assert one["group_id"] == "default:u1"
    assert run.ids["u1"] in shown(run, "groups", "--id", run.ids["u1"], "--task", "default")

    missing = rollstream(run, "show", "groups", "--id", "1-1")
    assert missing.returncode == 1 and "has no entry 1-1" in missing.stderr
    malformed = rollstream(run, "show", "groups", "--id", "latest")
    assert malformed.returncode == 2 and "not a stream entry id" in malformed.stderr


def test_pools_and_prompts(run: Run) -> None:
    aborted = shown(run, "aborted")
    assert "group_id default:u3  model_step 4  status aborted  n 1" in aborted
    assert 'sample 0: 4 tokens  versions 4 x4  reward -  finish -  status aborted  text "partial"' in aborted
    (expired,) = shown_json(run, "expired")
    assert (expired["id"], expired["group_id"], expired["status"]) == (
        run.ids["expired"],
        "default:u2",
        "expired",
    )
    assert (expired["n"], expired["samples"], expired["model_step"]) == (0, [], 0)

    fresh = shown(run, "prompts")
    assert "1 of 1 entries" in fresh
    assert 'uid u4  prompt "What is 4 + 1?"  meta {"answer":"5"}' in fresh

    evals = shown(run, "evals", "--task", "code")
    assert "uid q1  chat of 2 messages  (4 prompt tokens)" in evals
    assert 'system: "Be brief."' in evals and 'user: "What is 6 * 7?"' in evals
    (chat,) = shown_json(run, "evals", "--task", "code")
    assert (chat["kind"], chat["prompt"], chat["prompt_tokens"]) == ("prompt", CHAT, 4)

    deep = shown(run, "prompts", "--task", "code")
    assert 'uid deep  prompt "deep?"  meta <Recursion limit reached>' in deep
    (deep_json,) = shown_json(run, "prompts", "--task", "code")
    assert deep_json["kind"] == "undecodable"
    assert deep_json["error"] == "the decoded entry cannot be written as JSON: Recursion limit reached"

    empty = shown(run, "evals")
    assert f"rs:{{{run.name}}}:evals:default: no entries" in empty
    unknown = shown(run, "evals", "--task", "nosuch")
    assert "no entries (the settings' tasks: default)" in unknown


def test_dead_letters_and_events(run: Run) -> None:
    dead = shown(run, "dead")
    assert f"DEAD LETTER  reason {run.dead_reason}" in dead
    assert "undecodable prompt entry" in run.dead_reason
    assert f"attempts 1  source rs:{{{run.name}}}:prompts:default {run.ids['bad prompt']}" in dead
    assert "original entry: task default  uid bad" in dead
    assert "its other fields: data (6 B)" in dead
    (letter,) = shown_json(run, "dead")
    assert (letter["kind"], letter["reason"], letter["attempts"]) == ("dead_letter", run.dead_reason, 1)
    assert (letter["source_id"], letter["original"]) == (
        run.ids["bad prompt"],
        {"task": "default", "uid": "bad"},
    )

    events = shown(run, "events")
    assert f"{run.ids['event']}  type weight_sync  model_step 3  uri file:///weights/3  ts " in events
    (event,) = shown_json(run, "events")
    assert event["fields"]["model_step"] == 3 and event["fields"]["uri"] == "file:///weights/3"
    assert isinstance(event["fields"]["ts"], float)

    assert f"{run.ids['metrics']}  producer producer-1  model_step 3  groups 2  groups_per_s 1.5" in shown(
        run, "metrics"
    )
    (record,) = shown_json(run, "metrics")
    assert record["fields"] == {
        "producer": "producer-1", "model_step": 3, "groups": 2, "groups_per_s": 1.5, "reward_mean": "",
    }  # fmt: skip
