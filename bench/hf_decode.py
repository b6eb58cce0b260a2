"""Does the hf engine keep up? Its decode tokens/s beside transformers' own ``generate``
and a bare cached decode loop of the same model, batch and length, in one process,
ways interleaved, medians over --repeats:

  engine     HFEngine.generate(prompt, n, ignore_eos): its decode thread, batch,
             sampling and logprobs on the device, the asyncio hand-back
  generate   model.generate(do_sample, num_return_sequences=n, min = max new tokens)
  bare       prefill once, the cache repeated n times, then forward(past_key_values)
             + sample + logprob + one host sync a step: the least a decode loop does

and what a step costs when it is handed across (ms a step, over the bare step called
in the main thread): through one reused worker thread (a thread hop), and through
the async path the engine used to take at every token (asyncio.to_thread on the
default executor, a shield, a lock).

    .venv/bin/python bench/hf_decode.py              # tiny Qwen2s, vocab 128 and 151,936
    .venv/bin/python bench/hf_decode.py --quick

Needs torch and transformers only (the gpu check imports it: no Redis, no Ray).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(os.environ.get("ROLLSTREAM_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
PROMPT_LEN = 16
# Qwen2.5-0.5B's shape, and smaller ones for a CPU
SIZES: dict[str, dict[str, int]] = {
    "0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151_936},
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 128},
    "tiny-152k": {
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 128,
        "vocab": 151_936,
    },
}


def random_model(directory: Path, size: dict[str, int], seed: int = 0) -> Path:
    """A random-initialised Qwen2 with a small word-level tokenizer, saved as from_pretrained
    reads it (no hub, no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [str(i) for i in range(min(size["vocab"], 1000) - 4)]
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"])
    core.train_from_iterator([" ".join(words)], trainer)
    tokenizer: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    config = Qwen2Config(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model: Any = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bare:
    """The bare loop: what a decode step costs with nothing around it."""

    def __init__(self, model: Any, device: torch.device, n: int) -> None:
        self.model, self.device, self.n = model, device, n
        self.generator = torch.Generator(device).manual_seed(0)

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> tuple[Any, torch.Tensor]:
        out = self.model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(self.n)
        token, _ = self.pick(out.logits[:, -1, :].repeat(self.n, 1))
        return cache, token

    @torch.no_grad()
    def step(self, cache: Any, token: torch.Tensor) -> tuple[Any, torch.Tensor]:
        out = self.model(
            input_ids=token.unsqueeze(1), past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        return out.past_key_values, self.pick(out.logits[:, -1, :])[0]

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        chosen = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=self.generator).squeeze(1)
        picked = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
        host = torch.stack([chosen.double(), picked.double()]).tolist()  # the one host sync
        return chosen, host

    def run(self, prompt: torch.Tensor, tokens: int) -> float:
        started = time.perf_counter()
        cache, token = self.prefill(prompt)
        for _ in range(tokens - 1):
            cache, token = self.step(cache, token)
        sync(self.device)
        return self.n * tokens / (time.perf_counter() - started)


def hf_generate(model: Any, prompt: torch.Tensor, n: int, tokens: int, device: torch.device) -> float:
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            num_return_sequences=n,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=1,
        )
    sync(device)
    assert out.shape == (n, prompt.shape[1] + tokens), out.shape
    return n * tokens / (time.perf_counter() - started)


def engine_generate(engine: Any, prompt: list[int], n: int, tokens: int) -> float:
    from rollstream.producer.engines.base import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)

    async def go() -> float:
        started = time.perf_counter()
        gens = await engine.generate(prompt, params, n=n)
        elapsed = time.perf_counter() - started
        assert all(len(g.response_ids) == tokens for g in gens)
        return n * tokens / elapsed

    return asyncio.run(go())


def step_costs(bare: Bare, prompt: torch.Tensor, steps: int) -> dict[str, float]:
    """ms a decode step: called here, through a reused worker thread, through the old
    engine's async path (asyncio.to_thread + shield + lock a step)."""
    out: dict[str, float] = {}

    def direct() -> float:
        cache, token = bare.prefill(prompt)
        started = time.perf_counter()
        for _ in range(steps):
            cache, token = bare.step(cache, token)
        sync(bare.device)
        return (time.perf_counter() - started) / steps * 1000

    def hop() -> float:
        with ThreadPoolExecutor(1) as pool:
            cache, token = pool.submit(bare.prefill, prompt).result()
            started = time.perf_counter()
            for _ in range(steps):
                cache, token = pool.submit(bare.step, cache, token).result()
            sync(bare.device)
            return (time.perf_counter() - started) / steps * 1000

    async def async_path() -> float:
        lock = asyncio.Lock()
        cache, token = await asyncio.to_thread(bare.prefill, prompt)
        started = time.perf_counter()
        for _ in range(steps):
            async with lock:
                future = asyncio.ensure_future(asyncio.to_thread(bare.step, cache, token))
                cache, token = await asyncio.shield(future)
        sync(bare.device)
        return (time.perf_counter() - started) / steps * 1000

    ways: dict[str, Callable[[], float]] = {
        "main_thread": direct,
        "thread_hop": hop,
        "async_path": lambda: asyncio.run(async_path()),
    }
    samples: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(3):
        for name, way in ways.items():
            samples[name].append(way())
    for name, values in samples.items():
        out[f"{name}_ms"] = statistics.median(values)
    out["thread_hop_added_ms"] = out["thread_hop_ms"] - out["main_thread_ms"]
    out["async_path_added_ms"] = out["async_path_ms"] - out["main_thread_ms"]
    return out


def measure(
    directory: Path, device: str, dtype: str, n: int, tokens: int, repeats: int, costs: bool = True
) -> dict[str, Any]:
    """tokens/s of the engine, generate and the bare loop on one model; their ratios."""
    from rollstream.producer.engines.hf import HFEngine
    from rollstream.shared.engine_settings import HFEngineSettings

    engine = HFEngine(HFEngineSettings(model=str(directory), device=device, dtype=dtype))  # type: ignore[arg-type]
    try:
        model, dev = engine.model, engine.device
        ids = [4 + (i * 7) % 90 for i in range(PROMPT_LEN)]
        prompt = torch.tensor([ids], device=dev)
        bare = Bare(model, dev, n)
        ways: dict[str, Callable[[], float]] = {
            "engine": lambda: engine_generate(engine, ids, n, tokens),
            "generate": lambda: hf_generate(model, prompt, n, tokens, dev),
            "bare": lambda: bare.run(prompt, tokens),
        }
        for way in ways.values():  # warm up (allocator, kernels, the decode thread)
            way()
        rates: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(repeats):
            for name, way in ways.items():
                rates[name].append(way())
        result: dict[str, Any] = {f"{k}_tokens_per_s": statistics.median(v) for k, v in rates.items()}
        result["engine_over_bare"] = result["engine_tokens_per_s"] / result["bare_tokens_per_s"]
        result["engine_over_generate"] = result["engine_tokens_per_s"] / result["generate_tokens_per_s"]
        result["generate_over_bare"] = result["generate_tokens_per_s"] / result["bare_tokens_per_s"]
        result["spread"] = {k: [min(v), max(v)] for k, v in rates.items()}
        if costs:
            result["step_ms"] = step_costs(bare, prompt, min(tokens, 64))
        result.update(device=str(dev), dtype=dtype, n=n, tokens=tokens, repeats=repeats)
        return result
    finally:
        engine.stop()


def table(rows: list[list[str]], left: int = 1) -> str:
    """Columns padded to their widths: the first ``left`` flush left, the rest right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.rjust(w) if i >= left else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(results: dict[str, dict[str, Any]]) -> str:
    rows = [["model", "engine tok/s", "generate tok/s", "bare tok/s", "engine/bare", "engine/generate",
             "hop ms/step", "async ms/step", "step ms"]]  # fmt: skip
    for name, r in results.items():
        costs = r.get("step_ms", {})
        rows.append([
            f"{name} ({r['device']}, {r['dtype']}, n={r['n']} x {r['tokens']})",
            f"{r['engine_tokens_per_s']:.0f}", f"{r['generate_tokens_per_s']:.0f}",
            f"{r['bare_tokens_per_s']:.0f}",
            f"{r['engine_over_bare']:.2f}", f"{r['engine_over_generate']:.2f}",
            f"{costs.get('thread_hop_added_ms', float('nan')):+.2f}",
            f"{costs.get('async_path_added_ms', float('nan')):+.2f}",
            f"{costs.get('main_thread_ms', float('nan')):.2f}",
        ])  # fmt: skip
    return table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="tiny,tiny-152k", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="n 4, 32 tokens, 2 repeats")
    parser.add_argument("--out", type=Path, default=RESULTS / "hf_decode.json")
    args = parser.parse_args()
    if args.quick:
        args.n, args.tokens, args.repeats = 4, 32, 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes.split(","):
            directory = random_model(Path(tmp) / name, SIZES[name])
            results[name] = measure(directory, args.device, args.dtype, args.n, args.tokens, args.repeats)
            print(f"{name}: engine/bare {results[name]['engine_over_bare']:.2f}", flush=True)
    print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "results": results,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
