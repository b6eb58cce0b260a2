"""What the pipeline benchmarks share: the results folder, spreads, prompts, tables, plots,
producer processes (``rollstream produce --local-engines``) on an embedded Redis, and for
the real-engine benchmark a tiny Llama, processes with their logs, a vLLM server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from rollstream.producer.prompts import read_prompt_file
from rollstream.recipes.prompts import example_prompts
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings

# where results go: bench/results, or ROLLSTREAM_BENCH_RESULTS (the smoke tests' folder)
RESULTS = Path(os.environ.get("ROLLSTREAM_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
REPO = Path(__file__).resolve().parent.parent


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max (and how many) of repeated measurements."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def show(s: dict[str, float], fmt: str = ".3g") -> str:
    """``median [min..max]`` of a spread."""
    if s["n"] <= 1:
        return format(s["median"], fmt)
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}..{s['max']:{fmt}}]"


def feed_prompts(client: redis.Redis, settings: Settings, count: int, task: str = "math") -> int:
    """``count`` arithmetic prompts ("What is a + b?") fed into ``task``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = example_prompts(Path(tmp) / "prompts.jsonl", count)
        return open_buffer(client, settings, "bench-feeder").feed(read_prompt_file(path, task)).added


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """Columns padded to their widths: the first ``left`` flush left, the rest right."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.rjust(w) if i >= left else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """``fig`` written to ``path`` as a PNG, its folder made first (a fresh clone has no
    bench/results)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def producer_env(url: str, run: str, **settings: str) -> dict[str, str]:
    """The environment of a ``rollstream produce`` process: ROLLSTREAM_* variables, with
    ``settings`` given as ``producer__heartbeat_s="0.01"``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update({"ROLLSTREAM_REDIS__URL": url, "ROLLSTREAM_RUN": run, "PYTHONPATH": str(REPO)})
    env.update({f"ROLLSTREAM_{k.upper()}": v for k, v in settings.items()})
    return env


class Producers:
    """``count`` producer processes (``rollstream produce --local-engines``: sim engines in
    each process); stdout is dropped, stderr kept in a temporary file (a pipe nobody
    reads could fill and block them)."""

    def __init__(self, count: int, env: dict[str, str]) -> None:
        command = [sys.executable, "-m", "rollstream.cli.main", "produce", "--local-engines"]
        self.logs = [tempfile.TemporaryFile() for _ in range(count)]  # noqa: SIM115 - closed in stop()
        self.processes = [
            subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
            for log in self.logs
        ]

    def check(self) -> None:
        """Raise with its stderr if one has exited."""
        for process, log in zip(self.processes, self.logs, strict=True):
            if process.poll() is not None:
                raise RuntimeError(f"producer pid {process.pid} exited {process.returncode}: {_tail(log)}")

    def stop(self, timeout_s: float = 20.0) -> list[str]:
        """SIGTERM each (it finishes or aborts its groups), SIGKILL what is left; returns
        the stderr tails of those that exited with an error."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        errors = []
        for process, log in zip(self.processes, self.logs, strict=True):
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.returncode not in (0, -15):
                errors.append(f"pid {process.pid} rc {process.returncode}: {_tail(log)}")
            log.close()
        return errors

    def __enter__(self) -> Producers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(log: Any, chars: int = 2000) -> str:
    log.seek(0)
    return str(log.read().decode(errors="replace")[-chars:])


# --- real models and engines (bench/vllm_pipeline.py) ----------------------------------

# the benchmarks' tiny Llama: head_dim 64 (hidden 128 / 2 heads), the smallest that
# vLLM's CPU attention runs (it has no kernel for head_dim 16)
TINY_LLAMA = {"hidden": 128, "heads": 2, "layers": 2}


def tiny_llama(directory: Path, seed: int, hidden: int = 128, heads: int = 2, layers: int = 2) -> Path:
    """A random tied-embedding Llama and a word-level tokenizer as a model directory
    (config, safetensors, tokenizer) that vLLM, transformers and rollstream read alike.

    Its vocabulary is the words of the benchmarks' prompts ("What is a + b?", numbers
    to 999); it has no end-of-sequence token, so every response runs to max_tokens
    whatever samples it (the producer has no ignore_eos, vLLM alone gets it as well):
    the two sides of a comparison generate the same number of tokens."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    words = ["What", "is", "+", "?", *map(str, range(1_000))]
    core.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>"]))
    tokenizer: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>"
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


class Spawned:
    """One process (a ``rollstream`` command, a server) in its own session, its output
    in a log file: a pipe nobody reads could fill and block it. ``stop`` signals the
    whole session, so a process's children (vLLM's engine processes) go with it."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @classmethod
    def rollstream(cls, env: dict[str, str], log: Path, *args: str) -> Spawned:
        return cls([sys.executable, "-m", "rollstream.cli.main", *args], env, log)

    def check(self) -> None:
        """Raise with the end of its log if it has exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.log.stem} exited {self.process.returncode}:\n{self.tail()}")

    def wait(self, timeout_s: float) -> int:
        """Its exit code once it exits by itself; killed (and -9) after ``timeout_s``."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop(0)
            return -9

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM to its session, SIGKILL after ``timeout_s``; its exit code."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):  # what is left of its session
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])


VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",  # else its internal queues bind the machine's outward address
}


def start_vllm_server(
    model: Path, log: Path, cpu_bind: str = "", start_s: float = 420.0
) -> tuple[Spawned, str]:
    """vLLM's OpenAI-compatible server on a free loopback port, as the openai engine
    expects it: the token endpoint (``--enable-scale-out``), the control endpoints
    (``VLLM_SERVER_DEV_MODE``) and rollstream's worker extension; returns it and its URL
    once /health answers."""
    import httpx

    from rollstream.producer.engines.openai import WORKER_EXTENSION
    from rollstream.shared.embedded import free_port

    port = free_port()
    env = {**os.environ, **VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1"}
    if cpu_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0",
        "--enable-scale-out", "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    server = Spawned(command, env, log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_s
    while True:
        server.check()
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the vLLM server did not answer within {start_s:g} s:\n{server.tail()}")
        time.sleep(0.5)
