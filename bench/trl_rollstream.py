"""TRL alone against TRL + rollstream: the same GRPOTrainer, model, task and steps.

The reverse task (rollstream.recipes.reverse: a 14k-parameter GPT-2, "c a m >" -> "m a c",
the reverse judge's partial reward, chance 0.06) trained by TRL's GRPOTrainer
(rollstream.recipes.trl_reverse), 8 prompts x 8 samples a step, Adam at 1e-3, two ways
side by side in one run, one after the other on the same machine:

  trl              TRL generates in its own process (transformers' generate on the model it
                   trains) and scores with the reverse reward
  trl+rollstream   TRL's rollout_func is rollstream's: each generation goes through Redis
                   streams to producers and hf engines in Ray actors, judged there, the
                   weights published to the engines after every step

Reported for each: samples trained per wall second, wall seconds (and steps) until the
mean reward of the last 10 steps reaches the target, and setup seconds (model; engines
up) apart from the training's. Seconds are from TRL's train begin. The ratios are
trl+rollstream over trl. On one 2-core machine the engines share the CPUs with TRL: the
figure says what rollstream costs a trainer where generation and training cannot
overlap, not what it gains on a cluster.

Writes trl_rollstream.json.

    .venv/bin/python bench/trl_rollstream.py             # 150 steps each, target 0.3
    .venv/bin/python bench/trl_rollstream.py --quick     # smoke: 4 steps each
    .venv/bin/python bench/trl_rollstream.py --steps 400 --target 0.9 --engines 2
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, table, write_json

from rollstream.recipes import trl_reverse
from rollstream.shared.embedded import EmbeddedRedis

WINDOW = 10


def main() -> int:
    args = parse_args()
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)  # TRL's process; each engine actor has its one CPU
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    logging.basicConfig(level=logging.WARNING)
    window = min(WINDOW, args.steps)
    runs: list[dict[str, Any]] = []
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        for way in ("trl", "trl+rollstream"):
            print(f"{way}: {args.steps} steps", flush=True)
            work = Path(tmp) / way.replace("+", "-")
            if way == "trl":
                run = trl_reverse.run_alone(work, args.steps, seed=args.seed)
            else:
                run = trl_reverse.run_with_rollstream(
                    server.url, work, args.steps, seed=args.seed, engines=args.engines
                )
            runs.append(run.summary(args.target, window))
            print(f"  {line(runs[-1])}", flush=True)
    report = analyse(runs, args, window)
    write_json(report, RESULTS / "trl_rollstream.json")
    print()
    print(summary_table(report))
    return 0


def line(summary: dict[str, Any]) -> str:
    seconds = summary["seconds_to_target"]
    reached = "not reached" if seconds is None else f"{summary['steps_to_target']} steps, {seconds:.1f} s"
    return (
        f"{summary['samples_per_s']:.1f} samples/s over {summary['wall_s']:.1f} s "
        f"(setup {summary['setup_s']:.1f} s); to the target: {reached}"
    )


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def analyse(runs: list[dict[str, Any]], args: argparse.Namespace, window: int) -> dict[str, Any]:
    alone, rollstream = runs
    return {
        "task": "reverse",
        "steps": args.steps,
        "target": args.target,
        "window": window,
        "engines": args.engines,
        "seed": args.seed,
        "quick": args.quick,
        "runs": runs,
        "ratios": {
            "samples_per_s": ratio(rollstream["samples_per_s"], alone["samples_per_s"]),
            "wall_s": ratio(rollstream["wall_s"], alone["wall_s"]),
            "seconds_to_target": ratio(rollstream["seconds_to_target"], alone["seconds_to_target"]),
        },
    }


def summary_table(report: dict[str, Any]) -> str:
    def fmt(value: float | None, spec: str = ".1f") -> str:
        return "-" if value is None else format(value, spec)

    def last(rewards: list[float]) -> float | None:
        recent = rewards[-report["window"] :]
        return sum(recent) / len(recent) if recent else None

    rows = [
        [
            r["way"], r["steps"], fmt(r["samples_per_s"]), fmt(r["wall_s"]), fmt(r["setup_s"]),
            fmt(r["seconds_to_target"]), r["steps_to_target"] if r["steps_to_target"] is not None else "-",
            fmt(last(r["reward_by_step"]), ".3f"),
        ]
        for r in report["runs"]
    ]  # fmt: skip
    ratios = report["ratios"]
    rows.append(
        [
            "rollstream / trl", "", fmt(ratios["samples_per_s"], ".2f"), fmt(ratios["wall_s"], ".2f"), "",
            fmt(ratios["seconds_to_target"], ".2f"), "", "",
        ]
    )  # fmt: skip
    headers = [
        "way",
        "steps",
        "samples/s",
        "wall s",
        "setup s",
        "s to target",
        "steps to target",
        "last reward",
    ]
    target = f"target: mean reward of the last {report['window']} steps >= {report['target']}"
    return f"TRL GRPOTrainer on the reverse task ({target})\n" + table(headers, rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="train steps of each way")
    parser.add_argument("--target", type=float, default=0.3, help="the mean reward the ways are timed to")
    parser.add_argument("--engines", type=int, default=1, help="hf engines (Ray actors, one CPU each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke size: 4 steps each")
    args = parser.parse_args()
    if args.quick:
        args.steps = 4
    return args


if __name__ == "__main__":
    raise SystemExit(main())
