"""B4 — scale: groups/s with 1, 2 and 4 producer processes, and a long run of many small
groups with Redis memory sampled throughout.

Producers are ``rollstream produce --local-engines`` processes (one sim engine inside
each, compressed so far that generation is nearly instant: what is measured is the
producer and Redis side). Groups are small: n=2, lognormal lengths (median 32, sigma 1,
capped at 128). This process is the trainer: the reference trainer with no step time
reads batches of 64, commits them (ack + delete) and publishes weights every 100 steps;
prompts come from the feeder (producer/feeder.py), which keeps ~2,000 unclaimed prompts
in the stream, so nothing grows with the length of the run unless the library leaks.

  scaling    per producer count: warm-up, then 3 windows; groups/s median [min..max], and
             Redis CPU per group (INFO cpu, user + sys, over the windows) with its ratio to
             the 2-producer figure (goal P7: within 1.2x as producers and engines grow;
             --producers 2 8 16 --engines-per-producer 4 is 64 sim engines; on this 2-core
             machine the producers' own CPU, not Redis, bounds how far that goes)
  long run   until --groups groups are trained or --seconds pass; INFO used_memory
             each second; memory_growth = last / first sample after the warm-up

    .venv/bin/python bench/scale.py               # ~3 min on 2 cores
    .venv/bin/python bench/scale.py --quick       # ~40 s
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import RESULTS, Producers, producer_env, pyplot, show, spread, table, used_memory, write_json

from rollstream.consumer.trainer import ReferenceTrainer, StepLog
from rollstream.producer.feeder import Feeder
from rollstream.recipes.prompts import example_prompts
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.settings import Settings, load_settings

BATCH = 64
N = 2
INTERVAL = 100  # train steps between weight syncs
PROMPT_ROWS = 10_000
KEEP_AHEAD = 2_000
SETTINGS: dict[str, Any] = {
    "tasks": [{"name": "math", "n": N}],
    "engines": {"sim": {"median_tokens": 32, "time_compression": 1000}},
    "rollout": {"mode": "async", "batch_size": BATCH, "max_staleness": 1, "sync_weights_interval": INTERVAL},
    "producer": {"max_tokens": 128, "max_inflight": 64, "is_valid": "keep_all"},
}


def main() -> dict[str, Any]:
    args = parse_args()
    print(
        f"B4 scale: groups of n={N} (lengths median 32, cap 128), sim engines at 1000x, batches of {BATCH}, "
        f"weight sync every {INTERVAL} steps; feeder keeps {KEEP_AHEAD} prompts ahead"
    )
    with EmbeddedRedis() as server:
        scaling = {}
        for count in args.producers:
            scaling[str(count)] = throughput(
                server.url, count, args.warmup_s, args.window_s, args.windows, args.engines_per_producer
            )
            print(
                f"  {count} producer(s): {show(scaling[str(count)]['groups_per_s'], '.0f')} groups/s",
                flush=True,
            )
        long = long_run(server.url, args.long_producers, args.groups, args.seconds)
    result = {"scaling": scaling, "long_run": long} | headline(scaling, long)
    print()
    print_table(result)
    plot(result, RESULTS / "scale_memory.png")
    write_json(result, RESULTS / "scale.json")
    return result


# --- a run: producers, the feeder, the trainer ----------------------------------------


@dataclass(slots=True)
class Trace:
    """What the trainer saw: (time, groups so far) per step, memory samples."""

    steps: list[tuple[float, int]] = field(default_factory=list)
    memory: list[tuple[float, int, int]] = field(default_factory=list)  # time, groups, used_memory
    cpu: list[tuple[float, int, float]] = field(default_factory=list)  # time, groups, Redis CPU seconds


def run_settings(url: str, name: str) -> Settings:
    return load_settings(run=name, redis={"url": url}, **SETTINGS)


def redis_cpu_s(client: Any) -> float:
    """CPU seconds the Redis server has used (INFO cpu: user + sys, main thread and children)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def env_of(settings: Settings, engines: int = 1) -> dict[str, str]:
    return producer_env(
        settings.redis.url,
        settings.run,
        tasks='[{"name": "math", "n": 2}]',
        engines__sim__median_tokens="32",
        engines__sim__time_compression="1000",
        rollout__mode="async",
        rollout__batch_size=str(BATCH),
        rollout__max_staleness="1",
        rollout__sync_weights_interval=str(INTERVAL),
        producer__max_tokens="128",
        producer__max_inflight="64",
        producer__is_valid="keep_all",
        engines__count=str(engines),
    )


def run(
    url: str,
    name: str,
    producers: int,
    seconds: float,
    max_groups: int,
    memory_every_s: float,
    engines: int = 1,
) -> Trace:
    """Producers + feeder + trainer until ``seconds`` pass or ``max_groups`` are trained."""
    settings = run_settings(url, name)
    client = connect(settings.redis)
    client.flushdb()
    trace = Trace()
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        path = example_prompts(Path(tmp) / "prompts.jsonl", PROMPT_ROWS)
        epochs = max_groups // PROMPT_ROWS + 2
        feeder = Feeder(
            ReplayBuffer(client, settings, "feeder"), path, "math", epochs=epochs, keep_ahead=KEEP_AHEAD
        )
        feeding = threading.Thread(target=feeder.run, args=(stop,), daemon=True)
        feeding.start()
        trainer = ReferenceTrainer(client, settings, step_time_s=0.0, consumer="b4-trainer")
        memory_client = connect(settings.redis)
        groups = 0
        next_sample = 0.0
        deadline = float("inf")  # counted from the first step: producers take seconds to start

        def on_step(entry: StepLog) -> None:
            nonlocal groups, next_sample, deadline
            now = time.monotonic()
            if not trace.steps:
                deadline = now + seconds
            groups += entry.groups
            trace.steps.append((now, groups))
            if now >= next_sample:
                trace.memory.append((now, groups, used_memory(memory_client)))
                trace.cpu.append((now, groups, redis_cpu_s(memory_client)))
                next_sample = now + memory_every_s
            if now >= deadline:
                stop.set()

        with Producers(producers, env_of(settings, engines)) as procs:
            watchdog = threading.Thread(target=_watch, args=(procs, stop), daemon=True)
            watchdog.start()
            trainer.run(-(-max_groups // BATCH), on_step, stop)
            stop.set()
        feeding.join(timeout=10)
        memory_client.close()
    client.close()
    return trace


def _watch(procs: Producers, stop: threading.Event) -> None:
    """A producer that dies stops the run (the trainer would wait for its batch forever)."""
    while not stop.wait(1.0):
        try:
            procs.check()
        except RuntimeError as exc:
            print(exc, flush=True)
            os._exit(1)


def throughput(
    url: str, producers: int, warmup_s: float, window_s: float, windows: int, engines: int = 1
) -> dict[str, Any]:
    trace = run(url, f"b4-scale-{producers}", producers, warmup_s + window_s * windows, 10**9, 0.5, engines)
    start = next(t for t, _ in trace.steps if t >= trace.steps[0][0] + warmup_s)
    rates = []
    for i in range(windows):
        a, b = start + i * window_s, start + (i + 1) * window_s
        inside = [(t, g) for t, g in trace.steps if a <= t <= b]
        if len(inside) >= 2:
            rates.append((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]))
    measured = [c for c in trace.cpu if c[0] >= start]
    cpu_per_group = None
    if len(measured) >= 2 and measured[-1][1] > measured[0][1]:
        cpu_per_group = (measured[-1][2] - measured[0][2]) / (measured[-1][1] - measured[0][1])
    return {
        "producers": producers,
        "engines": producers * engines,
        "groups_per_s": spread(rates),
        "groups": trace.steps[-1][1],
        "redis_cpu_ms_per_group": None if cpu_per_group is None else cpu_per_group * 1000,
    }


def long_run(url: str, producers: int, groups: int, seconds: float) -> dict[str, Any]:
    print(f"  long run: {producers} producers, up to {groups:,} groups or {seconds:g} s ...", flush=True)
    trace = run(url, "b4-long", producers, seconds, groups, 1.0)
    t0 = trace.steps[0][0]
    done = trace.steps[-1][1]
    elapsed = trace.steps[-1][0] - t0
    warm = [m for m in trace.memory if m[0] - t0 >= min(10.0, elapsed / 10)] or trace.memory[-1:]
    first, last = warm[0], trace.memory[-1]
    return {
        "producers": producers,
        "groups": done,
        "target_groups": groups,
        "seconds": elapsed,
        "groups_per_s": done / elapsed,
        "memory_first_bytes": first[2],
        "memory_last_bytes": last[2],
        "memory_max_bytes": max(m[2] for m in warm),
        "memory_growth": last[2] / first[2],
        "memory_samples": [[round(t - t0, 2), g, m] for t, g, m in trace.memory],
    }


def headline(scaling: dict[str, Any], long: dict[str, Any]) -> dict[str, Any]:
    one = scaling.get("1", {}).get("groups_per_s", {}).get("median")
    two = scaling.get("2", {}).get("redis_cpu_ms_per_group")
    cpu = {k: v["redis_cpu_ms_per_group"] for k, v in scaling.items()}
    return {
        "groups_per_s": {k: v["groups_per_s"]["median"] for k, v in scaling.items()},
        "speedup_over_1": {k: v["groups_per_s"]["median"] / one for k, v in scaling.items()} if one else {},
        "redis_cpu_ms_per_group": cpu,
        "redis_cpu_per_group_vs_2": {k: v / two for k, v in cpu.items() if v is not None} if two else {},
        "memory_growth": long["memory_growth"],
        "memory_first_bytes": long["memory_first_bytes"],
        "memory_last_bytes": long["memory_last_bytes"],
        "long_run_groups": long["groups"],
    }


def print_table(r: dict[str, Any]) -> None:
    rows = [
        [
            k,
            str(v.get("engines", k)),
            show(v["groups_per_s"], ".0f"),
            f"{r['speedup_over_1'].get(k, float('nan')):.2f}",
            "-" if v.get("redis_cpu_ms_per_group") is None else f"{v['redis_cpu_ms_per_group']:.3f}",
            f"{r['redis_cpu_per_group_vs_2'].get(k, float('nan')):.2f}",
        ]
        for k, v in r["scaling"].items()
    ]
    headers = [
        "producers",
        "engines",
        "groups/s median [min..max]",
        "x over 1",
        "Redis CPU ms/group",
        "x of 2",
    ]
    print(table(headers, rows))
    lr = r["long_run"]
    print(
        f"long run: {lr['groups']:,} groups in {lr['seconds']:.0f} s ({lr['groups_per_s']:.0f}/s, target "
        f"{lr['target_groups']:,}); used_memory {lr['memory_first_bytes'] / 2**20:.2f} MiB -> "
        f"{lr['memory_last_bytes'] / 2**20:.2f} MiB (max {lr['memory_max_bytes'] / 2**20:.2f}), "
        f"growth x{lr['memory_growth']:.3f}"
    )


def plot(r: dict[str, Any], path: Any) -> None:
    plt = pyplot()
    samples = r["long_run"]["memory_samples"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot([s[1] for s in samples], [s[2] / 2**20 for s in samples], ".-")
    left.set_xlabel("groups trained")
    left.set_ylabel("Redis used_memory (MiB)")
    left.set_ylim(bottom=0)
    left.set_title(f"long run: {r['long_run']['groups']:,} groups")
    counts = list(r["scaling"])
    medians = [r["scaling"][k]["groups_per_s"]["median"] for k in counts]
    errors = [
        [m - r["scaling"][k]["groups_per_s"]["min"] for k, m in zip(counts, medians, strict=True)],
        [r["scaling"][k]["groups_per_s"]["max"] - m for k, m in zip(counts, medians, strict=True)],
    ]
    right.bar(counts, medians, yerr=errors, capsize=4)
    right.set_xlabel("producer processes")
    right.set_ylabel("groups/s")
    right.set_title("scaling (2-core machine)")
    fig.suptitle("B4: scale and memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--window-s", type=float, default=4.0)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument(
        "--engines-per-producer", type=int, default=1, help="sim engines in each producer (engines.count)"
    )
    parser.add_argument("--long-producers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=200_000, help="long run: groups to train")
    parser.add_argument("--seconds", type=float, default=120.0, help="long run: at most this long")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.warmup_s, args.window_s, args.groups, args.seconds = 2.0, 2.0, 20_000, 20.0
    return args


if __name__ == "__main__":
    main()
