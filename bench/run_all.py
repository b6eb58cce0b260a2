"""Run every pipeline benchmark, one process each, then gather their headline ratios —
each with the numbers it is a ratio of — in bench/results/latest.json and print a table.

  buffer       bench/buffer.py: replay-buffer groups/s against raw Redis Streams
  pipeline     bench/pipeline.py (B2): async against sync and the engine-capacity bound
  weight_sync  bench/weight_sync.py (B3): publish -> all 4 producer processes on the step
  scale        bench/scale.py (B4): 1/2/4 producer processes, a simulated 64 x 64 fleet (Redis
               CPU per group against the 2-producer figure); memory over a long run
  scale_equal_rate bench/scale_equal_rate.py (B4b): the same ratio with every producer at the
               same engine-bound rate, as on a GPU cluster
  (soak)       bench/soak.py, `make soak`, not run here (a million groups, ~30+ min): its
               last soak.json is gathered when there is one
  summary      bench/summary.py: what the summary field of group entries costs
  learning     bench/learning.py: a model learns through rollstream; sync vs async steps and seconds
  learning_real bench/learning_real.py: smollm2-135m on arithmetic through rollstream (sync,
               async) and a plain loop: held-out accuracy before and after, steps to base + 20 points
  vllm_pipeline bench/vllm_pipeline.py (P5): rollstream on a vLLM engine against vLLM alone;
               the weight-sync time of each engine kind
  metrics_scrape bench/metrics_scrape.py: Redis time of one scrape of `rollstream metrics`,
               at 1 and 64 producers
  archive      bench/archive.py: what the rollout archive adds to a trainer's step (goal < 2 %)
  trl_rollstream bench/trl_rollstream.py: TRL's GRPOTrainer alone against TRL + rollstream on
               the reverse task: samples/s and wall seconds to the same reward

    .venv/bin/python bench/run_all.py            # ~26 min on 2 cores
    .venv/bin/python bench/run_all.py --quick    # ~2 min, smoke sizes
    .venv/bin/python bench/run_all.py --skip buffer scale
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from typing import Any

from common import REPO, RESULTS, read_json, show, spread, table, write_json

BENCHES: dict[str, list[str]] = {
    "buffer": ["--groups", "4000", "--repeats", "3"],
    "ray_queue": [],
    "pipeline": [],
    "weight_sync": [],
    # 1 / 2 / 4 producer processes, then a simulated fleet of 64 producers x 64 sim engines
    # (goal P7: Redis CPU per group within 1.2x of the 2-producer figure of the same run)
    "scale": ["--fleet", "64x64", "--window-s", "6"],
    # P7 with every producer engine-bound at the same rate, 2 producers against 64 x 64
    "scale_equal_rate": [],
    "durability": [],
    "summary": [],
    "learning": [],
    "learning_real": [],
    "vllm_pipeline": [],
    "metrics_scrape": [],
    "archive": [],
    "trl_rollstream": [],
    # the hf engine against generate and a bare loop; the weight transports against a memcpy
    "hf_decode": [],
    "weight_transports": ["--size", "small,0.5b", "--ray"],
}


def main() -> int:
    args = parse_args()
    seconds: dict[str, float] = {}
    failed = []
    for name, options in BENCHES.items():
        if name in args.skip or (args.only is not None and name not in args.only):
            continue
        command = [
            sys.executable,
            str(REPO / "bench" / f"{name}.py"),
            *(["--quick"] if args.quick else options),
        ]
        print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
        started = time.monotonic()
        if subprocess.run(command, cwd=REPO).returncode != 0:
            failed.append(name)
        seconds[name] = time.monotonic() - started
    latest = gather(seconds, quick=args.quick)
    write_json(latest, RESULTS / "latest.json")
    print()
    print(summary_table(latest))
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def gather(seconds: dict[str, float], *, quick: bool) -> dict[str, Any]:
    """The headline numbers of each benchmark's results JSON (the last run of each)."""
    out: dict[str, Any] = {"machine": platform.node(), "quick": quick, "seconds": seconds}
    if buffer := read_json(RESULTS / "buffer.json"):
        out["buffer"] = {
            "ratio_vs_raw": buffer["ratio_vs_raw"],
            "ours_groups_per_s": buffer["ours_groups_per_s"],
            "raw_groups_per_s": buffer["raw_groups_per_s"],
            "ratio_per_repeat": buffer.get("ratio_per_repeat"),
            "memory_overhead": buffer.get("memory_overhead", 0.0) - 1.0,
            "memory_per_group_bytes": buffer.get("memory_per_group_bytes"),
            "payload_bytes": buffer.get("payload_bytes"),
            "raw_memory_overhead": buffer["memory"]["raw"]["used_memory_per_group"] / buffer["payload_bytes"]
            - 1,
            # what rollstream adds to what Redis needs for the same bytes
            "memory_vs_raw": buffer["memory"]["ours"]["used_memory_per_group"]
            / buffer["memory"]["raw"]["used_memory_per_group"],
        }
        if ray_queue := read_json(RESULTS / "ray_queue.json"):
            faster = ray_queue["faster_groups_per_s"]
            out["buffer"]["ratio_vs_ray_queue"] = buffer["ours_groups_per_s"] / faster
            out["buffer"]["ray_queue_groups_per_s"] = faster
            out["buffer"]["ray_queue_way"] = ray_queue["faster"]
    if pipeline := read_json(RESULTS / "pipeline.json"):
        groups = sum(r["groups"] for r in pipeline["runs"])
        out["pipeline"] = {
            "async_over_bound": pipeline["async_over_bound"],
            "async_over_sync": pipeline["async_over_sync"],
            "async_over_bound_spread": pipeline["async_over_bound_spread"],
            "async_over_sync_spread": pipeline["async_over_sync_spread"],
            "async_tokens_over_capacity": pipeline.get("async_tokens_over_capacity"),
            "async_samples_per_s": pipeline["async_samples_per_s"]["median"],
            "sync_samples_per_s": pipeline["sync_samples_per_s"]["median"],
            "bound_samples_per_s": pipeline["bound_samples_per_s_measured"]["median"],
            "distribution_bound_samples_per_s": pipeline["bound_samples_per_s"],
            "async_over_distribution_bound": pipeline["async_over_distribution_bound"],
            "best_async": pipeline["best_async"],
            "best_sync": pipeline["best_sync"],
            "staleness_violations": pipeline["staleness_violations"],
            "groups_trained_measured": groups,
            "time_compression": pipeline["params"]["compression"],
        }
    if archive := read_json(RESULTS / "archive.json"):
        out["archive"] = {
            "step_overhead": archive["archive_step_overhead"],
            "train_ms": archive["train_ms"],
            "commit_us_per_group": {
                w: archive[w]["commit_us_per_group"]["median"] for w in ("plain", "archiving")
            },
        }
    if sync := read_json(RESULTS / "weight_sync.json"):
        out["weight_sync"] = {
            "p99_ms": sync["p99_ms"],
            "p50_ms": sync["p50_ms"],
            "syncs": sync["syncs"],
            "producers": sync["producers"],
            "heartbeat_s": sync["heartbeat_s"],
            "by_load": {
                k: {"p50_ms": v["p50_ms"], "p99_ms": v["p99_ms"]} for k, v in sync["scenarios"].items()
            },
        }
    if (scale := read_json(RESULTS / "scale.json")) and "memory_growth" in scale:  # a run with its long run
        out["scale"] = {
            "memory_growth": scale["memory_growth"],
            "memory_first_bytes": scale["memory_first_bytes"],
            "memory_last_bytes": scale["memory_last_bytes"],
            "long_run_groups": scale["long_run_groups"],
            "long_run_seconds": scale["long_run"]["seconds"],
            "groups_per_s": scale["groups_per_s"],
            "speedup_over_1": scale["speedup_over_1"],
            "redis_cpu_ms_per_group": scale.get("redis_cpu_ms_per_group"),
            "redis_cpu_per_group_vs_2": scale.get("redis_cpu_per_group_vs_2"),
            "redis_busy": scale.get("redis_busy"),
            "sync_event_to_live_p99_ms": scale.get("sync_event_to_live_p99_ms"),
        }
    if equal := read_json(RESULTS / "scale_equal_rate.json"):
        out["scale_equal_rate"] = {
            "fleet": equal["fleet"],
            "cpu_per_group_vs_2": equal["cpu_per_group_vs_2"],
            "cpu_per_group_vs_2_max": equal["cpu_per_group_vs_2_max"],
        }
    if soak := read_json(RESULTS / "soak.json"):
        v = soak["verdict"]
        out["soak"] = {
            "groups": soak["groups"],
            "seconds": soak["seconds"],
            "verdict_ok": v.get("ok"),
            "memory_last_third_over_first": v.get("memory_last_third_over_first"),
            "growing_keys": v.get("growing_keys"),
            "groups_per_s_first_third": v.get("groups_per_s_first_third"),
            "groups_per_s_last_third": v.get("groups_per_s_last_third"),
        }
    if summary := read_json(RESULTS / "summary.json"):
        out["summary"] = {
            name: summary[name]
            for name in (
                "hot_path_overhead",
                "summary_share_of_hot_path",
                "encode_overhead",
                "summary_share_of_encode",
                "bytes_overhead",
                "summary_chars_max",
            )
        }
        out["summary"]["hot_path_us"] = {k: v["hot_path_us"] for k, v in summary["shapes"].items()}
    if real := read_json(RESULTS / "learning_real.json"):
        out["learning_real"] = {
            "base_accuracy": real["base_accuracy"],
            "target": real["target"],
            "ways": {
                run["way"]: {"accuracy": run["curve"][-1][2] if run["curve"] else None, "steps": run["steps"]}
                for run in real["runs"]
            },
        }
    if learn := read_json(RESULTS / "learning.json"):
        out["learning"] = {
            "target": learn["target"],
            "seeds": len(learn["seeds"]),
            "sync_steps_over_reference": learn["sync_steps_over_reference"],
            "reference_steps": learn["reference"]["steps_to_target"],
            "recipes": {
                name: {
                    k: r[k]
                    for k in ("steps_to_target", "seconds_to_target", "steps_over_sync", "seconds_over_sync")
                    if k in r
                }
                | {"reached": r["reached"]}
                for name, r in learn["recipes"].items()
            },
        }
    if vllm := read_json(RESULTS / "vllm_pipeline.json"):
        out["vllm_pipeline"] = {
            "ratio": vllm["ratios"]["rollstream/alone"],
            "tokens_per_s": {k: v["median"] for k, v in vllm["tokens_per_s"].items()},
            "target": vllm["targets"]["ratio"],
            "sync_ms": vllm["sync_ms"],
        }
    if scrape := read_json(RESULTS / "metrics_scrape.json"):
        out["metrics_scrape"] = {
            "redis_us_per_scrape_64": scrape["redis_us_per_scrape_64"],
            "redis_us_per_scrape_1": scrape["by_producers"]["1"]["redis_us_per_scrape"],
            "commands_per_scrape": scrape["by_producers"]["64"]["commands_per_scrape"],
            "goal_us": scrape["goal_us"],
        }
    if trl := read_json(RESULTS / "trl_rollstream.json"):
        out["trl_rollstream"] = {
            "ratios": trl["ratios"],
            "target": trl["target"],
            "steps": trl["steps"],
            "ways": {
                run["way"]: {k: run[k] for k in ("samples_per_s", "wall_s", "seconds_to_target")}
                for run in trl["runs"]
            },
        }
    if durability := read_json(RESULTS / "durability.json"):
        out["durability"] = {
            "ratio_always_vs_everysec": durability["ratio_always_vs_everysec"],
            "groups_per_s": {k: v["median"] for k, v in durability["groups_per_s"].items()},
        }
    return out


def summary_table(r: dict[str, Any]) -> str:
    rows: list[list[Any]] = []

    def add(metric: str, value: str, of: str, target: str, met: bool | None) -> None:
        rows.append([metric, value, of, target, "-" if met is None else ("met" if met else "MISSED")])

    if b := r.get("buffer"):
        add(
            "buffer.ratio_vs_raw",
            show(spread([b["ratio_vs_raw"]]) | span(b["ratio_per_repeat"]), ".2f"),
            f"{b['ours_groups_per_s']:,.0f} / {b['raw_groups_per_s']:,.0f} groups/s (medians; "
            "the spread is of each repeat's pair)",
            ">= 0.8",
            b["ratio_vs_raw"] >= 0.8,
        )
        if "ratio_vs_ray_queue" in b:
            add(
                "buffer.ratio_vs_ray_queue",
                f"{b['ratio_vs_ray_queue']:.2f}",
                f"{b['ours_groups_per_s']:,.0f} / {b['ray_queue_groups_per_s']:,.0f} groups/s "
                f"({b['ray_queue_way']})",
                ">= 1.0",
                b["ratio_vs_ray_queue"] >= 1.0,
            )
        add(
            "buffer.memory_overhead",
            f"{b['memory_overhead']:+.0%}",
            f"{b['memory_per_group_bytes'] / 1024:,.1f} / {b['payload_bytes'] / 1024:,.1f} KiB - 1; "
            f"raw {b['raw_memory_overhead']:+.0%} (jemalloc size classes); "
            f"ours / raw {b['memory_vs_raw']:.3f}",
            "<= +5%",
            b["memory_overhead"] <= 0.05,
        )
    if p := r.get("pipeline"):
        add(
            "pipeline.async_over_bound",
            show(p["async_over_bound_spread"], ".2f"),
            f"{p['async_samples_per_s']:.2f} ({p['best_async']}) / {p['bound_samples_per_s']:.2f} samples/s "
            f"(E*T / their mean length); {p['async_over_distribution_bound']:.2f} of the distribution's "
            f"{p['distribution_bound_samples_per_s']:.2f}",
            ">= 0.95",
            p["async_over_bound"] >= 0.95,
        )
        add(
            "pipeline.async_over_sync",
            show(p["async_over_sync_spread"], ".2f"),
            f"{p['async_samples_per_s']:.2f} / {p['sync_samples_per_s']:.2f} ({p['best_sync']}) samples/s",
            ">= 2.5",
            p["async_over_sync"] >= 2.5,
        )
        add(
            "pipeline.staleness_violations",
            str(p["staleness_violations"]),
            f"of {p['groups_trained_measured']:,} groups trained (measured steps)",
            "0",
            p["staleness_violations"] == 0,
        )
    if a := r.get("archive"):
        add(
            "archive.step_overhead",
            f"{a['step_overhead']:+.2%}",
            f"a step of {a['train_ms']:.0f} ms training with `rollstream archive` running / without an "
            f"archive; commit {a['commit_us_per_group']['archiving']:.0f} / "
            f"{a['commit_us_per_group']['plain']:.0f} µs per group",
            "< 2%",
            a["step_overhead"] < 0.02,
        )
    if w := r.get("weight_sync"):
        add(
            "weight_sync.p99_ms",
            f"{w['p99_ms']:.1f}",
            f"{w['syncs']} syncs, {w['producers']} processes, heartbeat {w['heartbeat_s'] * 1000:g} ms; "
            + ", ".join(f"{k} p50/p99 {v['p50_ms']:.1f}/{v['p99_ms']:.1f}" for k, v in w["by_load"].items()),
            "<= 50",
            w["p99_ms"] <= 50,
        )
    if s := r.get("scale"):
        add(
            "scale.memory_growth",
            f"{s['memory_growth']:.3f}",
            f"{s['memory_last_bytes'] / 2**20:.2f} / {s['memory_first_bytes'] / 2**20:.2f} MiB over "
            f"{s['long_run_groups']:,} groups",
            "flat (~1)",
            None,
        )
        add(
            "scale.groups_per_s",
            " / ".join(f"{v:,.0f}" for v in s["groups_per_s"].values()),
            f"{' / '.join(s['groups_per_s'])} producer processes",
            "-",
            None,
        )
    if (s := r.get("scale")) and s.get("redis_cpu_per_group_vs_2"):
        ratios, cpu = s["redis_cpu_per_group_vs_2"], s["redis_cpu_ms_per_group"]
        for k in [k for k in ratios if "x" in k]:
            add(
                f"scale.redis_cpu_per_group {k} / 2 producers",
                f"{ratios[k]:.2f}",
                f"{cpu[k]:.3f} / {cpu['2']:.3f} ms; Redis busy {s['redis_busy'][k]:.2f} of a core",
                "<= 1.2",
                ratios[k] <= 1.2,
            )
    if s := r.get("scale_equal_rate"):
        add(
            f"scale.redis_cpu_per_group {s['fleet']} / 2 producers, equal producer rates",
            f"{s['cpu_per_group_vs_2_max']:.2f}",
            "the highest of " + " ".join(f"{v:.2f}" for v in s["cpu_per_group_vs_2"]),
            "<= 1.2",
            s["cpu_per_group_vs_2_max"] <= 1.2,
        )
    if s := r.get("soak"):
        add(
            "soak.memory (last / first third)",
            f"{s['memory_last_third_over_first']:.3f}",
            f"{s['groups']:,} groups in {s['seconds'] / 60:.0f} min; growing keys: "
            f"{', '.join(s['growing_keys']) or 'none'}; groups/s {s['groups_per_s_first_third']:.0f} -> "
            f"{s['groups_per_s_last_third']:.0f}",
            "<= 1.10, no key growing",
            bool(s["verdict_ok"]),
        )
    if s := r.get("metrics_scrape"):
        add(
            "metrics.redis_us_per_scrape",
            f"{s['redis_us_per_scrape_64']:.0f} µs",
            f"Redis time of one scrape of `rollstream metrics` at 64 producers "
            f"({s['redis_us_per_scrape_1']:.0f} µs at 1; {s['commands_per_scrape']:.0f} commands, "
            "one pipelined round trip)",
            f"< {s['goal_us']:.0f} µs",
            s["redis_us_per_scrape_64"] < s["goal_us"],
        )
    if d := r.get("durability"):
        add(
            "durability.always_vs_everysec",
            show(d["ratio_always_vs_everysec"]),
            " / ".join(f"{d['groups_per_s'][m]:,.0f}" for m in ("always", "everysec"))
            + " groups/s, appendfsync always / everysec",
            "-",
            None,
        )
    if m := r.get("summary"):
        add(
            "summary.hot_path_overhead",
            f"{m['hot_path_overhead']:+.1%}",
            "group entries with / without the summary field (buffer.summary, off by default), per "
            "group on the hot path (off: "
            + ", ".join(f"{k} {v['off']:,.0f} µs" for k, v in m["hot_path_us"].items())
            + f"); the summary's own time {m['summary_share_of_hot_path']:.1%} of it, "
            f"{m['summary_share_of_encode']:.0%} of encode; bytes {m['bytes_overhead']:+.2%}",
            "<= +3%",
            m["hot_path_overhead"] <= 0.03,
        )
    if learn := r.get("learning"):
        steps = {name: x["steps_to_target"] for name, x in learn["recipes"].items()}
        sync = learn["sync_steps_over_reference"]
        if sync["n"] and "sync" in steps:
            add(
                "learning.sync_steps_over_reference",
                show(sync, ".2f"),
                f"{show(steps['sync'], '.0f')} / {show(learn['reference_steps'], '.0f')} steps to mean "
                f"reward {learn['target']} ({learn['seeds']} seeds; reference: the model in a plain loop)",
                "<= 1.2",
                sync["median"] <= 1.2,
            )
        for name, x in learn["recipes"].items():
            corrected = name != "async"  # the uncorrected run is reported, with no target
            if x.get("steps_over_sync", {}).get("n"):
                add(
                    f"learning.{name}.steps_over_sync",
                    show(x["steps_over_sync"], ".2f"),
                    f"{show(steps[name], '.0f')} / {show(steps['sync'], '.0f')} steps ({x['reached']})",
                    "<= 1.2" if corrected else "-",
                    x["steps_over_sync"]["median"] <= 1.2 if corrected else None,
                )
            if x.get("seconds_over_sync", {}).get("n"):
                add(
                    f"learning.{name}.seconds_over_sync",
                    show(x["seconds_over_sync"], ".2f"),
                    f"{show(x['seconds_to_target'], '.1f')} / "
                    f"{show(learn['recipes']['sync']['seconds_to_target'], '.1f')} wall seconds",
                    "< 1" if corrected else "-",
                    x["seconds_over_sync"]["median"] < 1 if corrected else None,
                )
    if real := r.get("learning_real"):
        for way, x in real["ways"].items():
            if x["accuracy"] is not None:
                add(
                    f"learning_real.{way}.accuracy",
                    f"{x['accuracy']:.3f}",
                    f"held-out greedy accuracy after {x['steps']} steps (base {real['base_accuracy']:.3f})",
                    f">= {real['target']:.3f}",
                    x["accuracy"] >= real["target"],
                )
    if v := r.get("vllm_pipeline"):
        add(
            "vllm_pipeline.ratio (P5)",
            show(v["ratio"], ".2f"),
            "rollstream / vLLM alone, generated tokens/s, round pair by pair ("
            + " / ".join(f"{k} {x:,.0f}" for k, x in v["tokens_per_s"].items())
            + ")",
            f">= {v['target']}",
            v["ratio"]["median"] >= v["target"],
        )
        add(
            "vllm_pipeline.partial_sync_ms",
            " / ".join(
                f"{k} {s['reload_idle_s']:.0f}" for k, s in v["sync_ms"].items() if "reload_idle_s" in s
            ),
            "pause + reload + resume of one engine, idle (median ms per engine kind)",
            "-",
            None,
        )
    if t := r.get("trl_rollstream"):
        ways = t["ways"]
        for name, unit in (("samples_per_s", "samples/s"), ("seconds_to_target", "s to the target")):
            value = t["ratios"][name]
            if value is not None:
                add(
                    f"trl_rollstream.{name}",
                    f"{value:.2f}",
                    f"TRL + rollstream / TRL alone, {unit} ("
                    + " / ".join(f"{ways[w][name]:.1f}" for w in ("trl+rollstream", "trl"))
                    + f"; {t['steps']} steps, target {t['target']})",
                    "-",
                    None,
                )
    return table(["metric", "value", "ratio of", "target", ""], rows, left=5)


def span(values: list[float] | None) -> dict[str, float]:
    """min, max and how many of repeated ratios (none: nothing)."""
    return {"min": min(values), "max": max(values), "n": len(values)} if values else {}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark at its smoke size")
    parser.add_argument("--skip", nargs="*", default=[], choices=list(BENCHES), help="benchmarks not to run")
    parser.add_argument(
        "--only", nargs="*", default=None, choices=list(BENCHES),
        help="run only these benchmarks (none: run nothing, gather and print the results there are)",
    )  # fmt: skip
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
