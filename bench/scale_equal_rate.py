"""B4b — goal P7 asked of producers at equal rates: Redis CPU per group at a 64 x 64 fleet
against 2 producers, every producer engine-bound at the same rate, as on a GPU cluster.

P7 compares Redis CPU per group at 64 producers x 64 engines with 2 producers. In
``bench/scale.py`` both run as fast as this 2-core machine lets them: two producers at full
speed complete ~12 groups per round trip to Redis, 64 producers that share the cores 3-5,
so the comparison mixes what more producers cost with how far each producer batches. On a
GPU cluster every producer runs at the rate of its engines, whatever their number.

Here the sim engines are slowed (``--time-compression``) until every producer is
engine-bound, one engine per producer in both setups, so each producer runs at the same
rate (the table shows it), at one or more rates, the two setups interleaved. Besides Redis
CPU per group and its ratio, the table gives the round trips per group (scripts of claims,
touches and commits, settle gates, settle transactions, appends), 2 producers against the
fleet: what more producers would multiply. A caveat the figures carry: at 2 producers' few
groups/s Redis wakes up for nearly every command, and the trainer's and feeder's looks are
spread over few groups; both weigh on the 2-producer figure, not the fleet's.

    .venv/bin/python bench/scale_equal_rate.py                  # ~6 min on 2 cores
    .venv/bin/python bench/scale_equal_rate.py --quick          # ~1 min
"""

from __future__ import annotations

import argparse
from typing import Any

import scale
from common import RESULTS, table, write_json

from rollstream.shared.embedded import EmbeddedRedis


def measure(url: str, setup: str, compression: float, warmup_s: float, window_s: float) -> dict[str, Any]:
    scale.SETTINGS["engines"]["sim"]["time_compression"] = compression
    if setup == "2":
        r = scale.throughput(url, 2, warmup_s, window_s, 3)
        per_producer_engines = 1
        producers = 2
    else:
        producers, engines = (int(x) for x in setup.split("x"))
        fleet = (min(4, producers), producers, engines)  # as bench/scale.py runs a fleet
        r = scale.throughput(url, producers, warmup_s, window_s, 3, fleet=fleet)
        per_producer_engines = engines // producers
    cpu, busy = r["redis_cpu_ms_per_group"], r["redis_busy"]
    rate = busy / cpu * 1000 if cpu and busy else float("nan")  # groups/s over the same span as busy
    out = {
        "setup": setup,
        "time_compression": compression,
        "producers": producers,
        "engines_per_producer": per_producer_engines,
        "groups_per_s": rate,
        "groups_per_s_per_producer": rate / producers,
        "redis_busy": busy,
        "redis_cpu_ms_per_group": cpu,
        "redis_commands_per_group": r["redis_commands_per_group"],
    }
    print(
        f"  {setup:>6} at {compression:g}x: {rate:7.1f} groups/s ({rate / producers:.1f} a producer), "
        f"Redis busy {busy:.4f}, {cpu:.3f} ms/group",
        flush=True,
    )
    return out


# EVALSHA: claims, touches and the trainer's commits; EVAL: settle gates (and a few event
# scripts); EXEC: settle transactions; XADD: appends (groups, metrics)
ROUND_TRIPS = ("evalsha", "eval", "exec", "xadd")


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--fleet", default="64x64", help="PxE, one engine per producer")
    parser.add_argument("--time-compression", type=float, nargs="+", default=[0.2, 0.4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup_s, args.window_s, args.time_compression = 1, 2.0, 3.0, [0.4]
    setups = ["2", args.fleet]
    rates = ", ".join(f"{c:g}x" for c in args.time_compression)
    print(
        f"B4b Redis CPU per group at equal producer rates: 2 producers and {args.fleet}, one sim engine "
        f"per producer at {rates} (engine-bound), {args.repeats} repeat(s), interleaved"
    )
    runs: list[dict[str, Any]] = []
    with EmbeddedRedis() as server:
        scale.SERVER.append(server)
        for _ in range(args.repeats):
            for compression in args.time_compression:
                for setup in setups:
                    runs.append(measure(server.url, setup, compression, args.warmup_s, args.window_s))
    pairs = [
        (two, many)
        for two, many in zip(runs[0::2], runs[1::2], strict=True)
        if two["setup"] == "2" and many["setup"] == args.fleet
    ]
    ratios = [many["redis_cpu_ms_per_group"] / two["redis_cpu_ms_per_group"] for two, many in pairs]
    for two, many in pairs:
        apart = many["groups_per_s_per_producer"] / two["groups_per_s_per_producer"]
        if not 0.8 <= apart <= 1.25:
            print(
                f"  not at equal rates at {two['time_compression']:g}x: a producer of the fleet made "
                f"{apart:.2f}x the groups/s of one of 2 (CPU-bound?): a lower --time-compression"
            )
    rows = []
    for two, many in pairs:
        calls = []
        for name in ROUND_TRIPS:
            a = two["redis_commands_per_group"].get(name, [0.0, 0.0])
            b = many["redis_commands_per_group"].get(name, [0.0, 0.0])
            calls.append(f"{name} {a[0]:.2f}/{b[0]:.2f}")
        rows.append(
            [
                f"{two['time_compression']:g}x",
                f"{two['groups_per_s_per_producer']:.1f} / {many['groups_per_s_per_producer']:.1f}",
                f"{two['redis_cpu_ms_per_group']:.3f} / {many['redis_cpu_ms_per_group']:.3f}",
                f"{many['redis_cpu_ms_per_group'] / two['redis_cpu_ms_per_group']:.2f}",
                ", ".join(calls),
            ]
        )
    print()
    headers = [
        "engines at",
        f"groups/s a producer (2 / {args.fleet})",
        "Redis CPU ms/group",
        "x of 2 (P7)",
        "calls per group (2 / fleet)",
    ]
    print(table(headers, rows))
    result: dict[str, Any] = {
        "runs": runs,
        "fleet": args.fleet,
        "cpu_per_group_vs_2": ratios,
        "cpu_per_group_vs_2_max": max(ratios),
    }
    shown = " ".join(f"{r:.2f}" for r in ratios)
    print(f"P7 at equal producer rates: Redis CPU per group {args.fleet} / 2 = {shown}")
    write_json(result, RESULTS / "scale_equal_rate.json")
    return result


if __name__ == "__main__":
    main()
