"""What the pipeline benchmarks share: the results folder, spreads, prompts, tables, plots,
and producer processes (``rollstream produce --local-engines``) on an embedded Redis."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from cli.commands import example_prompts
from producer.prompts import read_prompt_file
from shared.buffer import ReplayBuffer
from shared.settings import Settings

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
        return ReplayBuffer(client, settings, "bench-feeder").feed(read_prompt_file(path, task)).added


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
        command = [sys.executable, "-m", "cli.main", "produce", "--local-engines"]
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
