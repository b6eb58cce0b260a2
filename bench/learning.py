"""Learning benchmark: does the model learn through rollstream, and what does async
training buy in steps and seconds?

The reverse task (rollstream.recipes.reverse: a 14k-parameter GPT-2, "c a m >" -> "m a c",
per-position partial reward, chance 0.06) trained through the whole pipeline — hf
engines in Ray actors, producers, Redis streams, the reference trainer with
PolicyGradient, weights published every step and loaded by the engines — with each
recipe of rollstream.recipes.learning, for several seeds, until the mean reward of the
last 10 steps reaches the target (0.9):

  sync             on-policy: producers generate each step's batch on the last weights
  async            max_staleness 2, partial weight sync, no correction
  async_tis        ... with truncated importance sampling (cap 2) against the engines' logprobs
  async_decoupled  ... with AReaL's decoupled PPO (behaviour weight capped at 5)

and the same model, algorithm and seed in a plain loop without Redis or engines (the
reference: the issue's 350-450 steps). Per seed, every recipe runs on the same Redis
and Ray cluster, one after the other in a rotating order, so machine load is shared;
the ratios are of one seed's runs (async steps / sync steps, async seconds / sync
seconds), then their median and range over seeds. Seconds are wall seconds from the
trainer's start (engines up, model loaded) to the step that reaches the target.

Writes learning.json and learning.png (reward against step and against seconds).

    .venv/bin/python bench/learning.py                 # 3 seeds, ~15-25 min on 2 cores
    .venv/bin/python bench/learning.py --quick         # smoke: 1 seed, 2 recipes, 30 steps
    .venv/bin/python bench/learning.py --recipes sync async_decoupled --seeds 5
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS, pyplot, save_figure, show, spread, table, write_json

from rollstream.recipes import learning, reverse
from rollstream.shared.embedded import EmbeddedRedis


def main() -> int:
    args = parse_args()
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)  # the trainer's; each engine actor has its one CPU
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    logging.basicConfig(level=logging.WARNING)
    recipes = [learning.RECIPES[name] for name in args.recipes]
    target = args.target
    runs: list[dict[str, Any]] = []
    reference: list[dict[str, Any]] = []
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(range(args.seeds)):
            order = recipes[i % len(recipes) :] + recipes[: i % len(recipes)]
            for recipe in order:
                print(f"seed {seed}, {recipe.name}: {recipe.describe()}", flush=True)
                result = learning.run_learning(
                    recipe,
                    redis_url=server.url,
                    work_dir=tmp,
                    seed=seed,
                    steps=args.max_steps,
                    engines=args.engines,
                    stop_at=target,
                    on_step=progress(recipe.name),
                )
                summary = result.summary() | {
                    "steps_to_target": result.steps_to(target),
                    "seconds_to_target": result.seconds_to(target),
                    "seconds_by_step": [round(s.seconds, 3) for s in result.steps],
                    "staleness": staleness(result),
                }
                runs.append(summary)
                print(f"  {line(summary)}", flush=True)
            if not args.no_reference:
                reference.append(plain_loop(seed, args.max_steps, target, Path(tmp)))
                print(f"  reference (plain loop): {line(reference[-1])}", flush=True)
    report = analyse(runs, reference, [r.name for r in recipes], target, args)
    write_json(report, RESULTS / "learning.json")
    plot(report, RESULTS / "learning.png")
    print()
    print(summary_table(report))
    return 0


def progress(name: str) -> Any:
    def on_step(step: learning.StepRecord) -> None:
        if step.step % 50 == 0:
            print(f"  {name} step {step.step}: reward {step.reward:.3f}, {step.seconds:.1f} s", flush=True)

    return on_step


def staleness(result: learning.LearnResult) -> dict[str, int]:
    total: dict[str, int] = {}
    for step in result.steps:
        for k, v in step.staleness.items():
            total[str(k)] = total.get(str(k), 0) + v
    return dict(sorted(total.items()))


def plain_loop(seed: int, max_steps: int, target: float, tmp: Path) -> dict[str, Any]:
    """The reference: the same model, judge and PolicyGradient in a plain loop."""
    model_dir = reverse.save_model(tmp / f"reference-{seed}", seed)
    started = time.monotonic()
    seconds: list[float] = []
    run = reverse.train_in_process(
        model_dir, max_steps, seed=seed, stop_at=target,
        on_step=lambda _step, _reward: seconds.append(time.monotonic() - started),
    )  # fmt: skip
    steps = run.steps_to(target)
    return {
        "recipe": "reference",
        "seed": seed,
        "steps": len(run.rewards),
        "steps_to_target": steps,
        "seconds_to_target": None if steps is None else seconds[steps - 1],
        "reward_by_step": [round(r, 4) for r in run.rewards],
        "seconds_by_step": [round(s, 3) for s in seconds],
    }


def line(summary: dict[str, Any]) -> str:
    steps, seconds = summary["steps_to_target"], summary["seconds_to_target"]
    reached = f"{steps} steps, {seconds:.1f} s" if steps is not None else "not reached"
    return f"to the target: {reached} ({summary['steps']} steps run)"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def analyse(
    runs: list[dict[str, Any]],
    reference: list[dict[str, Any]],
    names: list[str],
    target: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    by = {(r["recipe"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    recipes: dict[str, Any] = {}
    for name in names:
        mine = [by[(name, s)] for s in seeds if (name, s) in by]
        steps = [r["steps_to_target"] for r in mine if r["steps_to_target"] is not None]
        seconds = [r["seconds_to_target"] for r in mine if r["seconds_to_target"] is not None]
        entry: dict[str, Any] = {
            "description": learning.RECIPES[name].describe(),
            "reached": f"{len(steps)}/{len(mine)}",
            "steps_to_target": spread(steps),
            "seconds_to_target": spread(seconds),
            "per_seed": {
                str(r["seed"]): {"steps": r["steps_to_target"], "seconds": r["seconds_to_target"]}
                for r in mine
            },
        }
        if name != "sync":
            step_ratios = [
                ratio(by[(name, s)]["steps_to_target"], by[("sync", s)]["steps_to_target"])
                for s in seeds
                if (name, s) in by and ("sync", s) in by
            ]
            second_ratios = [
                ratio(by[(name, s)]["seconds_to_target"], by[("sync", s)]["seconds_to_target"])
                for s in seeds
                if (name, s) in by and ("sync", s) in by
            ]
            entry["steps_over_sync"] = spread([r for r in step_ratios if r is not None])
            entry["seconds_over_sync"] = spread([r for r in second_ratios if r is not None])
        recipes[name] = entry
    ref_steps = {r["seed"]: r["steps_to_target"] for r in reference}
    sync_over_reference = [
        ratio(by[("sync", s)]["steps_to_target"], ref_steps.get(s)) for s in seeds if ("sync", s) in by
    ]
    return {
        "target": target,
        "window": learning.WINDOW,
        "seeds": seeds,
        "max_steps": args.max_steps,
        "engines": args.engines,
        "recipes": recipes,
        "reference": {
            "steps_to_target": spread([s for s in ref_steps.values() if s is not None]),
            "seconds_to_target": spread(
                [r["seconds_to_target"] for r in reference if r["seconds_to_target"]]
            ),
            "per_seed": {str(k): v for k, v in ref_steps.items()},
        },
        "sync_steps_over_reference": spread([r for r in sync_over_reference if r is not None]),
        "runs": runs,
        "reference_runs": reference,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = dict(zip([*report["recipes"], "reference"], palette, strict=False))
    window = report["window"]
    for run in [*report["runs"], *report["reference_runs"]]:
        rewards = run["reward_by_step"]
        smooth = [statistics.fmean(rewards[max(0, i + 1 - window) : i + 1]) for i in range(len(rewards))]
        first = run["seed"] == report["seeds"][0]
        label = run["recipe"] if first else None
        style: dict[str, Any] = {"color": colours[run["recipe"]], "alpha": 0.9 if first else 0.45, "lw": 1.2}
        axes[0].plot(range(1, len(smooth) + 1), smooth, label=label, **style)
        axes[1].plot(run["seconds_by_step"], smooth, label=label, **style)
    for ax, xlabel in zip(axes, ("train step", "wall seconds from the trainer's start"), strict=True):
        ax.axhline(report["target"], color="grey", ls=":", lw=1)
        ax.axhline(reverse.CHANCE, color="grey", ls="--", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"mean reward ({window}-step window)")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right", fontsize=8)
    seeds = ", ".join(str(s) for s in report["seeds"])
    fig.suptitle(
        f"reverse task through rollstream: seeds {seeds} (the first bold); dotted: target, dashed: chance"
    )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    print(f"wrote {path}")


def summary_table(report: dict[str, Any]) -> str:
    rows = []
    ref = report["reference"]
    steps, seconds = show(ref["steps_to_target"], ".0f"), show(ref["seconds_to_target"], ".1f")
    rows.append(["reference (plain loop)", steps, seconds, "-", "-", f"{len(ref['per_seed'])} seeds"])
    for name, r in report["recipes"].items():
        rows.append(
            [
                name,
                show(r["steps_to_target"], ".0f"),
                show(r["seconds_to_target"], ".1f"),
                show(r["steps_over_sync"], ".2f")
                if "steps_over_sync" in r and r["steps_over_sync"]["n"]
                else "-",
                show(r["seconds_over_sync"], ".2f")
                if "seconds_over_sync" in r and r["seconds_over_sync"]["n"]
                else "-",
                f"reached {r['reached']}: {r['description']}",
            ]
        )
    head = ["recipe", "steps to target", "seconds", "steps / sync", "seconds / sync", ""]
    sync = report["sync_steps_over_reference"]
    note = f"sync steps / reference steps: {show(sync, '.2f')}" if sync["n"] else ""
    return table(head, rows) + (f"\n{note}" if note else "")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    parser.add_argument(
        "--recipes", nargs="+", default=list(learning.RECIPES), choices=list(learning.RECIPES)
    )
    parser.add_argument("--target", type=float, default=learning.TARGET, help="mean reward to reach")
    parser.add_argument("--max-steps", type=int, default=900, help="a run that has not reached it stops here")
    parser.add_argument("--engines", type=int, default=2, help="hf engine actors")
    parser.add_argument("--no-reference", action="store_true", help="leave out the plain-loop reference")
    parser.add_argument("--quick", action="store_true", help="smoke: 1 seed, 2 recipes, 30 steps, target 0.1")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.recipes, args.max_steps, args.target = 1, ["sync", "async_decoupled"], 30, 0.1
    return args


if __name__ == "__main__":
    raise SystemExit(main())
