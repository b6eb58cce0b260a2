"""The replay buffer's hot path of two versions of rollstream, side by side in one run.

    .venv/bin/python bench/compare_commits.py OLD NEW [--groups 2000] [--repeats 7]

OLD and NEW are each a commit of this repository (extracted with `git archive` into a
temporary folder; nothing in the checkout changes) or a folder holding a checkout (`.`
for the working tree). Each version runs bench/buffer.py's own "ours" producer and
consumer (claim 64, complete_many; read_batch 64, commit) from its own tree, in
processes whose `rollstream` resolves to that tree: a temporary import root holds a
`rollstream` folder with the tree's rollstream/__init__.py and links to its top-level
folders (pyproject's package-dir, or the links an older tree kept in rollstream/).

One redis-server serves every run. Each repeat runs raw Redis (no rollstream code:
XADD; XREADGROUP + XACK + XDEL) and then both versions, the versions' order swapped
from one repeat to the next (raw A B, raw B A, ...), each on a flushed database and
timed from a start both children are told at once to the consumer's last commit. It
prints each version's ratio to the raw run of the same repeat, NEW / OLD per repeat,
and the CPU per group of each version's two processes, as median [min..max]: on a
loaded machine the spread is the noise to judge a difference against. Children talk
to this process in JSON lines over their pipes.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
START_TIMEOUT_S = 120
PROFILE_ENV = "COMPARE_COMMITS_PROFILE"  # {this}_{role}.prof; not ROLLSTREAM_: a setting


def main() -> None:
    args = parse_args()
    from rollstream.shared.embedded import EmbeddedRedis  # this checkout's: the server only

    with tempfile.TemporaryDirectory(prefix="rollstream-compare-") as tmp:
        trees = {"old": tree_of(args.old, Path(tmp) / "old"), "new": tree_of(args.new, Path(tmp) / "new")}
        roots = {label: import_root(tree, Path(tmp) / f"root-{label}") for label, tree in trees.items()}
        print(f"old = {args.old} ({trees['old']}), new = {args.new} ({trees['new']})", flush=True)
        print(f"{args.groups} groups per run, {args.repeats} repeats; load average {load()}", flush=True)
        runs: list[dict[str, Any]] = []
        with EmbeddedRedis() as server:
            import redis

            client = redis.Redis.from_url(server.url)
            for repeat in range(args.repeats):
                order = ["old", "new"] if repeat % 2 == 0 else ["new", "old"]
                row: dict[str, Any] = {"repeat": repeat + 1, "load": load()}
                for label in ["raw", *order]:
                    way = "raw" if label == "raw" else "ours"
                    tree = trees["new" if label == "raw" else label]
                    root = roots["new" if label == "raw" else label]
                    client.flushdb()
                    row[label], row[f"{label}_cpu_us"] = run_once(tree, root, way, server.url, args.groups)
                runs.append(row)
                print(
                    f"  repeat {repeat + 1}/{args.repeats} ({' '.join(['raw', *order])}): raw "
                    f"{row['raw']:,.0f}, old {row['old']:,.0f}, new {row['new']:,.0f} groups/s; "
                    f"new/old {row['new'] / row['old']:.3f}",
                    flush=True,
                )
            if args.profile:  # one more run of each version, outside the figures
                for label in ("old", "new"):
                    client.flushdb()
                    prefix = Path(args.profile).resolve() / label
                    prefix.parent.mkdir(parents=True, exist_ok=True)
                    run_once(trees[label], roots[label], "ours", server.url, args.groups, profile=prefix)
            client.close()
    report(args, runs)
    if args.profile:
        print_profiles(Path(args.profile))


def run_once(
    tree: Path, root: Path, way: str, url: str, n: int, profile: Path | None = None
) -> tuple[float, float]:
    """One run of ``way`` from ``tree``: start the producer (which prepares the database),
    then the consumer, tell both to go, and return groups/s and the two children's CPU
    µs per group (user + system: less sensitive than wall time to other jobs' load)."""
    env = os.environ | {"PYTHONPATH": str(root)} | ({PROFILE_ENV: str(profile)} if profile else {})
    children = {}
    try:
        for role in ("producer", "consumer"):  # the producer's setup feeds first
            child = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    str(tree / "bench"),
                    role,
                    way,
                    url,
                    str(n),
                ],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            children[role] = child
            ready = read_line(child, role)
            if not str(ready.get("module", "")).startswith(str(tree)):
                raise RuntimeError(
                    f"{role} imported rollstream.shared from {ready.get('module')}, not {tree}"
                )
        for child in children.values():
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        done = {role: read_line(child, role) for role, child in children.items()}
        for child in children.values():
            child.wait(timeout=30)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
    consumer = done["consumer"]
    if consumer["tokens"] != consumer["expected"]:
        raise RuntimeError(
            f"{way} from {tree}: the consumer touched {consumer['tokens']} tokens for {n} groups"
        )
    wall = consumer["end"] - min(done["producer"]["start"], consumer["start"])
    return n / wall, (done["producer"]["cpu_s"] + consumer["cpu_s"]) / n * 1e6


def read_line(child: subprocess.Popen[str], role: str) -> dict[str, Any]:
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"the {role} child exited with {child.wait()} (its stderr is above)")
    reply: dict[str, Any] = json.loads(line)
    return reply


# --- the child: one side of one way, from one tree ---------------------------------------


def child_main(bench_dir: str, role: str, way: str, url: str, n: int) -> None:
    sys.path.insert(0, bench_dir)  # that tree's bench/buffer.py, common.py, workload.py
    import redis

    buffer: Any = importlib.import_module("buffer")  # that tree's, whatever it holds

    from rollstream.shared import buffer as shared_buffer

    if role == "producer":
        client = redis.Redis.from_url(url)
        buffer.prepare(client, buffer.bench_settings(url), way, n)
        client.close()
    fields = buffer.group_fields(buffer.RESPONSE_TOKENS) if way == "raw" else {}
    loop = buffer.SIDES[way, role](url, n, fields)
    print(json.dumps({"ready": True, "module": str(Path(shared_buffer.__file__).resolve())}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    profile = os.environ.get(PROFILE_ENV)
    profiler = cProfile.Profile() if profile else None
    start, cpu = time.monotonic(), cpu_s()  # CLOCK_MONOTONIC: comparable across processes
    if profiler:
        profiler.enable()
    tokens = loop()
    if profiler:
        profiler.disable()
    end, cpu = time.monotonic(), cpu_s() - cpu
    if profiler:
        profiler.dump_stats(f"{profile}_{role}.prof")
    expected = n * buffer.SAMPLES * buffer.RESPONSE_TOKENS if role == "consumer" else 0
    print(
        json.dumps({"start": start, "end": end, "cpu_s": cpu, "tokens": tokens, "expected": expected}),
        flush=True,
    )


# --- the trees -----------------------------------------------------------------------------


def tree_of(spec: str, into: Path) -> Path:
    """A folder: itself. Else a commit of this repository, extracted into ``into``."""
    if Path(spec).is_dir():
        return Path(spec).resolve()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", spec], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def import_root(tree: Path, root: Path) -> Path:
    """A folder whose ``rollstream`` package is ``tree``'s: its __init__.py and a link
    per sub-package, from pyproject's package-dir and the links in tree/rollstream."""
    package = root / "rollstream"
    package.mkdir(parents=True)
    (package / "__init__.py").write_bytes((tree / "rollstream" / "__init__.py").read_bytes())
    parts: dict[str, Path] = {}
    for entry in (tree / "rollstream").iterdir():
        if entry.is_dir():
            parts[entry.name] = entry.resolve()
    pyproject = tomllib.loads((tree / "pyproject.toml").read_text())
    package_dir = pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    for name, folder in package_dir.items():
        if name.count(".") == 1 and name.startswith("rollstream."):
            parts[name.split(".", 1)[1]] = (tree / folder).resolve()
    for name, target in parts.items():
        (package / name).symlink_to(target, target_is_directory=True)
    return root


# --- reporting ------------------------------------------------------------------------------


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    def span(values: list[float], fmt: str = ".3f") -> str:
        return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}..{max(values):{fmt}}]"

    old_raw = [r["old"] / r["raw"] for r in runs]
    new_raw = [r["new"] / r["raw"] for r in runs]
    new_old = [r["new"] / r["old"] for r in runs]
    print(f"\nmedian [min..max] over {len(runs)} repeats of {args.groups} groups (8 x 2,048 + 512 tokens):")
    for label in ("raw", "old", "new"):
        print(f"  {label:<4} groups/s {span([r[label] for r in runs], ',.0f')}")
    print(f"  old / raw  {span(old_raw)}")
    print(f"  new / raw  {span(new_raw)}")
    print(f"  new / old  {span(new_old)}   (per repeat: {', '.join(f'{x:.3f}' for x in new_old)})")
    print("CPU µs per group, producer + consumer processes (getrusage):")
    for label in ("raw", "old", "new"):
        print(f"  {label:<4} {span([r[f'{label}_cpu_us'] for r in runs], ',.0f')}")
    cpu_ratio = [r["new_cpu_us"] / r["old_cpu_us"] for r in runs]
    print(f"  new / old  {span(cpu_ratio)}   (per repeat: {', '.join(f'{x:.3f}' for x in cpu_ratio)})")
    print(f"  load average at the start of each repeat: {', '.join(r['load'] for r in runs)}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"old": args.old, "new": args.new, "runs": runs}, indent=2) + "\n"
        )


def print_profiles(folder: Path) -> None:
    for role in ("producer", "consumer"):
        for label in ("old", "new"):
            out = io.StringIO()
            path = folder / f"{label}_{role}.prof"
            pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(25)
            print(f"--- cProfile: {label} {role} (by own time; {path}) ---\n{out.getvalue()}")


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="a commit of this repository, or a folder holding a checkout")
    parser.add_argument("new", help="a commit of this repository, or a folder holding a checkout")
    parser.add_argument("--groups", type=int, default=2_000, help="groups per run")
    parser.add_argument("--repeats", type=int, default=7, help="repeats of raw, old, new (order alternating)")
    parser.add_argument("--json", help="also write every run's groups/s to this file")
    parser.add_argument("--profile", help="then cProfile one more run of each version into this folder")
    return parser.parse_args()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]))
    else:
        main()
