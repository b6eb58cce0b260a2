"""Soak: a million groups through feed -> produce -> train -> commit on one Redis, with
Redis memory, every key of the run and the throughput sampled throughout.

The full pipeline, time-compressed: ``rollstream produce --local-engines`` processes (sim
engines at 1000x, so generation is nearly instant and what runs is the producer and Redis
side), the feeder (producer/feeder.py, a 10,000-row prompt file over as many epochs as
needed, ~2,000 prompts kept ahead), and this process as the trainer (the reference trainer
with no step time: batches of 64, commit = ack + delete, weights published every 100 steps).
Groups are small (n=2, lognormal lengths, median 32). So that every capped stream carries a
flow: the sim engines fail 10 % of requests (retries, and a dead letter when a group fails
max_attempts times), and a filter drops one prompt in ten (bench/soak_filter.py); the run's
dead-letter and filtered streams use the caps --dead-maxlen and --filtered-maxlen.

Every --sample-every groups trained: INFO used_memory, Redis CPU (INFO cpu, user + sys),
DBSIZE, and every key of the database (SCAN + TYPE; XLEN / SCARD / HLEN / ZCARD / LLEN, and
for a stream the pending entries and consumers of its groups). The verdict, over the
samples after the warm-up (--warmup, a share of the groups):

  memory     used_memory within 10 % of the first warm sample at every later sample
  keys       no key grows: its last size <= 1.10 x its largest in the first half of the
             warm samples + 128 (MAXLEN ~ trims whole stream nodes of 100 entries)
  throughput steady: the median groups/s of the last third >= 0.8 x the first third's

    .venv/bin/python bench/soak.py                       # 1,000,000 groups
    .venv/bin/python bench/soak.py --groups 20000        # the rate here, first
    .venv/bin/python bench/soak.py --quick               # ~30 s smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
from common import RESULTS, Producers, producer_env, used_memory, write_json

from rollstream.consumer.assembly import create_trainer
from rollstream.consumer.trainer import StepLog
from rollstream.producer.feeder import Feeder
from rollstream.producer.progress import METRICS_CAP
from rollstream.recipes.prompts import example_prompts
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import EVENTS_CAP
from rollstream.shared.keys import Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from rollstream.shared.streams import text

RUN = "soak"
BATCH = 64
N = 2
INTERVAL = 100  # train steps between weight syncs
PROMPT_ROWS = 10_000
KEEP_AHEAD = 2_000
FILTER = "bench.soak_filter:drop_one_in_ten"
MEMORY_TOLERANCE = 1.10
GROWTH_TOLERANCE, GROWTH_SLACK = 1.10, 128
STEADY = 0.8


def main() -> dict[str, Any]:
    args = parse_args()
    if args.judge:  # the verdict again, from a soak's JSON
        path = Path(args.judge)
        result: dict[str, Any] = json.loads(path.read_text())
        params = argparse.Namespace(**result["params"])
        result["verdict"] = verdict(result["samples"], params.warmup, caps_of(params))
        print_report(result)
        write_json(result, path)
        return result
    print(
        f"soak: {args.groups:,} groups of n={N} (sim engines at 1000x, failure rate {args.failure_rate}), "
        f"{args.producers} producer processes, batches of {BATCH}, a sample every {args.sample_every:,} "
        f"groups; caps dead {args.dead_maxlen:,} filtered {args.filtered_maxlen:,}",
        flush=True,
    )
    with EmbeddedRedis() as server:
        result = soak(server, args)
    result["verdict"] = verdict(result["samples"], args.warmup, caps_of(args))
    print_report(result)
    write_json(result, Path(args.out) if args.out else RESULTS / "soak.json")
    return result


def settings_of(url: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "run": RUN,
        "redis": {"url": url},
        "tasks": [{"name": "math", "n": N}],
        "engines": {
            "count": 1,
            "sim": {"median_tokens": 32, "time_compression": 1000, "failure_rate": args.failure_rate},
        },
        "rollout": {
            "mode": "async",
            "batch_size": BATCH,
            "max_staleness": 1,
            "sync_weights_interval": INTERVAL,
        },
        "producer": {"max_tokens": 128, "max_inflight": 64, "is_valid": FILTER},
        "buffer": {"dead_maxlen": args.dead_maxlen, "filtered_maxlen": args.filtered_maxlen},
    }


def env_of(tree: dict[str, Any]) -> dict[str, str]:
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}__{k}" if prefix else k, v)
        elif isinstance(value, list):
            flat[prefix] = json.dumps(value)
        else:
            flat[prefix] = str(value)

    walk("", {k: v for k, v in tree.items() if k not in ("run", "redis")})
    return producer_env(tree["redis"]["url"], tree["run"], **flat)


def soak(server: EmbeddedRedis, args: argparse.Namespace) -> dict[str, Any]:
    tree = settings_of(server.url, args)
    settings = load_settings(**tree)
    client = connect(settings.redis)
    client.flushdb()
    sampler = connect(settings.redis)
    stop = threading.Event()
    samples: list[dict[str, Any]] = []
    groups = 0
    next_sample = args.sample_every
    started = time.monotonic()
    load_before = os.getloadavg()

    def on_step(entry: StepLog) -> None:
        nonlocal groups, next_sample
        groups += entry.groups
        if groups >= next_sample or not samples:
            samples.append(sample(sampler, groups, time.monotonic() - started))
            next_sample = (groups // args.sample_every + 1) * args.sample_every
            if len(samples) % 10 == 0:
                s = samples[-1]
                print(
                    f"  {groups:,} groups, {s['t']:.0f} s, used_memory {s['used_memory'] / 2**20:.2f} MiB, "
                    f"{s['dbsize']} keys, load {s['load']:.1f}",
                    flush=True,
                )
        if time.monotonic() - started > args.seconds:
            stop.set()

    with tempfile.TemporaryDirectory() as tmp:
        path = example_prompts(Path(tmp) / "prompts.jsonl", PROMPT_ROWS)
        epochs = int(args.groups * 1.3) // PROMPT_ROWS + 2
        feeder = Feeder(
            open_buffer(client, settings, "feeder"), path, "math", epochs=epochs, keep_ahead=KEEP_AHEAD
        )
        feeding = threading.Thread(target=feeder.run, args=(stop,), daemon=True)
        feeding.start()
        trainer = create_trainer(settings, client=client, step_time_s=0.0, consumer="soak-trainer")
        with Producers(args.producers, env_of(tree)) as procs:
            watchdog = threading.Thread(target=_watch, args=(procs, stop, server), daemon=True)
            watchdog.start()
            trainer.run(-(-args.groups // BATCH), on_step, stop)
            if groups > samples[-1]["groups"]:
                samples.append(sample(sampler, groups, time.monotonic() - started))
            stop.set()
        feeding.join(timeout=10)
    sampler.close()
    client.close()
    return {
        "params": {k: v for k, v in vars(args).items() if k != "out"},
        "what": "rollstream produce --local-engines processes (sim engines), feeder, reference trainer",
        "groups": groups,
        "target_groups": args.groups,
        "seconds": samples[-1]["t"],
        "groups_per_s": groups / samples[-1]["t"],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "samples": samples,
    }


def _watch(procs: Producers, stop: threading.Event, server: EmbeddedRedis) -> None:
    """A producer that dies stops the run (the trainer would wait for its batch forever),
    the other producers and the Redis server with it."""
    while not stop.wait(1.0):
        try:
            procs.check()
        except RuntimeError as exc:
            print(exc, flush=True)
            procs.stop(timeout_s=5.0)
            server.stop()
            os._exit(1)


def key_sizes(client: redis.Redis) -> dict[str, int]:
    """Every key of the database: its length or cardinality; for a stream also the pending
    entries and consumers of its consumer groups (``key#pending``, ``key#consumers``)."""
    sizes: dict[str, int] = {}
    for raw in client.scan_iter(count=1000):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        kind = text(client.type(key))
        if kind == "stream":
            sizes[key] = int(client.xlen(key))
            groups = client.xinfo_groups(key)
            sizes[f"{key}#pending"] = sum(int(g["pending"]) for g in groups)
            sizes[f"{key}#consumers"] = sum(int(g["consumers"]) for g in groups)
        elif kind == "set":
            sizes[key] = int(client.scard(key))
        elif kind == "hash":
            sizes[key] = int(client.hlen(key))
        elif kind == "zset":
            sizes[key] = int(client.zcard(key))
        elif kind == "list":
            sizes[key] = int(client.llen(key))
        elif kind == "string":
            sizes[key] = int(client.strlen(key))
    return sizes


def sample(client: redis.Redis, groups: int, t: float) -> dict[str, Any]:
    cpu = client.info("cpu")
    return {
        "t": round(t, 3),
        "groups": groups,
        "used_memory": used_memory(client),
        "redis_cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        "dbsize": int(client.dbsize()),
        "load": os.getloadavg()[0],
        "keys": key_sizes(client),
    }


def caps_of(args: argparse.Namespace) -> dict[str, int]:
    """The streams of the run that a MAXLEN ~ caps, with their caps: one may grow up to it."""
    keys = Keys(RUN)
    return {
        keys.dead: args.dead_maxlen,
        keys.filtered: args.filtered_maxlen,
        keys.metrics: METRICS_CAP,
        keys.events: EVENTS_CAP,
    }


def verdict(samples: list[dict[str, Any]], warmup: float, caps: dict[str, int]) -> dict[str, Any]:
    """Memory flat, no key growing, throughput steady, over the samples after the warm-up.
    A capped stream that grows but stays below its cap + a node is "bounded", not growing."""
    total = samples[-1]["groups"]
    warm = [s for s in samples if s["groups"] >= warmup * total]
    if len(warm) < 4:
        return {"ok": False, "why": f"too few samples after the warm-up ({len(warm)})"}
    memory = [s["used_memory"] for s in warm]
    third = max(1, len(warm) // 3)
    first, memory_max = statistics.median(memory[:third]), max(memory)
    memory_trend = statistics.median(memory[-third:]) / first
    memory_ok = memory_trend <= MEMORY_TOLERANCE
    half = warm[: len(warm) // 2]
    names = sorted({k for s in warm for k in s["keys"]})
    keys: dict[str, Any] = {}
    growing: list[str] = []
    capped: list[str] = []
    for name in names:
        early = max((s["keys"].get(name, 0) for s in half), default=0)
        last = warm[-1]["keys"].get(name, 0)
        top = max(s["keys"].get(name, 0) for s in warm)
        keys[name] = {"first": warm[0]["keys"].get(name, 0), "early_max": early, "max": top, "last": last}
        keys[name]["cap"] = caps.get(name)
        cap = caps.get(name)
        if cap is not None and last > early:  # a capped stream: bounded while it stays by its cap
            (capped if top < cap + GROWTH_SLACK else growing).append(name)
        elif cap is None and last > early * GROWTH_TOLERANCE + GROWTH_SLACK:
            growing.append(name)
    pairs = [(a, b) for a, b in itertools.pairwise(warm) if b["groups"] > a["groups"] and b["t"] > a["t"]]
    rates = [(b["groups"] - a["groups"]) / (b["t"] - a["t"]) for a, b in pairs]
    cpu = [(b["redis_cpu_s"] - a["redis_cpu_s"]) / (b["groups"] - a["groups"]) * 1e6 for a, b in pairs]
    part = max(1, len(rates) // 3)
    early_rate, late_rate = statistics.median(rates[:part]), statistics.median(rates[-part:])
    steady = late_rate >= STEADY * early_rate
    return {
        "ok": memory_ok and not growing and steady,
        "warm_from_groups": warm[0]["groups"],
        "memory_ok": memory_ok,
        "memory_first_third_bytes": first,
        "memory_last_third_over_first": memory_trend,
        "memory_min_warm_bytes": min(memory),
        "memory_max_warm_bytes": memory_max,
        "memory_last_bytes": memory[-1],
        "memory_max_over_first": memory_max / first,
        "growing_keys": growing,
        "growing_within_cap": capped,
        "keys": keys,
        "throughput_steady": steady,
        "groups_per_s_first_third": early_rate,
        "groups_per_s_last_third": late_rate,
        "groups_per_s_min": min(rates),
        "groups_per_s_max": max(rates),
        "redis_cpu_us_per_group": {
            "first_third": statistics.median(cpu[:part]),
            "last_third": statistics.median(cpu[-part:]),
        },
    }


def print_report(r: dict[str, Any]) -> None:
    v = r["verdict"]
    print()
    print(
        f"soak: {r['groups']:,} groups in {r['seconds']:.0f} s ({r['groups_per_s']:.0f}/s); load average "
        f"{r['load_average_before'][0]:.1f} before, {r['load_average_after'][0]:.1f} after"
    )
    if "memory_ok" not in v:
        print(f"verdict: not judged: {v['why']}")
        return
    mib = 2**20
    print(
        f"  memory   {'flat' if v['memory_ok'] else 'GROWS'}: after the warm-up ({v['warm_from_groups']:,} "
        f"groups) used_memory median {v['memory_first_third_bytes'] / mib:.2f} MiB in the first third, "
        f"x{v['memory_last_third_over_first']:.3f} in the last; min {v['memory_min_warm_bytes'] / mib:.2f}, "
        f"max {v['memory_max_warm_bytes'] / mib:.2f} (x{v['memory_max_over_first']:.3f}), "
        f"last {v['memory_last_bytes'] / mib:.2f}"
    )
    for name, k in v["keys"].items():
        if k["max"] > 0:
            mark = "GROWS" if name in v["growing_keys"] else ""
            mark = "grows, bounded by its cap" if name in v["growing_within_cap"] else mark
            mark += f" (cap {k['cap']:,})" if k["cap"] else ""
            print(f"    {name:<48} first {k['first']:>8,}  max {k['max']:>8,}  last {k['last']:>8,}  {mark}")
    growing = ", ".join(v["growing_keys"])
    print(f"  keys     {'growing: ' + growing if growing else 'none grows'}")
    cpu = v["redis_cpu_us_per_group"]
    print(
        f"  rate     {'steady' if v['throughput_steady'] else 'NOT steady'}: median groups/s "
        f"{v['groups_per_s_first_third']:.0f} (first third) -> {v['groups_per_s_last_third']:.0f} (last), "
        f"min {v['groups_per_s_min']:.0f} max {v['groups_per_s_max']:.0f}; Redis CPU per group "
        f"{cpu['first_third']:.0f} -> {cpu['last_third']:.0f} µs"
    )
    print(f"verdict: {'OK' if v['ok'] else 'FAILED'}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=float("inf"), help="stop after this long")
    parser.add_argument("--producers", type=int, default=2, help="producer processes")
    parser.add_argument("--sample-every", type=int, default=10_000, help="groups between samples")
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the groups before judging")
    parser.add_argument("--failure-rate", type=float, default=0.1, help="sim engines' failed requests")
    parser.add_argument("--dead-maxlen", type=int, default=1_000, help="buffer.dead_maxlen of the run")
    parser.add_argument("--filtered-maxlen", type=int, default=2_000, help="buffer.filtered_maxlen")
    parser.add_argument("--out", default=None, help="the JSON (default bench/results/soak.json)")
    parser.add_argument("--quick", action="store_true", help="20,000 groups, a sample every 1,000")
    parser.add_argument("--judge", default=None, help="no run: the verdict again from this soak JSON")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.sample_every = 20_000, 1_000
    return args


if __name__ == "__main__":
    main()
