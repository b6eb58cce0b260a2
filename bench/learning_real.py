"""A real pretrained model learns through rollstream, side by side with a plain loop.

SmolLM2-135M-Instruct (`smollm2-135m`, shared/models.py) on two-digit arithmetic
(recipes/arithmetic.py), the same seed, prompts, step budget, loss (GRPO) and learning
rate three ways in one run:

- rollstream, sync: hf engines in Ray actors, a producer, Redis, the reference trainer,
  weights to the engines after every step (recipes/learning.py, task ARITHMETIC);
- rollstream, async: the same, producers up to 2 weight syncs ahead, partial syncs;
- the plain loop: generate with model.generate in this process, the same PolicyGradient
  step, no rollstream (recipes/arithmetic.py's sample_groups).

Each is evaluated on the held-out prompts (greedy, exact match) every --eval-every steps.
Prints the accuracy before and after, the steps and wall seconds to base + --gain, and the
samples per second; writes learning_real.json and learning_real.png (accuracy against step
and against seconds).

    .venv/bin/python bench/learning_real.py              # 60 steps each, ~2 h on 2 cores
    .venv/bin/python bench/learning_real.py --quick      # smoke: 1 step of sync and plain, 8 prompts
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS, pyplot, save_figure, table, write_json

from rollstream.recipes import arithmetic, learning
from rollstream.recipes.tasks import ARITHMETIC
from rollstream.shared.embedded import EmbeddedRedis


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 step of sync and plain, 8 held-out prompts"
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--eval-prompts", type=int, default=len(arithmetic.questions("held_out")))
    p.add_argument("--gain", type=float, default=0.20, help="the accuracy over the base model's to reach")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ways", nargs="+", default=["sync", "async", "plain"], choices=["sync", "async", "plain"]
    )
    p.add_argument("--sync-only", action="store_true", help="only the weight sync's cost, full against LoRA")
    p.add_argument(
        "--save-policies", default=str(RESULTS / "policies"),
        help="each rollstream run's trained policy goes here (a Hugging Face directory; '': none)",
    )  # fmt: skip
    args = p.parse_args()
    if args.quick:  # one step of rollstream sync and of the plain loop, 8 held-out prompts
        args.steps, args.eval_every, args.eval_prompts, args.save_policies = 1, 1, 8, ""
        if "--ways" not in sys.argv:
            args.ways = ["sync", "plain"]
    return args


def base_accuracy(held_out: list[Any]) -> float:
    model, tokenizer = arithmetic.load(arithmetic.MODEL)
    return arithmetic.accuracy(held_out, arithmetic.greedy_answers(model, tokenizer, held_out))


def through_rollstream(
    way: str, args: argparse.Namespace, url: str, tmp: str, target: float
) -> dict[str, Any]:
    recipe = learning.RECIPES[way]
    started = time.monotonic()

    def report(step: learning.StepRecord) -> None:
        accuracy = "" if step.eval_accuracy is None else f", held-out accuracy {step.eval_accuracy:.3f}"
        seconds, reward = f"{step.seconds:.0f}", f"{step.reward:.3f}"
        print(f"  {way} step {step.step}: {seconds} s, reward {reward}{accuracy}", flush=True)

    result = learning.run_learning(
        recipe, redis_url=url, work_dir=tmp, seed=args.seed, steps=args.steps, engines=2, on_step=report,
        eval_every=args.eval_every, eval_prompts=args.eval_prompts, stop_at_accuracy=target, task=ARITHMETIC,
        save_to=Path(args.save_policies) / f"smollm2-135m-arithmetic-{way}" if args.save_policies else None,
    )  # fmt: skip
    curve = [(s.step, s.seconds, s.eval_accuracy) for s in result.evals if s.eval_accuracy is not None]
    n = result.settings.tasks[0].n
    return {
        "way": way,
        "steps": len(result.steps),
        "curve": curve,
        "samples_per_s": len(result.steps)
        * learning.PROMPTS_PER_STEP
        * n
        / max(result.steps[-1].seconds, 1e-9)
        if result.steps
        else 0.0,
        "wall_s": time.monotonic() - started,
    }


def plain(args: argparse.Namespace, held_out: list[Any], target: float) -> dict[str, Any]:
    """The same GRPO step on the same prompts, the rollout sampled in this process."""
    import torch

    from rollstream.consumer.batches import TrainBatch
    from rollstream.consumer.pg import PolicyGradient

    train, _ = ARITHMETIC.prompts(args.seed)
    order = random.Random(args.seed + 1)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    curve: list[tuple[int, float, float]] = []
    with tempfile.TemporaryDirectory() as out:
        policy = PolicyGradient(
            arithmetic.MODEL,
            out,
            lr=ARITHMETIC.lr,
            algorithm=ARITHMETIC.algorithm(learning.RECIPES["sync"].algorithm),
        )
        _, tokenizer = arithmetic.load(arithmetic.MODEL)
        steps = 0
        for step in range(1, args.steps + 1):
            groups = arithmetic.sample_groups(
                policy.model, tokenizer, order.sample(train, learning.PROMPTS_PER_STEP), 8, step - 1
            )
            policy(TrainBatch.of_groups(step, groups))
            steps = step
            reward = sum(s.reward.get("score", 0.0) for g in groups for s in g.samples) / (len(groups) * 8)
            print(f"  plain step {step}: {time.monotonic() - started:.0f} s, reward {reward:.3f}", flush=True)
            if step % args.eval_every == 0 or step == args.steps:
                policy.model.eval()
                acc = arithmetic.accuracy(
                    held_out, arithmetic.greedy_answers(policy.model, tokenizer, held_out)
                )
                policy.model.train()
                curve.append((step, time.monotonic() - started, acc))
                if acc >= target:
                    break
    seconds = time.monotonic() - started
    return {"way": "plain", "steps": steps, "curve": curve,
            "samples_per_s": steps * learning.PROMPTS_PER_STEP * 8 / seconds, "wall_s": seconds}  # fmt: skip


def sync_costs(repeats: int = 3) -> list[dict[str, Any]]:
    """One weight sync of the real model, full weights against a LoRA adapter (rank 8 on the
    attention projections), side by side: the bytes sent, the trainer's send and an hf
    engine's read-and-apply, through the file transport on tmpfs (/dev/shm)."""
    import asyncio

    import torch

    from rollstream.consumer.losses import AlgorithmConfig
    from rollstream.consumer.pg import PolicyGradient
    from rollstream.producer.engines.hf import HFEngine
    from rollstream.shared.engine_settings import HFEngineSettings
    from rollstream.shared.transports import SHM, TransportSettings

    rows = []
    for name, algorithm in (("full", AlgorithmConfig()), ("lora r8", AlgorithmConfig(lora_rank=8))):
        with tempfile.TemporaryDirectory(dir=SHM if SHM.is_dir() else None) as shm:
            weights = TransportSettings(kind="file", dir=shm)
            policy = PolicyGradient(arithmetic.MODEL, shm, lr=1e-4, algorithm=algorithm, weights=weights)
            engine = HFEngine(HFEngineSettings(model=arithmetic.MODEL))
            send, apply = [], []
            for step in range(1, repeats + 1):
                ids = torch.randint(10, 1000, (1, 16))
                policy.optimizer.zero_grad()
                policy.model(input_ids=ids).logits.logsumexp(-1).mean().backward()
                policy.optimizer.step()
                started = time.perf_counter()
                uri = policy.save(step)
                send.append(time.perf_counter() - started)
                started = time.perf_counter()
                asyncio.run(engine.update_weights(step, uri))
                apply.append(time.perf_counter() - started)
            sent = sum(t.numel() * t.element_size() for t in policy.tensors().values())
            rows.append({"way": name, "bytes": sent, "send_s": min(send), "apply_s": min(apply)})
            del policy, engine
    return rows


def sync_table(syncs: list[dict[str, Any]]) -> str:
    full = syncs[0]
    whole = full["send_s"] + full["apply_s"]
    rows = [
        [s["way"], f"{s['bytes']:,}", f"{s['bytes'] / full['bytes']:.2%}", f"{s['send_s']:.3f}",
         f"{s['apply_s']:.3f}", f"{(s['send_s'] + s['apply_s']) / whole:.2f}"]
        for s in syncs
    ]  # fmt: skip
    return table(["sync", "bytes", "of full", "send s", "apply s", "time of full"], rows)


def to_target(curve: list[tuple[int, float, float]], target: float) -> tuple[int | None, float | None]:
    hit = next(((step, s) for step, s, acc in curve if acc >= target), None)
    return hit if hit is not None else (None, None)


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (by_step, by_s) = plt.subplots(1, 2, figsize=(11, 4))
    for run in report["runs"]:
        steps = [0] + [c[0] for c in run["curve"]]
        seconds = [0.0] + [c[1] for c in run["curve"]]
        acc = [report["base_accuracy"]] + [c[2] for c in run["curve"]]
        by_step.plot(steps, acc, marker="o", label=run["way"])
        by_s.plot(seconds, acc, marker="o", label=run["way"])
    for ax, xlabel in ((by_step, "train step"), (by_s, "wall seconds")):
        ax.axhline(report["target"], color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy")
        ax.legend()
    fig.suptitle(f"smollm2-135m on arithmetic, seed {report['seed']}")
    save_figure(fig, path)


def main() -> int:
    args = parse_args()
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)  # the trainer's; each engine actor has its one CPU
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    logging.basicConfig(level=logging.WARNING)
    syncs = sync_costs(repeats=1 if args.quick else 3)
    print(sync_table(syncs), flush=True)
    if args.sync_only:
        write_json({"syncs": syncs}, RESULTS / "learning_real_sync.json")
        return 0
    held_out = ARITHMETIC.prompts(args.seed)[1][: args.eval_prompts]
    base = base_accuracy(held_out)
    target = base + args.gain
    print(
        f"base model: greedy accuracy {base:.3f} on {len(held_out)} held-out prompts; target {target:.3f}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        for way in args.ways:
            run = (
                plain(args, held_out, target)
                if way == "plain"
                else through_rollstream(way, args, server.url, tmp, target)
            )
            runs.append(run)
            last = run["curve"][-1][2] if run["curve"] else None
            print(f"{way}: {run['steps']} steps in {run['wall_s']:.0f} s, accuracy {last}", flush=True)
    report = {"seed": args.seed, "base_accuracy": base, "target": target, "steps": args.steps, "runs": runs,
              "syncs": syncs}  # fmt: skip
    write_json(report, RESULTS / "learning_real.json")
    plot(report, RESULTS / "learning_real.png")
    rows = []
    for run in runs:
        steps, seconds = to_target(run["curve"], target)
        final = run["curve"][-1][2] if run["curve"] else float("nan")
        to_s = f"{seconds:.0f}" if seconds else "-"
        rows.append([run["way"], f"{base:.3f}", f"{final:.3f}", steps or "-", to_s, run["steps"],
                     f"{run['samples_per_s']:.2f}"])  # fmt: skip
    print()
    print(
        table(
            ["way", "accuracy before", "after", "steps to target", "s to target", "steps run", "samples/s"],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
