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
  fleet      --fleet 16x16 64x64: a simulated fleet of P producers x E sim engines, as
             --fleet-processes processes (bench/scale_fleet.py), each running P/n real
             Producers (own consumer name, connection, liveness key, heartbeat thread and
             event follower) in one event loop on a shared pool of E/n sim engines; the
             same figures as above, with the 2-producer figure of the same run as the
             base, plus Redis busy (its CPU seconds per second) and the p99 of the
             event-to-live weight sync (the weight-sync event's id, Redis' clock, to each
             producer's status written at once after it moved, Redis' clock too)
  long run   until --groups groups are trained or --seconds pass; INFO used_memory
             each second; memory_growth = last / first sample after the warm-up

    .venv/bin/python bench/scale.py               # ~3 min on 2 cores
    .venv/bin/python bench/scale.py --quick       # ~40 s
    .venv/bin/python bench/scale.py --producers 2 --fleet 8x8 64x64 --long-producers 0
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    REPO,
    RESULTS,
    Producers,
    producer_env,
    pyplot,
    save_figure,
    show,
    spread,
    table,
    used_memory,
    write_json,
)

from rollstream.consumer.assembly import create_trainer
from rollstream.consumer.trainer import StepLog
from rollstream.producer.feeder import Feeder
from rollstream.recipes.prompts import example_prompts
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import WEIGHT_SYNC, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings
from rollstream.shared.streams import text

BATCH = 64
N = 2
INTERVAL = 100  # train steps between weight syncs
PROMPT_ROWS = 10_000
KEEP_AHEAD = 2_000
FLEET_POLL_S: list[float] = []  # --fleet-poll-s: a diagnosis of the fleet's idle polls
SERVER: list[EmbeddedRedis] = []  # the run's redis-server, which the watchdog stops before it exits
IDLE_S = 3.0  # the producers' Redis CPU with no work, measured this long before feeding
SETTINGS: dict[str, Any] = {
    "tasks": [{"name": "math", "n": N}],
    "engines": {"sim": {"median_tokens": 32, "time_compression": 1000}},
    "rollout": {"mode": "async", "batch_size": BATCH, "max_staleness": 1, "sync_weights_interval": INTERVAL},
    "producer": {"max_tokens": 128, "max_inflight": 64, "is_valid": "keep_all"},
}


def main() -> dict[str, Any]:
    args = parse_args()
    SETTINGS["rollout"]["sync_weights_interval"] = args.sync_interval
    SETTINGS["engines"]["sim"]["time_compression"] = args.time_compression
    if args.fleet_poll_s is not None:
        FLEET_POLL_S.append(args.fleet_poll_s)
    print(
        f"B4 scale: groups of n={N} (lengths median 32, cap 128), sim engines at {args.time_compression:g}x, "
        f"batches of {BATCH}, "
        f"weight sync every {args.sync_interval} steps; feeder keeps {KEEP_AHEAD} prompts ahead"
    )
    with EmbeddedRedis() as server:
        SERVER.append(server)
        if args.pin_redis:
            pin_redis(server)
        scaling = {}
        for count in args.producers:
            scaling[str(count)] = throughput(
                server.url, count, args.warmup_s, args.window_s, args.windows, args.engines_per_producer
            )
            print(
                f"  {count} producer(s): {show(scaling[str(count)]['groups_per_s'], '.0f')} groups/s"
                f"{_commands(scaling[str(count)])}",
                flush=True,
            )
        for spec in args.fleet:
            producers, engines = (int(x) for x in spec.lower().split("x"))
            fleet = (min(args.fleet_processes, producers), producers, engines)
            scaling[spec] = throughput(
                server.url, producers, args.warmup_s, args.window_s, args.windows, fleet=fleet
            )
            rate = show(scaling[spec]["groups_per_s"], ".0f")
            print(f"  fleet {spec}: {rate} groups/s{_commands(scaling[spec])}", flush=True)
        if args.long_producers > 0:
            long = long_run(server.url, args.long_producers, args.groups, args.seconds)
        else:
            long = {}
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
    commands: list[dict[str, tuple[int, int]]] = field(default_factory=list)  # with each cpu sample
    sync_s: list[float] = field(default_factory=list)  # event-to-live of each producer at each sync
    idle_cpu_per_s: float | None = None  # Redis CPU s/s with every producer up and no prompts yet


def run_settings(url: str, name: str) -> Settings:
    return load_settings(run=name, redis={"url": url}, **SETTINGS)


def redis_cpu_s(client: Any) -> float:
    """CPU seconds the Redis server has used (INFO cpu: user + sys, main thread and children)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def command_stats(client: Any) -> dict[str, tuple[int, int]]:
    """INFO commandstats: (calls, usec) per command (scripts count as EVALSHA / FCALL)."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


def commands_per_group(
    first: dict[str, tuple[int, int]], last: dict[str, tuple[int, int]], groups: int, top: int = 16
) -> dict[str, list[float]]:
    """The commands that cost Redis most between two samples: [calls, usec] per group."""
    delta = {k: (c - first.get(k, (0, 0))[0], u - first.get(k, (0, 0))[1]) for k, (c, u) in last.items()}
    ranked = sorted(delta.items(), key=lambda kv: -kv[1][1])[:top]
    return {k: [round(c / groups, 3), round(u / groups, 2)] for k, (c, u) in ranked if c > 0}


def env_of(settings: Settings, engines: int = 1) -> dict[str, str]:
    return producer_env(
        settings.redis.url,
        settings.run,
        tasks='[{"name": "math", "n": 2}]',
        engines__sim__median_tokens="32",
        engines__sim__time_compression=str(SETTINGS["engines"]["sim"]["time_compression"]),
        rollout__mode="async",
        rollout__batch_size=str(BATCH),
        rollout__max_staleness="1",
        rollout__sync_weights_interval=str(SETTINGS["rollout"]["sync_weights_interval"]),
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
    fleet: tuple[int, int, int] | None = None,
) -> Trace:
    """Producers + feeder + trainer until ``seconds`` pass or ``max_groups`` are trained;
    ``fleet`` = (processes, producers, engines): a simulated fleet instead of producer
    processes (bench/scale_fleet.py)."""
    settings = run_settings(url, name)
    client = connect(settings.redis)
    client.flushdb()
    trace = Trace()
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        path = example_prompts(Path(tmp) / "prompts.jsonl", PROMPT_ROWS)
        epochs = max_groups // PROMPT_ROWS + 2
        feeder = Feeder(
            open_buffer(client, settings, "feeder"), path, "math", epochs=epochs, keep_ahead=KEEP_AHEAD
        )
        feeding = threading.Thread(target=feeder.run, args=(stop,), daemon=True)
        trainer = create_trainer(settings, client=client, step_time_s=0.0, consumer="b4-trainer")
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
                trace.commands.append(command_stats(memory_client))
                next_sample = now + memory_every_s
            if now >= deadline:
                stop.set()

        launched = (
            Producers(producers, env_of(settings, engines)) if fleet is None else Fleet(*fleet, settings)
        )
        syncs = threading.Thread(target=watch_syncs, args=(settings, stop, trace.sync_s), daemon=True)
        syncs.start()
        with launched as procs:
            watchdog = threading.Thread(target=_watch, args=(procs, stop), daemon=True)
            watchdog.start()
            trace.idle_cpu_per_s = idle_cpu(
                memory_client, RunControl(client, Keys(settings.run)), producers, stop
            )
            feeding.start()
            trainer.run(-(-max_groups // BATCH), on_step, stop)
            stop.set()
        syncs.join(timeout=10)
        feeding.join(timeout=10)
        memory_client.close()
    client.close()
    return trace


class Fleet:
    """A simulated fleet: ``processes`` processes of bench/scale_fleet.py that run
    ``producers`` producers on ``engines`` sim engines between them (as evenly as they
    divide); stdout dropped, stderr kept in a temporary file."""

    def __init__(self, processes: int, producers: int, engines: int, settings: Settings) -> None:
        self.logs = [tempfile.TemporaryFile() for _ in range(processes)]  # noqa: SIM115 - closed in stop()
        self.processes = []
        for i, log in enumerate(self.logs):
            mine = producers // processes + (i < producers % processes)
            own_engines = max(1, engines // processes + (i < engines % processes))
            env = env_of(settings, own_engines)
            command = [
                sys.executable, str(REPO / "bench" / "scale_fleet.py"),
                "--producers", str(mine), "--engines", str(own_engines), "--name", f"fleet{i}",
                *(["--poll-s", str(FLEET_POLL_S[0])] if FLEET_POLL_S else []),
            ]  # fmt: skip
            self.processes.append(
                subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
            )

    def check(self) -> None:
        for process, log in zip(self.processes, self.logs, strict=True):
            if process.poll() is not None:
                log.seek(0)
                tail = log.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"fleet process pid {process.pid} exited {process.returncode}: {tail}")

    def stop(self, timeout_s: float = 30.0) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process, log in zip(self.processes, self.logs, strict=True):
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def idle_cpu(client: Any, control: RunControl, producers: int, stop: threading.Event) -> float | None:
    """Redis CPU seconds per second once every producer is up, before any prompt is fed:
    what the producers' heartbeats, event followers and admission polls cost by themselves."""
    deadline = time.monotonic() + 120.0
    while len(control.producers(3600.0)) < producers:
        if stop.is_set() or time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    time.sleep(1.0)
    before, started = redis_cpu_s(client), time.monotonic()
    time.sleep(IDLE_S)
    return (redis_cpu_s(client) - before) / (time.monotonic() - started)


def watch_syncs(settings: Settings, stop: threading.Event, out: list[float]) -> None:
    """Event-to-live of every weight sync, per producer: from the weight-sync event (its
    stream id: Redis' clock, in ms) to the producer's status that says it runs the new step
    (written at once after it moved; its ts from Redis' clock too). Looks at the run's
    model step every 50 ms, then at the statuses every 2 ms until every producer moved."""
    client = connect(settings.redis)
    keys = Keys(settings.run)
    control = RunControl(client, keys)
    known = control.model_step()
    while not stop.wait(0.05):
        step = control.model_step()
        if step <= known:
            continue
        known = step
        published = None
        entries: list[Any] = client.xrevrange(keys.events, count=50) or []
        for entry_id, fields in entries:
            if (
                fields.get(b"type") == WEIGHT_SYNC.encode()
                and fields.get(b"model_step") == str(step).encode()
            ):
                published = int(text(entry_id).partition("-")[0]) / 1000
                break
        if published is None:
            continue
        moved: set[str] = set()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and not stop.is_set():
            statuses = control.producers(3600.0)
            for s in statuses:
                if s.producer not in moved and s.model_step >= step:
                    moved.add(s.producer)
                    out.append(s.ts - published)
            if len(moved) >= len(statuses):
                break
            time.sleep(0.002)
    client.close()


def _watch(procs: Producers | Fleet, stop: threading.Event) -> None:
    """A producer that dies stops the run (the trainer would wait for its batch forever),
    the other producers and the Redis server with it (by their handles: nothing else)."""
    while not stop.wait(1.0):
        try:
            procs.check()
        except RuntimeError as exc:
            print(exc, flush=True)
            procs.stop(timeout_s=5.0)
            for server in SERVER:
                server.stop()
            os._exit(1)


def throughput(
    url: str,
    producers: int,
    warmup_s: float,
    window_s: float,
    windows: int,
    engines: int = 1,
    fleet: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    name = f"b4-scale-{producers}" if fleet is None else f"b4-fleet-{producers}x{fleet[2]}"
    trace = run(url, name, producers, warmup_s + window_s * windows, 10**9, 0.5, engines, fleet)
    start = next(t for t, _ in trace.steps if t >= trace.steps[0][0] + warmup_s)
    rates = []
    for i in range(windows):
        a, b = start + i * window_s, start + (i + 1) * window_s
        inside = [(t, g) for t, g in trace.steps if a <= t <= b]
        if len(inside) >= 2:
            rates.append((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]))
    first = next((i for i, c in enumerate(trace.cpu) if c[0] >= start), len(trace.cpu))
    measured = trace.cpu[first:]
    cpu_per_group = busy = None
    commands: dict[str, list[float]] = {}
    if len(measured) >= 2 and measured[-1][1] > measured[0][1]:
        cpu_per_group = (measured[-1][2] - measured[0][2]) / (measured[-1][1] - measured[0][1])
        busy = (measured[-1][2] - measured[0][2]) / (measured[-1][0] - measured[0][0])
        commands = commands_per_group(
            trace.commands[first], trace.commands[-1], measured[-1][1] - measured[0][1]
        )
    syncs = sorted(trace.sync_s)
    return {
        "producers": producers,
        "engines": producers * engines if fleet is None else fleet[2],
        "processes": producers if fleet is None else fleet[0],
        "groups_per_s": spread(rates),
        "groups": trace.steps[-1][1],
        "redis_cpu_ms_per_group": None if cpu_per_group is None else cpu_per_group * 1000,
        # Redis CPU seconds per second over the windows: 1.0 is one core saturated; idle: the
        # same with every producer up and nothing fed yet (heartbeats, followers, polls)
        "redis_busy": busy,
        "redis_idle_busy": trace.idle_cpu_per_s,
        # where that CPU went: the costliest commands, [calls, usec] per group (INFO commandstats)
        "redis_commands_per_group": commands,
        "sync_event_to_live_ms": {
            "n": len(syncs),
            "p50": 1000 * syncs[len(syncs) // 2] if syncs else None,
            "p99": 1000 * syncs[min(len(syncs) - 1, int(0.99 * len(syncs)))] if syncs else None,
            "max": 1000 * syncs[-1] if syncs else None,
        },
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
    out = {
        "groups_per_s": {k: v["groups_per_s"]["median"] for k, v in scaling.items()},
        "speedup_over_1": {k: v["groups_per_s"]["median"] / one for k, v in scaling.items()} if one else {},
        "redis_cpu_ms_per_group": cpu,
        "redis_cpu_per_group_vs_2": {k: v / two for k, v in cpu.items() if v is not None} if two else {},
        "redis_busy": {k: v["redis_busy"] for k, v in scaling.items()},
        "redis_idle_busy": {k: v["redis_idle_busy"] for k, v in scaling.items()},
        "sync_event_to_live_p99_ms": {k: v["sync_event_to_live_ms"]["p99"] for k, v in scaling.items()},
    }
    if long:
        out |= {
            "memory_growth": long["memory_growth"],
            "memory_first_bytes": long["memory_first_bytes"],
            "memory_last_bytes": long["memory_last_bytes"],
            "long_run_groups": long["groups"],
        }
    return out


def print_table(r: dict[str, Any]) -> None:
    rows = [
        [
            k,
            str(v.get("engines", k)),
            str(v.get("processes", k)),
            show(v["groups_per_s"], ".0f"),
            f"{r['speedup_over_1'].get(k, float('nan')):.2f}",
            "-" if v.get("redis_cpu_ms_per_group") is None else f"{v['redis_cpu_ms_per_group']:.3f}",
            f"{r['redis_cpu_per_group_vs_2'].get(k, float('nan')):.2f}",
            "-" if v.get("redis_busy") is None else f"{v['redis_busy']:.3f}",
            "-" if v.get("redis_idle_busy") is None else f"{v['redis_idle_busy']:.3f}",
            _ms(v.get("sync_event_to_live_ms", {})),
        ]
        for k, v in r["scaling"].items()
    ]
    headers = [
        "producers",
        "engines",
        "processes",
        "groups/s median [min..max]",
        "x over 1",
        "Redis CPU ms/group",
        "x of 2",
        "Redis busy",
        "idle",
        "sync p50/p99 ms (n)",
    ]
    print(table(headers, rows))
    lr = r["long_run"]
    if not lr:
        return
    print(
        f"long run: {lr['groups']:,} groups in {lr['seconds']:.0f} s ({lr['groups_per_s']:.0f}/s, target "
        f"{lr['target_groups']:,}); used_memory {lr['memory_first_bytes'] / 2**20:.2f} MiB -> "
        f"{lr['memory_last_bytes'] / 2**20:.2f} MiB (max {lr['memory_max_bytes'] / 2**20:.2f}), "
        f"growth x{lr['memory_growth']:.3f}"
    )


def _commands(r: dict[str, Any]) -> str:
    costliest = r.get("redis_commands_per_group") or {}
    return "; Redis per group: " + ", ".join(
        f"{k} {calls:.2f}x {usec:.0f} us" for k, (calls, usec) in list(costliest.items())[:6]
    )


def _ms(sync: dict[str, Any]) -> str:
    if not sync or not sync.get("n"):
        return "-"
    return f"{sync['p50']:.0f}/{sync['p99']:.0f} ({sync['n']})"


def plot(r: dict[str, Any], path: Any) -> None:
    plt = pyplot()
    samples = r["long_run"].get("memory_samples", [])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot([s[1] for s in samples], [s[2] / 2**20 for s in samples], ".-")
    left.set_xlabel("groups trained")
    left.set_ylabel("Redis used_memory (MiB)")
    left.set_ylim(bottom=0)
    left.set_title(f"long run: {r['long_run'].get('groups', 0):,} groups")
    counts = list(r["scaling"])
    medians = [r["scaling"][k]["groups_per_s"]["median"] for k in counts]
    errors = [
        [m - r["scaling"][k]["groups_per_s"]["min"] for k, m in zip(counts, medians, strict=True)],
        [r["scaling"][k]["groups_per_s"]["max"] - m for k, m in zip(counts, medians, strict=True)],
    ]
    right.bar(counts, medians, yerr=errors, capsize=4)
    right.set_xlabel("producer processes (PxE: a simulated fleet)")
    right.set_ylabel("groups/s")
    right.set_title("scaling (2-core machine)")
    fig.suptitle("B4: scale and memory")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def pin_redis(server: EmbeddedRedis) -> None:
    """redis-server on the last CPU alone, this process and every process it starts on the
    others: Redis' CPU per group then is what its own work costs, as on a machine of its
    own, not what it loses to the producers on the same cores (every command's time grew
    1.5-2x at 64 x 64 on 2 shared cores, XADD's as much as the scripts')."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or server.pid is None:
        raise SystemExit("--pin-redis needs 2 CPUs or more")
    os.sched_setaffinity(server.pid, {cpus[-1]})
    os.sched_setaffinity(0, set(cpus[:-1]))
    print(f"  redis-server on CPU {cpus[-1]}, producers, feeder and trainer on CPU {cpus[:-1]}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--window-s", type=float, default=4.0)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument(
        "--engines-per-producer", type=int, default=1, help="sim engines in each producer (engines.count)"
    )
    parser.add_argument(
        "--fleet", nargs="*", default=[], help="simulated fleets, PxE: P producers on E sim engines (64x64)"
    )
    parser.add_argument("--fleet-processes", type=int, default=4, help="processes a fleet runs in")
    parser.add_argument(
        "--fleet-poll-s",
        type=float,
        default=None,
        help="diagnosis: the fleet producers' POLL_S (0.05), where idle looks back off from",
    )
    parser.add_argument(
        "--sync-interval", type=int, default=INTERVAL, help="train steps between weight syncs"
    )
    parser.add_argument(
        "--time-compression",
        type=float,
        default=1000.0,
        help="the sim engines' (1000: every producer CPU-bound; ~0.5: engine-bound, each producer "
        "at the same rate, as on a GPU cluster, where P7 compares what a producer costs Redis)",
    )
    parser.add_argument("--long-producers", type=int, default=2, help="0: no long run")
    parser.add_argument("--groups", type=int, default=200_000, help="long run: groups to train")
    parser.add_argument("--seconds", type=float, default=120.0, help="long run: at most this long")
    parser.add_argument(
        "--pin-redis", action="store_true", help="redis-server on a CPU of its own, the rest on the others"
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.warmup_s, args.window_s, args.groups, args.seconds = 2.0, 2.0, 20_000, 20.0
    return args


if __name__ == "__main__":
    main()
