"""The memory of one trainer step of the real model (SmolLM2-135M, full weights, AdamW) on
a batch of 64 samples, the whole batch in one pass against micro-batches of 16 and 8
(``algorithm.micro_batch_size``: the same update), side by side in one run.

Each way runs in a process of its own, which loads the model, builds the batch, resets
its peak resident memory (``/proc/self/clear_refs``) and takes one step: its peak RSS
(VmHWM) is the step's, the model's weights included, and its rise over the RSS before
the step is what the step added (gradients, AdamW's state, the activations). The batch is
the arithmetic recipe's: 8 prompts x 8 samples, its chat prompts, every response at the
recipe's budget (24 tokens, random ids: the memory's worst case, no sampling needed).

The whole batch in one pass runs only where this much memory is free (``--min-free-gb``,
14): else every way measures a batch of 32 samples, and the output says so.

    .venv/bin/python bench/micro_batch.py               # ~3 minutes on 2 cores
    .venv/bin/python bench/micro_batch.py --samples 16  # smaller, to see it run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, table, write_json

SIZES = [0, 16, 8]  # 0: the whole batch in one pass
PROMPTS = 8
MODEL = "smollm2-135m"


def status_mb(field: str) -> float:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1)) / 1024 if match else float("nan")


def free_gb() -> float:
    """MemFree (what `free` calls free), in GB."""
    match = re.search(r"^MemFree:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return int(match.group(1)) / 2**20 if match else 0.0


def batch_of(model: str, samples: int, seed: int = 0) -> Any:
    """``samples`` of the arithmetic recipe's prompts, 8 a prompt, responses at the budget."""
    import numpy as np
    from transformers import AutoTokenizer

    from rollstream.consumer.batches import TrainBatch
    from rollstream.recipes import arithmetic
    from rollstream.shared import models
    from rollstream.shared.records import Group, Sample

    tokenizer: Any = AutoTokenizer.from_pretrained(models.resolve(model))
    rng = np.random.default_rng(seed)
    groups = []
    n = samples // PROMPTS
    for prompt in arithmetic.prompts(PROMPTS, seed):
        text = tokenizer.apply_chat_template(prompt.prompt, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        responses = rng.integers(10, len(tokenizer), (n, arithmetic.MAX_TOKENS))
        rewards = rng.permutation([float(i % 2) for i in range(n)])  # a signal in every group
        samples_ = [
            Sample(ids, r.tolist(), [0.0] * len(r), [0] * len(r), "length", {"score": s})
            for r, s in zip(responses, rewards, strict=True)
        ]
        groups.append(Group.for_prompt(prompt, samples=samples_))
    return TrainBatch.of_groups(1, groups)


def one(model: str, size: int, samples: int) -> dict[str, Any]:
    """One step in this process (the child's part)."""
    import torch

    from rollstream.consumer.losses import AlgorithmConfig
    from rollstream.consumer.pg import PolicyGradient
    from rollstream.recipes import arithmetic

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        policy = PolicyGradient(
            model, out, lr=arithmetic.LR, algorithm=AlgorithmConfig(micro_batch_size=size)
        )
        batch = batch_of(model, samples)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on: the step's
        before = status_mb("VmRSS")
        started = time.perf_counter()
        loss = policy(batch)
        seconds = time.perf_counter() - started
    return {"micro_batch_size": size, "samples": samples, "rss_before_mb": before,
            "peak_mb": status_mb("VmHWM"), "step_s": seconds, "loss": loss,
            "tokens": policy.metrics["tokens"]}  # fmt: skip


def child(model: str, size: int, samples: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--one", str(size), "--samples", str(samples), "--model", model],
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"micro_batch_size {size}: exit {out.returncode}\n{out.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--model", default=MODEL, help="a known model's name or a directory")
    parser.add_argument("--min-free-gb", type=float, default=14.0)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.model, args.one, args.samples)))
        return
    # the model's cached conversion (~30 s the first time), outside the measured processes
    resolve = f"from rollstream.shared import models; models.resolve({args.model!r})"
    subprocess.run([sys.executable, "-c", resolve], check=True)
    samples, free = args.samples, free_gb()
    note = ""
    if free < args.min_free_gb and samples > 32:
        samples = 32
        note = f"{free:.1f} GB free (< {args.min_free_gb:g}): every way measured at 32 samples"
        print(note, flush=True)
    rows = []
    for size in SIZES:  # the whole batch first, while the free memory was checked
        rows.append(child(args.model, size, samples))
        r = rows[-1]
        print(
            f"  micro_batch_size {size or 'whole'}: peak {r['peak_mb']:.0f} MB, step {r['step_s']:.1f} s",
            flush=True,
        )
    whole = rows[0]
    for r in rows:
        r["peak_over_whole"] = r["peak_mb"] / whole["peak_mb"]
        r["added_mb"] = r["peak_mb"] - r["rss_before_mb"]
        r["added_over_whole"] = r["added_mb"] / (whole["peak_mb"] - whole["rss_before_mb"])
        r["loss_minus_whole"] = r["loss"] - whole["loss"]
    print(table(["micro_batch_size", "samples", "peak RSS MB", "x whole", "step adds MB", "x whole", "step s",
                 "loss - whole's"],
                [[r["micro_batch_size"] or "whole", r["samples"], f"{r['peak_mb']:.0f}",
                  f"{r['peak_over_whole']:.2f}", f"{r['added_mb']:.0f}", f"{r['added_over_whole']:.2f}",
                  f"{r['step_s']:.1f}", f"{r['loss_minus_whole']:.1e}"] for r in rows]))  # fmt: skip
    write_json({"model": args.model, "samples": samples, "free_gb_at_start": free, "note": note,
                "cpu_count": os.cpu_count(), "rows": rows}, RESULTS / "micro_batch.json")  # fmt: skip


if __name__ == "__main__":
    main()
