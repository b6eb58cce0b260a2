"""Replay-buffer throughput against the raw Redis Streams ceiling, side by side.

One producer process and one consumer process on a real redis-server, a group
being 8 samples x 2,048 response tokens + a 512-token prompt with logprobs:

  ours  setup feeds N prompts; the producer claims 64 at a time and completes
        the claims with one prebuilt group each (ReplayBuffer.claim /
        complete_many: the codec, then one fenced settle); the consumer reads batches of 64
        (ReplayBuffer.read_batch, block 100 ms), sums the decoded response
        lengths and commits each batch (the fenced commit script).
  raw   no rollstream code: the producer XADDs the same field bytes (taken from
        shared.codec.encode_group) N times; the consumer XREADGROUP COUNT 64
        BLOCK 100, touches each entry, then XACK + XDEL the batch (one pipeline).
        --ack-only adds "raw-ack", the same without XDEL.

Each run is timed from a start barrier both children pass to the consumer's
last commit; the ways alternate across repeats (raw, ours, raw, ours, ...) on a
flushed database. CPU per group is getrusage in each child (and INFO cpu for
redis-server); memory per group is the used_memory delta with K groups left
unconsumed in the groups stream, against the payload (field names + values).

    .venv/bin/python bench/buffer.py             # ~1 min on 2 cores
    .venv/bin/python bench/buffer.py --quick     # a few seconds
    .venv/bin/python bench/buffer.py --profile   # and cProfile ours' children once
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import platform
import pstats
import resource
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import redis
from common import RESULTS
from workload import PROMPT_TOKENS, RESPONSE_TOKENS, SAMPLES, build_samples

from rollstream.shared import codec
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import TRAINER, TRAINER_CONSUMER
from rollstream.shared.records import Group, Prompt
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings

TASK = "bench"
BATCH = 64
BLOCK_MS = 100
RAW_STREAM = "raw:groups"  # the baseline: plain XADD / XREADGROUP / XACK outside rollstream's keys
RAW_GROUP = TRAINER
TARGET_RATIO = 0.8
SWEEP_TOKENS = (1024, 1536, 1792, 1920, 2048, 2304, 2560, 3072, 3584, 4096)
CPU_SIDES = ("producer", "consumer", "redis")
START_TIMEOUT_S = 120
RUN_TIMEOUT_S = 600


def main() -> None:
    args = parse_args()
    ways = ["raw", "ours"] + (["raw-ack"] if args.ack_only else [])
    fields = codec.encode_group(Group.for_prompt(bench_prompt(0), samples=build_samples(score=1.0)))
    payload = payload_bytes(fields)

    with EmbeddedRedis() as server:
        settings = bench_settings(server.url)
        client = connect(settings.redis)
        runs: list[dict[str, Any]] = []  # in the order they ran
        for repeat in range(args.repeats):
            for way in ways:  # interleaved, each on a flushed database
                run = run_once(client, settings, way, args.groups, fields)
                runs.append(run)
                print(f"  repeat {repeat + 1}/{args.repeats} {way:<8} {run['groups_per_s']:>8,.0f} groups/s")
        memory = {
            "ours": memory_per_group(client, settings, args.memory_groups, way="ours"),
            "raw": memory_per_group(client, settings, args.memory_groups, way="raw", fields=fields),
        }
        sweep = memory_sweep(client, settings, max(32, args.memory_groups // 4))
        if args.profile:
            run_once(client, settings, "ours", args.groups, fields, profile_dir=RESULTS)
        client.close()

    result = summarize(args, runs, memory, payload) | {"memory_sweep": sweep}
    print_table(result)
    print_sweep(sweep)
    write_json(result, RESULTS / "buffer.json")


# --- one measured run ----------------------------------------------------------------


def run_once(
    client: redis.Redis,
    settings: Settings,
    way: str,
    n: int,
    fields: codec.Fields,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """Prepare the database for ``way``, run its producer and consumer processes from
    one start barrier, and return groups/s, wall time and CPU per group."""
    client.flushdb()
    prepare(client, settings, way, n)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)  # producer, consumer, this process
    # The one pickle in the project: a benchmark's own processes hand their timings back
    # through a multiprocessing queue. Nothing that rollstream runs or stores is pickled.
    results = ctx.Queue()
    children = [
        ctx.Process(
            target=child,
            args=(role, way, settings.redis.url, n, fields, barrier, results, profile_dir),
            daemon=True,  # never outlive a failed run
        )
        for role in ("producer", "consumer")
    ]
    for process in children:
        process.start()
    try:
        barrier.wait(timeout=START_TIMEOUT_S)
    except threading.BrokenBarrierError:
        report = results.get(timeout=30)
        raise RuntimeError(f"{way} {report['role']} failed at setup:\n{report.get('error')}") from None
    redis_cpu_before = redis_cpu_s(client)
    by_role = {}
    for _ in children:
        report = results.get(timeout=RUN_TIMEOUT_S)
        if "error" in report:
            raise RuntimeError(f"{way} {report['role']} failed:\n{report['error']}")
        by_role[report["role"]] = report
    redis_cpu = redis_cpu_s(client) - redis_cpu_before
    for process in children:
        process.join(timeout=30)

    producer, consumer = by_role["producer"], by_role["consumer"]
    if consumer["tokens"] != n * SAMPLES * RESPONSE_TOKENS:
        raise RuntimeError(f"{way}: the consumer touched {consumer['tokens']} tokens for {n} groups")
    wall = consumer["end"] - min(producer["start"], consumer["start"])
    return {
        "way": way,
        "groups": n,
        "wall_s": wall,
        "groups_per_s": n / wall,
        "cpu_us_per_group": {
            "producer": producer["cpu_s"] / n * 1e6,
            "consumer": consumer["cpu_s"] / n * 1e6,
            "redis": redis_cpu / n * 1e6,
        },
    }


def prepare(client: redis.Redis, settings: Settings, way: str, n: int) -> None:
    """Ours: N prompts fed into the task. Raw: an empty stream with its consumer group."""
    if way == "ours":
        buffer = open_buffer(client, settings, "feeder")
        fed = buffer.feed(bench_prompt(i) for i in range(n))
        assert fed.added == n, fed
    else:
        client.xgroup_create(RAW_STREAM, RAW_GROUP, id="0", mkstream=True)


# --- the child processes -------------------------------------------------------------


def child(
    role: str,
    way: str,
    url: str,
    n: int,
    fields: codec.Fields,
    barrier: Barrier,
    results: Any,
    profile_dir: Path | None,
) -> None:
    """Set up one side of one way, pass the start barrier, run it, report times."""
    try:
        loop = SIDES[way, role](url, n, fields)
        profiler = cProfile.Profile() if profile_dir else None
        barrier.wait(timeout=START_TIMEOUT_S)
        start, cpu = time.monotonic(), cpu_s()  # CLOCK_MONOTONIC: comparable across processes
        if profiler:
            profiler.enable()
        tokens = loop()
        if profiler:
            profiler.disable()
        end, cpu = time.monotonic(), cpu_s() - cpu
        if profiler and profile_dir:
            report_profile(profiler, profile_dir / f"buffer_{way}_{role}.prof", f"{way} {role}")
        results.put({"role": role, "start": start, "end": end, "cpu_s": cpu, "tokens": tokens})
    except BaseException:
        barrier.abort()
        results.put({"role": role, "error": traceback.format_exc()})


def ours_producer(url: str, n: int, fields: codec.Fields) -> Callable[[], int]:
    settings = bench_settings(url)
    buffer = open_buffer(connect(settings.redis), settings, "producer-0")
    samples = build_samples(score=1.0)
    buffer.ensure(TASK)

    def loop() -> int:
        done = 0
        while done < n:
            claims = buffer.claim(TASK, BATCH)
            if not claims:
                raise RuntimeError(f"no prompt left to claim after {done} of {n}")
            groups = [Group.for_prompt(c.prompt, samples=samples, producer=buffer.consumer) for c in claims]
            if None in buffer.complete_many(list(zip(claims, groups, strict=True))):
                raise RuntimeError("a claim was fenced")
            done += len(claims)
        return 0

    return loop


def ours_consumer(url: str, n: int, fields: codec.Fields) -> Callable[[], int]:
    settings = bench_settings(url)
    buffer = open_buffer(connect(settings.redis), settings, TRAINER_CONSUMER)
    buffer.ensure(TASK)

    def loop() -> int:
        committed = tokens = 0
        while committed < n:
            batch = buffer.read_batch(TASK, BATCH, block_ms=BLOCK_MS)
            tokens += sum(len(s.response_ids) for g in batch.groups for s in g.samples)
            if buffer.commit(batch):
                raise RuntimeError("a batch had groups of another consumer")
            committed += len(batch)
        return tokens

    return loop


def raw_producer(url: str, n: int, fields: codec.Fields) -> Callable[[], int]:
    client = redis.Redis.from_url(url)

    def loop() -> int:
        for _ in range(n):
            client.xadd(RAW_STREAM, fields)  # type: ignore[arg-type]
        return 0

    return loop


def raw_consumer(url: str, n: int, fields: codec.Fields, delete: bool = True) -> Callable[[], int]:
    client = redis.Redis.from_url(url)
    tokens_per_group = SAMPLES * RESPONSE_TOKENS

    def loop() -> int:
        done = tokens = 0
        while done < n:
            reply: Any = client.xreadgroup(
                RAW_GROUP, TRAINER_CONSUMER, {RAW_STREAM: ">"}, count=BATCH, block=BLOCK_MS
            )
            if not reply:
                continue
            entries = reply[0][1]
            ids = [entry_id for entry_id, _ in entries]
            # touch each entry: 4 bytes per response token
            tokens += sum(len(f[b"response_ids"]) // 4 for _, f in entries)
            pipe = client.pipeline(transaction=False)
            pipe.xack(RAW_STREAM, RAW_GROUP, *ids)
            if delete:
                pipe.xdel(RAW_STREAM, *ids)
            pipe.execute()
            done += len(entries)
        assert tokens == n * tokens_per_group
        return tokens

    return loop


def raw_ack_consumer(url: str, n: int, fields: codec.Fields) -> Callable[[], int]:
    return raw_consumer(url, n, fields, delete=False)


SIDES: dict[tuple[str, str], Callable[[str, int, codec.Fields], Callable[[], int]]] = {
    ("ours", "producer"): ours_producer,
    ("ours", "consumer"): ours_consumer,
    ("raw", "producer"): raw_producer,
    ("raw", "consumer"): raw_consumer,
    ("raw-ack", "producer"): raw_producer,
    ("raw-ack", "consumer"): raw_ack_consumer,
}


# --- memory --------------------------------------------------------------------------


def memory_per_group(
    client: redis.Redis,
    settings: Settings,
    k: int,
    *,
    way: str,
    fields: codec.Fields | None = None,
    tokens: int = RESPONSE_TOKENS,
) -> dict[str, float]:
    """used_memory delta per group with K groups unconsumed in a groups stream, and
    MEMORY USAGE of that stream per group."""
    client.flushdb()
    if way == "ours":
        prepare(client, settings, "ours", k)
        buffer = open_buffer(client, settings, "producer-mem")
        claims = buffer.claim(TASK, k)
        assert len(claims) == k
        samples = build_samples(score=1.0, tokens=tokens)
        before = used_memory(client)
        for claim in claims:
            buffer.complete(claim, Group.for_prompt(claim.prompt, samples=samples))
        stream = buffer.keys.groups(TASK)
    else:
        assert fields is not None, "raw stores the fields it is given"
        prepare(client, settings, "raw", k)
        before = used_memory(client)
        for _ in range(k):
            client.xadd(RAW_STREAM, fields)  # type: ignore[arg-type]
        stream = RAW_STREAM
    after = used_memory(client)
    usage = int(client.memory_usage(stream, samples=0) or 0)
    client.flushdb()
    return {"used_memory_per_group": (after - before) / k, "memory_usage_per_group": usage / k, "k": k}


def memory_sweep(client: redis.Redis, settings: Settings, k: int) -> list[dict[str, float]]:
    """Memory per group against payload over response lengths, ours and raw: where a
    payload falls among the allocator's size classes decides the overhead (jemalloc
    rounds a large allocation up to one of 4 classes per doubling, up to +25%)."""
    rows = []
    for tokens in SWEEP_TOKENS:
        fields = group_fields(tokens)
        payload = payload_bytes(fields)
        ours = memory_per_group(client, settings, k, way="ours", tokens=tokens)["used_memory_per_group"]
        raw = memory_per_group(client, settings, k, way="raw", fields=fields)["used_memory_per_group"]
        rows.append(
            {"response_tokens": tokens, "payload_bytes": payload, "ours_bytes": ours, "raw_bytes": raw}
            | {"ours_overhead": ours / payload - 1, "raw_overhead": raw / payload - 1}
        )
    return rows


def group_fields(tokens: int) -> codec.Fields:
    samples = build_samples(score=1.0, tokens=tokens)
    return codec.encode_group(Group.for_prompt(bench_prompt(0), samples=samples))


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# --- the data ------------------------------------------------------------------------


def bench_prompt(i: int) -> Prompt:
    return Prompt(uid=f"p{i:07d}", task=TASK, prompt="Solve: what is 17 * 23? Think step by step.")


def bench_settings(url: str) -> Settings:
    return load_settings(
        run="bench",
        redis={"url": url},
        tasks=[{"name": TASK, "n": SAMPLES}],
        buffer={"read_count": BATCH, "block_ms": BLOCK_MS},
    )


# --- reporting -----------------------------------------------------------------------


def summarize(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    memory: dict[str, dict[str, float]],
    payload: int,
) -> dict[str, Any]:
    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    by_way: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_way.setdefault(run["way"], []).append(run)
    rates = {way: spread([r["groups_per_s"] for r in rs]) for way, rs in by_way.items()}
    cpu = {
        way: {side: statistics.median(r["cpu_us_per_group"][side] for r in rs) for side in CPU_SIDES}
        for way, rs in by_way.items()
    }
    # each repeat's own ratio too: its two runs ran back to back
    pair_ratios = [
        o["groups_per_s"] / r["groups_per_s"] for o, r in zip(by_way["ours"], by_way["raw"], strict=True)
    ]
    ours_mem = memory["ours"]["used_memory_per_group"]
    result: dict[str, Any] = {
        "shape": {"samples": SAMPLES, "response_tokens": RESPONSE_TOKENS, "prompt_tokens": PROMPT_TOKENS},
        "groups": args.groups,
        "batch": BATCH,
        "machine": platform.node(),
        "ours_groups_per_s": rates["ours"]["median"],
        "raw_groups_per_s": rates["raw"]["median"],
        "ratio_vs_raw": rates["ours"]["median"] / rates["raw"]["median"],
        "ratio_per_repeat": pair_ratios,
        "groups_per_s": rates,
        "repeats": runs,
        "cpu_us_per_group": cpu,
        "payload_bytes": payload,
        "memory_per_group_bytes": ours_mem,
        "memory_overhead": ours_mem / payload,
        "memory": memory,
    }
    if "raw-ack" in rates:
        result["raw_ack_only_groups_per_s"] = rates["raw-ack"]["median"]
    return result


def print_table(r: dict[str, Any]) -> None:
    print(
        f"\n{r['groups']} groups of {SAMPLES} x {RESPONSE_TOKENS} + {PROMPT_TOKENS} tokens, batch {BATCH}, "
        f"{len(r['ratio_per_repeat'])} repeats; groups/s median [min-max]; CPU µs per group (median)"
    )
    print(f"{'way':<9}{'groups/s':>26}{'producer':>11}{'consumer':>11}{'redis':>9}{'MB/s':>8}")
    for way, rate in r["groups_per_s"].items():
        cpu = r["cpu_us_per_group"][way]
        print(
            f"{way:<9}{rate['median']:>9,.0f} [{rate['min']:>6,.0f}-{rate['max']:>6,.0f}]"
            f"{cpu['producer']:>11,.0f}{cpu['consumer']:>11,.0f}{cpu['redis']:>9,.0f}"
            f"{rate['median'] * r['payload_bytes'] / 1e6:>8,.0f}"
        )
    ours, raw = r["memory"]["ours"], r["memory"]["raw"]
    print(
        f"memory per group ({ours['k']} unconsumed): ours {ours['used_memory_per_group'] / 1024:,.1f} KiB "
        f"(MEMORY USAGE {ours['memory_usage_per_group'] / 1024:,.1f}), raw "
        f"{raw['used_memory_per_group'] / 1024:,.1f} KiB; payload {r['payload_bytes'] / 1024:,.1f} KiB "
        f"-> overhead {r['memory_overhead']:.2f}x"
    )
    pairs = ", ".join(f"{x:.2f}" for x in r["ratio_per_repeat"])
    verdict = "meets" if r["ratio_vs_raw"] >= TARGET_RATIO else "BELOW"
    print(
        f"ours/raw = {r['ratio_vs_raw']:.2f} ({r['ours_groups_per_s']:,.0f} vs {r['raw_groups_per_s']:,.0f} "
        f"groups/s; per repeat {pairs}): {verdict} the {TARGET_RATIO} target"
    )


def print_sweep(sweep: list[dict[str, float]]) -> None:
    print("memory per group over response lengths (8 samples + 512 prompt tokens), against the payload:")
    print(f"{'tokens':>8}{'payload KiB':>13}{'ours KiB':>10}{'raw KiB':>9}{'ours':>8}{'raw':>8}")
    for r in sweep:
        print(
            f"{r['response_tokens']:>8}{r['payload_bytes'] / 1024:>13,.1f}{r['ours_bytes'] / 1024:>10,.1f}"
            f"{r['raw_bytes'] / 1024:>9,.1f}{r['ours_overhead']:>+8.0%}{r['raw_overhead']:>+8.0%}"
        )


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def report_profile(profiler: cProfile.Profile, path: Path, title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(path)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    print(f"--- cProfile: {title} (by own time; {path}) ---\n{out.getvalue()}", flush=True)


# --- helpers -------------------------------------------------------------------------


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def payload_bytes(fields: codec.Fields) -> int:
    """Field names + values as redis-py sends them."""
    total = 0
    for name, value in fields.items():
        if not isinstance(value, bytes):
            value = (repr(value) if isinstance(value, float) else str(value)).encode()
        total += len(name) + len(value)
    return total


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8_000, help="groups per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each way, interleaved")
    parser.add_argument("--memory-groups", type=int, default=256, help="K for memory per group")
    parser.add_argument("--ack-only", action="store_true", help="also run raw with XACK and no XDEL")
    parser.add_argument("--profile", action="store_true", help="cProfile one more run of ours")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke size: a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.repeats, args.memory_groups = 128, 1, 32
    return args


if __name__ == "__main__":
    main()
