"""A GPU check anyone can run (`make gpu-check`): what rollstream's engine and weight
syncs do on this machine's accelerator, with nothing but torch, transformers and
rollstream's own base dependencies (no Redis server, no Ray, no vLLM, no network).

Parts, each in a process of its own with a timeout (a part that fails or hangs leaves
the others' figures), each writing one JSON line:

  env         torch, the GPU (or "no GPU"), CPUs
  decode      the hf engine's decode tokens/s against transformers' generate and a
              bare cached loop of the same random Qwen2 (bench/hf_decode.py): on the
              GPU in bfloat16 (--size, ~0.5B), and on the CPU (--cpu-size)
  transports  every weight transport for that random model (bench/weight_transports.py)
              against the pinned device -> host -> device copy of its bytes (on a CPU:
              a host memcpy), the shm transport's included (goal on one node: <= 1.5x
              the pinned copy); ray only where Ray is installed
  learning    the reverse-task demo (the hf engine sampling, PolicyGradient training,
              weights through the file transport every step) until the trailing mean
              reward reaches 0.9 or --learn-steps: on CUDA and on the CPU beside it

Writes bench/results/gpu_check.json (every part) and prints a table. Without a GPU it
says "no GPU" and measures what it can on the CPU.

    python bench/gpu_check.py                       # the full check (~0.5B on a GPU)
    python bench/gpu_check.py --tiny                # seconds: tiny models, a few steps
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import rollstream.shared.settings  # installed (a wheel, or pip install -e .)
except ImportError:  # a bare checkout: its folders are the package's parts (pyproject's package-dir)
    sys.path.insert(0, str(HERE.parent))
    import rollstream

    rollstream.__path__.append(str(HERE.parent))
RESULTS = Path(os.environ.get("ROLLSTREAM_BENCH_RESULTS") or HERE / "results")
PARTS = ("env", "decode", "transports", "learning")


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def part_env(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    gpu = has_gpu()
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if gpu else "no GPU",
        "gpus": torch.cuda.device_count() if gpu else 0,
        "cpus": os.cpu_count(),
        "machine": platform.node(),
        "python": platform.python_version(),
    }


def devices(args: argparse.Namespace, transports: bool = False) -> list[tuple[str, str, str]]:
    """(device, dtype, model size) to measure: the GPU when there is one, the CPU always."""
    out = [("cpu", "float32", args.cpu_transport_size if transports else args.cpu_size)]
    if has_gpu():
        out.insert(0, ("cuda", "bfloat16", args.size))
    return out


def part_decode(args: argparse.Namespace) -> dict[str, Any]:
    import hf_decode

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for device, dtype, size in devices(args):
            directory = hf_decode.random_model(Path(tmp) / size, hf_decode.SIZES[size])
            tokens = args.tokens if device != "cpu" else min(args.tokens, args.cpu_tokens)
            results[f"{device}:{size}"] = hf_decode.measure(
                directory, device, dtype, args.n, tokens, args.repeats
            )
    return results


def part_transports(args: argparse.Namespace) -> dict[str, Any]:
    import weight_transports

    use_ray = False
    if args.ray:
        use_ray = weight_transports.start_ray()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for device, dtype, size in devices(args, transports=True):
            results[f"{device}:{size}"] = weight_transports.measure(
                size, device, dtype, args.repeats, use_ray, Path(tmp)
            )
    return results


def learn(device: str, steps: int, seed: int = 0) -> dict[str, Any]:
    """The reverse task: the hf engine samples each step's groups, PolicyGradient trains on
    them, the weights go back through the file transport (tmpfs) before the next step."""
    from rollstream.consumer.batches import TrainBatch
    from rollstream.consumer.pg import PolicyGradient
    from rollstream.producer.engines.base import SamplingParams
    from rollstream.producer.engines.hf import HFEngine
    from rollstream.producer.judges.base import apply_rewards
    from rollstream.producer.judges.reverse import ReverseJudge
    from rollstream.recipes import reverse
    from rollstream.shared.engine_settings import HFEngineSettings
    from rollstream.shared.records import Group, Sample
    from rollstream.shared.transports import TransportSettings, default_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = reverse.save_model(Path(tmp) / "model", seed)
        engine = HFEngine(HFEngineSettings(model=str(model_dir), device=device))
        shm = default_dir(f"gpu-check-{os.getpid()}-{device}")
        weights = TransportSettings(dir=shm or str(Path(tmp) / "weights"), shards=2)
        policy = PolicyGradient(
            str(model_dir), str(Path(tmp) / "out"), lr=reverse.LR, device=device,
            algorithm=reverse.ALGORITHM, weights=weights,
        )  # fmt: skip
        train, _ = reverse.all_prompts(seed)
        order = random.Random(seed + 1)
        eos = reverse.VOCAB.index(reverse.EOS)
        params = SamplingParams(
            max_tokens=reverse.MAX_TOKENS, temperature=1.0, stop_token_ids=[eos], seed=None
        )
        judge = ReverseJudge()
        rewards: list[float] = []
        started = time.perf_counter()

        async def sample(prompts: list[Any], step: int) -> list[Group]:
            ids = [engine.encode_prompt(p.prompt) for p in prompts]
            outs = await asyncio.gather(*(engine.generate(i, params, n=8) for i in ids))
            groups = []
            for prompt, prompt_ids, gens in zip(prompts, ids, outs, strict=True):
                samples = [
                    Sample(
                        prompt_ids,
                        g.response_ids.tolist(),
                        g.logprobs.tolist(),
                        g.versions.tolist(),
                        finish_reason=g.finish_reason,
                        text=g.text,
                    )
                    for g in gens
                ]
                group = Group.for_prompt(prompt, samples=samples)
                apply_rewards(group.samples, judge(prompt, group.samples))
                groups.append(group)
            return groups

        try:
            for step in range(1, steps + 1):
                groups = asyncio.run(sample(order.sample(train, 8), step - 1))
                policy(TrainBatch.of_groups(step, groups))
                asyncio.run(engine.update_weights(step, policy.save(step)))
                rewards.append(sum(s.score or 0.0 for g in groups for s in g.samples) / (8 * len(groups)))
                if reverse.steps_to(rewards, 0.9) is not None:
                    break
        finally:
            engine.stop()
            if shm:
                import shutil

                shutil.rmtree(shm, ignore_errors=True)
        seconds = time.perf_counter() - started
        reached = reverse.steps_to(rewards, 0.9)
        return {
            "device": device,
            "steps": len(rewards),
            "reached_0.9_at_step": reached,
            "seconds": seconds,
            "seconds_per_step": seconds / max(1, len(rewards)),
            "last_10_mean_reward": sum(rewards[-10:]) / max(1, len(rewards[-10:])),
        }


def part_learning(args: argparse.Namespace) -> dict[str, Any]:
    return {device: learn(device, args.learn_steps) for device, _, _ in devices(args)}


def run_part(name: str, argv: list[str], timeout_s: float) -> dict[str, Any]:
    """One part in a child process: its JSON line, or why there is none."""
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, *argv]
    started = time.monotonic()
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": f"exit {out.returncode}: {out.stderr.strip()[-1500:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    result["part_seconds"] = time.monotonic() - started
    return result


def table(report: dict[str, Any]) -> str:
    from hf_decode import table as render

    rows = [["part", "what", "figure"]]
    env = report.get("env", {})
    rows.append(["env", "accelerator", str(env.get("gpu", env.get("error", "?")))])
    for key, r in report.get("decode", {}).items():
        if key == "part_seconds":
            continue
        if key == "error":
            rows.append(["decode", "error", str(r)[:100]])
            continue
        rates = [r[f"{k}_tokens_per_s"] for k in ("engine", "generate", "bare")]
        rows.append(
            ["decode", f"{key} tok/s engine / generate / bare", " / ".join(f"{x:.0f}" for x in rates)]
        )
        rows.append(["decode", f"{key} engine/bare, engine/generate",
                     f"{r['engine_over_bare']:.2f}, {r['engine_over_generate']:.2f}"])  # fmt: skip
    for key, r in report.get("transports", {}).items():
        if key == "part_seconds":
            continue
        if key == "error":
            rows.append(["transports", "error", str(r)[:100]])
            continue
        a = r["anchor"]
        rows.append(["transports", f"{key} ({r['gb']:.2f} GB) anchor: {a['what']}", f"{a['seconds']:.3f} s"])
        for name, w in r["ways"].items():
            rows.append(["transports", f"{key} {name}: send + load (x anchor)",
                         f"{w['send_s']:.3f} + {w['load_s']:.3f} s ({w['over_anchor']:.1f}x)"
                         + ("" if w["exact"] else " NOT EXACT")])  # fmt: skip
        if "shm" in r["ways"] and "file shm" in r["ways"]:
            shm, file = r["ways"]["shm"], r["ways"]["file shm"]
            rows.append(["transports", f"{key} shm: x anchor (goal <= 1.5), x file shm",
                         f"{shm['over_anchor']:.2f}, {shm['total_s'] / file['total_s']:.2f}"])  # fmt: skip
    for key, r in report.get("learning", {}).items():
        if key == "part_seconds":
            continue
        if key == "error":
            rows.append(["learning", "error", str(r)[:100]])
            continue
        figure = (
            f"{r['steps']} ({r['reached_0.9_at_step']}), {r['seconds']:.1f} s, {r['last_10_mean_reward']:.2f}"
        )
        rows.append(["learning", f"{key}: steps (0.9 at), seconds, last-10 reward", figure])
    return render(rows, left=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=PARTS, help="run one part here (the check runs each in a child)")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--size", default="0.5b", help="the GPU's random model (bench/hf_decode.py SIZES)")
    parser.add_argument("--cpu-size", default="tiny", help="the CPU's random model (decode)")
    parser.add_argument(
        "--cpu-transport-size",
        default="small",
        help="the CPU's model for the transports (0.5b where memory allows)",
    )
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--cpu-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--learn-steps", type=int, default=600)
    parser.add_argument("--ray", action="store_true", help="the ray transport too, where Ray is installed")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per part")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny models, 16 tokens, 1 repeat, 3 learning steps"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args(argv)
    if args.tiny:
        args.size, args.cpu_size, args.cpu_transport_size = "tiny", "tiny", "tiny"
        args.tokens, args.cpu_tokens = 16, 16
        args.n, args.repeats, args.learn_steps = 2, 1, 3
    return args


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option`` and its value, given as ``--opt=v`` or as ``--opt v``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.part:
        part = {
            "env": part_env,
            "decode": part_decode,
            "transports": part_transports,
            "learning": part_learning,
        }
        print(json.dumps(part[args.part](args), default=str), flush=True)
        return 0
    child = without_option(argv, "--parts")
    report: dict[str, Any] = {}
    for name in args.parts.split(","):
        print(f"gpu check: {name} ...", flush=True)
        report[name] = run_part(name, child, args.timeout)
        if name == "env":
            print(f"gpu check: {report['env'].get('gpu', report['env'])}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(table(report))
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
