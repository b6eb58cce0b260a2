"""What the ``summary`` field of a group entry costs, side by side in one run.

The field (shared.codec.group_summary) is one line of text per group entry for
people reading the stream with redis-cli; ``buffer.summary`` turns it off. Groups
of n = 8 and n = 16 samples, each response 256-2,048 tokens long (uniform), a
512-token prompt, float32 logprobs, two version runs, scores 0 or 1, and a
prompt text of 90-270 characters.

  encode    codec.encode_group_parts (what a producer's settle encodes), off and on,
            and codec.group_summary alone, in turn for every group (the order
            rotating), each call timed: µs per group
  bytes     payload bytes per entry (field names and values as sent)
  hot path  one process on a real redis-server, batch after batch of 64 groups,
            off and on in turn: claim the prompts, complete them
            (ReplayBuffer.complete_many: encode, one fenced settle), read them
            (read_batch: XREADGROUP, decode) and commit them; CPU µs per group of
            this process and redis-server (INFO cpu), which unlike wall time does
            not count waiting for a core that other programs hold

On a shared machine a run is now and then slowed by others: the figures are
medians, over every call (batch), of each way's time and of the difference of
two neighbouring calls (batches) of on and off, the figure the overhead is
that difference over off. The summary's own time is the steadiest figure here.

What it measured decided buffer.summary's default: off. On a shared 2-core machine
the field cost 7-12% of encode_group_parts and 1.6-3.5% of the hot path (the
summary's own time 1.3-2.1% of it), and 0.1-0.2% more bytes; free would have been
under 2-3% of both.

    .venv/bin/python bench/summary.py            # ~1 min on 2 cores
    .venv/bin/python bench/summary.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
from common import RESULTS, table, write_json
from workload import PROMPT_TOKENS, VOCAB

from rollstream.shared import codec
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.records import Group, Prompt, Sample
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings

TASK = "math"
SIZES = (8, 16)
MIN_TOKENS, MAX_TOKENS = 256, 2_048
BATCH = 64
WAYS = ("off", "on")
HEADLINE = (
    "encode_overhead",
    "hot_path_overhead",
    "summary_share_of_encode",
    "summary_share_of_hot_path",
    "bytes_overhead",
    "summary_chars_max",
)
QUESTION = "A train leaves the station at {h}:00 and travels {v} km/h for {t} hours. How far does it go? "


def main() -> None:
    args = parse_args()
    with EmbeddedRedis() as server:
        client = connect(load_settings(run="bench-summary", redis={"url": server.url}).redis)
        shapes = {f"n={n}": measure_shape(client, server.url, n, args) for n in SIZES}
        client.close()
    result = {
        "machine": platform.node(),
        "groups": args.groups,
        "rounds": args.rounds,
        "hot_path_groups": args.hot_groups,
        "hot_path_runs": args.runs,
        "response_tokens": [MIN_TOKENS, MAX_TOKENS],
        "prompt_tokens": PROMPT_TOKENS,
        "shapes": shapes,
        # the headline: the larger of the two shapes'
        **{name: max(s[name] for s in shapes.values()) for name in HEADLINE},
    }
    print(report(result))
    write_json(result, RESULTS / "summary.json")


def measure_shape(client: redis.Redis, url: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    groups = [build_group(n, seed) for seed in range(args.groups)]
    check(groups[0])
    encode = time_encode(groups, args.rounds)
    settings = {way: bench_settings(url, way == "on") for way in WAYS}
    hot: dict[str, list[float]] = {way: [] for way in WAYS}
    for run in range(args.runs):
        for way, times in time_hot_path(client, settings, groups, args.hot_groups, run).items():
            hot[way] += times
    sizes = {way: statistics.mean(payload_bytes(g, way == "on") for g in groups) for way in WAYS}
    encode_off, hot_off = statistics.median(encode["off"]), statistics.median(hot["off"])
    summary = statistics.median(encode["summary"])
    encode_more, hot_more = paired(encode), paired(hot)
    chars = [len(codec.group_summary(g)) for g in groups]
    return {
        "n": n,
        "response_tokens_mean": statistics.mean(len(s.response_ids) for g in groups for s in g.samples),
        "summary_us": summary,
        "encode_us": {way: statistics.median(encode[way]) for way in WAYS},
        "encode_more_us": encode_more,
        "encode_overhead": encode_more / encode_off,
        "summary_share_of_encode": summary / encode_off,
        "hot_path_us": {way: statistics.median(hot[way]) for way in WAYS},
        "hot_path_more_us": hot_more,
        "hot_path_overhead": hot_more / hot_off,
        "summary_share_of_hot_path": summary / hot_off,
        "payload_bytes": sizes,
        "bytes_overhead": sizes["on"] / sizes["off"] - 1,
        "summary_chars_max": max(chars),
        "summary_chars_mean": statistics.mean(chars),
        "example": codec.group_summary(groups[0]),
    }


def paired(times: dict[str, list[float]]) -> float:
    """Median of on - off over neighbouring calls: slow spells of the machine cancel out."""
    return statistics.median(a - b for a, b in zip(times["on"], times["off"], strict=True))


# --- measurements --------------------------------------------------------------------


def time_encode(groups: list[Group], rounds: int) -> dict[str, list[float]]:
    """µs of each call: encode_group_parts off and on, and group_summary alone (a little
    more than the encoder pays, which has the scores and lengths at hand), in turn for
    each group after an untimed encode of it, the order rotating, ``rounds`` times over
    the groups."""
    calls: list[tuple[str, Callable[[Group], object]]] = [
        ("off", functools.partial(codec.encode_group_parts, summary=False)),
        ("on", functools.partial(codec.encode_group_parts, summary=True)),
        ("summary", codec.group_summary),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in calls}
    clock = time.perf_counter
    for r in range(rounds):
        for i, group in enumerate(groups):
            codec.encode_group_parts(group, summary=True)  # untimed: what the calls read is in cache
            k = (r + i) % len(calls)
            for name, call in calls[k:] + calls[:k]:
                start = clock()
                call(group)
                times[name].append((clock() - start) * 1e6)
    return times


def time_hot_path(
    client: redis.Redis, settings: dict[str, Settings], groups: list[Group], count: int, run: int
) -> dict[str, list[float]]:
    """CPU µs per group (this process and redis-server) of each batch of claim,
    complete_many, read_batch and commit, the batches alternating between a producer
    with the summary off and one with it on, ``count`` groups (the prepared ``groups``
    in turn) on a flushed database."""
    client.flushdb()
    producers = {way: open_buffer(client, settings[way], f"producer-{way}") for way in WAYS}
    trainer = open_buffer(client, settings["off"], "trainer")
    prompts = [Prompt(f"q{i}", TASK, groups[i % len(groups)].prompt.prompt) for i in range(count)]
    assert trainer.feed(prompts).added == count
    trainer.ensure(TASK)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    done = 0
    for b in range(count // BATCH):
        way = WAYS[(b + run) % 2]
        start = cpu_s(client)
        claims = producers[way].claim(TASK, BATCH)
        finished = [
            (c, Group.for_prompt(c.prompt, samples=groups[(done + i) % len(groups)].samples))
            for i, c in enumerate(claims)
        ]
        if None in producers[way].complete_many(finished):
            raise RuntimeError("a claim was fenced")
        batch = trainer.read_batch(TASK, BATCH)
        if trainer.commit(batch):
            raise RuntimeError("a batch had groups of another consumer")
        if len(batch) != len(claims) or (way == "on") != all(
            b"summary" in i.entry.fields for i in batch.items
        ):
            raise RuntimeError(f"the trainer read {len(batch)} groups for {len(claims)} completed ({way})")
        times[way].append((cpu_s(client) - start) / len(claims) * 1e6)
        done += len(claims)
    return times


def cpu_s(client: redis.Redis) -> float:
    """CPU seconds so far of this process and of redis-server (INFO cpu): unlike wall
    time, not counting the time either waited for a core that others held."""
    info = client.info("cpu")
    return time.process_time() + float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# --- the data ------------------------------------------------------------------------


def build_group(n: int, seed: int) -> Group:
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int32)
    samples = []
    for _ in range(n):
        tokens = int(rng.integers(MIN_TOKENS, MAX_TOKENS + 1))
        cut = tokens // 3
        samples.append(
            Sample(
                prompt_ids=prompt_ids,
                response_ids=rng.integers(0, VOCAB, tokens, dtype=np.int32),
                logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
                response_versions=np.repeat(np.array([6, 7], dtype=np.int32), [cut, tokens - cut]),
                finish_reason="stop" if tokens < MAX_TOKENS else "length",
                reward={"score": float(rng.integers(0, 2))},
            )
        )
    question = QUESTION.format(h=seed % 24, v=40 + seed, t=1 + seed % 5) * int(rng.integers(1, 4))
    prompt = Prompt(uid=f"q{seed}", task=TASK, prompt=question)
    return Group.for_prompt(prompt, samples=samples, producer="bench-0")


def bench_settings(url: str, summary: bool) -> Settings:
    return load_settings(
        run="bench-summary",
        redis={"url": url},
        tasks=[{"name": TASK}],
        buffer={"read_count": BATCH, "summary": summary},
    )


def payload_bytes(group: Group, summary: bool) -> int:
    """Field names + values as redis-py sends them."""
    total = 0
    for name, value in codec.encode_group(group, summary=summary).items():
        if not isinstance(value, bytes):
            value = (repr(value) if isinstance(value, float) else str(value)).encode()
        total += len(name) + len(value)
    return total


def check(group: Group) -> None:
    """Both ways decode to the same group, before anything is timed; only "on" has it."""
    for summary in (False, True):
        fields = codec.encode_group(group, summary=summary)
        assert ("summary" in fields) is summary
        raw = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}
        assert codec.decode_group(raw).samples == group.samples


# --- reporting -----------------------------------------------------------------------


def report(r: dict[str, Any]) -> str:
    rows = [
        [
            name,
            f"{s['response_tokens_mean']:,.0f}",
            f"{s['summary_us']:.1f}",
            f"{s['encode_us']['off']:.1f}",
            f"{s['summary_share_of_encode']:.1%}",
            f"{s['encode_more_us']:+.1f} ({s['encode_overhead']:+.1%})",
            f"{s['hot_path_us']['off']:,.0f}",
            f"{s['summary_share_of_hot_path']:.2%}",
            f"{s['hot_path_more_us']:+.1f} ({s['hot_path_overhead']:+.1%})",
            f"{s['payload_bytes']['off'] / 1024:,.1f}",
            f"{s['bytes_overhead']:+.2%}",
            f"{s['summary_chars_mean']:.0f}",
        ]
        for name, s in r["shapes"].items()
    ]
    headers = ["group", "tokens", "summary", "encode", "share", "encode on-off", "hot path", "share"]
    headers += ["hot path on-off", "KiB", "bytes", "chars"]
    lines = [
        f"the summary field: {r['groups']} groups per shape encoded {r['rounds']} times each way; hot path "
        f"{r['hot_path_runs']} x {r['hot_path_groups']} groups in batches of {BATCH}, off and on in turn",
        table(headers, rows),
        "µs per group, medians; share: the summary's µs / encode's (off), and / the hot path's (off); "
        "on-off: median difference of neighbouring calls (batches), and its share of off",
    ]
    lines += [f"  {name}: {s['example']}" for name, s in r["shapes"].items()]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=64, help="distinct groups per shape")
    parser.add_argument("--rounds", type=int, default=40, help="encodes of each group each way")
    parser.add_argument("--hot-groups", type=int, default=1024, help="groups of one hot-path run")
    parser.add_argument("--runs", type=int, default=16, help="hot-path runs per shape")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke size: a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.rounds, args.hot_groups, args.runs = 8, 4, 128, 1
    return args


if __name__ == "__main__":
    main()
