"""How fast do weights move from the trainer to an engine? Each weight transport
(shared/transports.py) for a random Qwen2 of a given size, side by side in one run with
the machine's own memory-copy bandwidth (the anchor: on a CPU a host memcpy of the same
bytes; on a GPU a pinned device -> host -> device copy):

  safetensors (today)   safetensors.save_model to one file on disk, the engine reloads it
  file disk             the file transport on a disk folder (4 shards written in parallel)
  file shm              the same on /dev/shm (tmpfs: trainer and engines on one node)
  file shm changed      the same, a step that changed half of the tensors (changed_only)
  shm                   a shared-memory buffer on /dev/shm (page-locked on CUDA), double-buffered
  shm changed           the same, a step that changed half of the tensors (changed_only)
  collective            a gloo broadcast from the trainer over a group formed per fetch
  ray                   buckets in Ray's object store (when Ray is installed and --ray)

For each: the trainer's send (seconds), the engine's load (HFEngine.update_weights: read
and copy in between two decode steps, i.e. event to live), their sum in seconds per GB
and over the anchor's. Medians over --repeats; the engine's weights are checked equal
to the trainer's after every sync.

    .venv/bin/python bench/weight_transports.py --size 0.5b      # ~2 GB of fp32
    .venv/bin/python bench/weight_transports.py --quick          # a small model, no Ray

Needs torch and transformers (Ray only for the ray row).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_decode import RESULTS, SIZES, random_model, table

SIZES = {
    **SIZES,
    # ~64 MB of fp32: a few seconds anywhere
    "small": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 1024, "vocab": 32_000},
}


def nbytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def anchor(tensors: dict[str, Any], device: torch.device, repeats: int) -> dict[str, float]:
    """Seconds to copy these bytes the fastest plain way: host memcpy on a CPU, pinned
    device -> host -> device on a GPU."""
    times = []
    if device.type == "cuda":
        host = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for n, t in tensors.items()}
        back = {n: torch.empty_like(t) for n, t in tensors.items()}
        for _ in range(repeats + 1):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            for n, t in tensors.items():
                host[n].copy_(t, non_blocking=True)
            torch.cuda.synchronize(device)
            for n, t in host.items():
                back[n].copy_(t, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        what = "pinned device -> host -> device"
    else:
        copies = {n: torch.empty_like(t) for n, t in tensors.items()}
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for n, t in tensors.items():
                copies[n].copy_(t)
            times.append(time.perf_counter() - started)
        what = "host memcpy"
    seconds = statistics.median(times[1:])
    return {"seconds": seconds, "gb_per_s": nbytes(tensors) / seconds / 1e9, "what": what}  # type: ignore[dict-item]


def perturb(model: Any, fraction: float, step: int) -> None:
    with torch.no_grad():
        params = list(model.parameters())
        for i, p in enumerate(params):
            if fraction >= 1 or (i + step) % 2 == 0:
                p.add_(0.001)


def same(engine: Any, trainer: Any) -> bool:
    mine, theirs = engine.model.state_dict(), trainer.state_dict()
    return all(torch.equal(mine[k], theirs[k].to(mine[k].dtype).to(mine[k].device)) for k in mine)


def measure(
    size: str, device: str, dtype: str, repeats: int, use_ray: bool, work: Path, only: list[str] | None = None
) -> dict[str, Any]:
    """Every way (or those named in ``only``) for the random model of ``size``."""
    from transformers import AutoModelForCausalLM

    from rollstream.producer.engines.hf import HFEngine
    from rollstream.shared.engine_settings import HFEngineSettings
    from rollstream.shared.transport_auto import shm_available
    from rollstream.shared.transports import TransportSettings, sender_for, unique_tensors

    directory = random_model(work / f"model-{size}", SIZES[size])
    dev = torch.device(device)
    loaded: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    trainer: Any = loaded.to(dev)
    engine = HFEngine(HFEngineSettings(model=str(directory), device=device, dtype=dtype))  # type: ignore[arg-type]
    tensors = unique_tensors(trainer.state_dict())
    total = nbytes(tensors)
    result: dict[str, Any] = {"size": size, "gb": total / 1e9, "device": device, "engine_dtype": dtype}
    result["anchor"] = anchor(tensors, dev, repeats)
    ways: dict[str, tuple[str, dict[str, Any], float]] = {
        "file disk": ("file", {"dir": str(work / "disk")}, 1.0),
        "file shm": ("file", {"dir": str(shm(work) / "shm")}, 1.0),
        "file shm changed": (
            "file",
            {"dir": str(shm(work) / "delta"), "changed_only": True, "full_every": 0},
            0.5,
        ),
    }
    ways["collective"] = ("collective", {"bucket_mb": 256}, 1.0)
    if use_ray:
        ways["ray"] = ("ray", {"bucket_mb": 256}, 1.0)
    if shm_available():
        ways["shm"] = ("shm", {}, 1.0)
        ways["shm changed"] = ("shm", {"changed_only": True}, 0.5)
    if only is not None:
        ways = {k: v for k, v in ways.items() if k in only}
    rows: dict[str, Any] = {}
    step = 0

    def load(uri: str) -> float:
        nonlocal step
        step += 1
        started = time.perf_counter()
        asyncio.run(engine.update_weights(step, uri))
        return time.perf_counter() - started

    # today's path: one safetensors file written by safetensors, the engine reads it all
    from safetensors.torch import save_model

    sends, loads = [], []
    for r in range(repeats if only is None or "safetensors (today)" in only else 0):
        perturb(trainer, 1.0, r)
        path = work / "today" / f"step-{r}"
        path.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        save_model(trainer, str(path / "model.safetensors"))
        sends.append(time.perf_counter() - started)
        loads.append(load(str(path)))
        shutil.rmtree(path)
    if sends:
        rows["safetensors (today)"] = summary(
            sends, loads, total, result["anchor"]["seconds"], same(engine, trainer)
        )
    for name, (kind, options, fraction) in ways.items():
        settings = TransportSettings(kind=kind, keep=2, **options)  # type: ignore[arg-type]
        sender = sender_for(settings, str(work / "out"), run="bench")
        sends, loads, exact = [], [], True
        try:
            # a first full send: a changed-only step then has a base
            sender.send(0, unique_tensors(trainer.state_dict()))
            load_base = load(sender.send(1, unique_tensors(trainer.state_dict())))
            del load_base
            for r in range(repeats):
                perturb(trainer, fraction, r)
                started = time.perf_counter()
                uri = sender.send(2 + r, unique_tensors(trainer.state_dict()))
                sends.append(time.perf_counter() - started)
                loads.append(load(uri))
                exact = exact and same(engine, trainer)
        finally:
            sender.close()
            if kind == "file":  # the folder and the temporary one shm() made for it
                parent = Path(settings.dir).parent
                shutil.rmtree(parent if parent.name.startswith("rollstream-bench-") else settings.dir,
                              ignore_errors=True)  # fmt: skip
            del sender
            gc.collect()
        rows[name] = summary(sends, loads, total, result["anchor"]["seconds"], exact)
        gc.collect()
    engine.stop()
    result["ways"] = rows
    fastest = min(rows, key=lambda k: rows[k]["total_s"])
    result["fastest"] = fastest
    result["fastest_over_anchor"] = rows[fastest]["over_anchor"]
    if "safetensors (today)" in rows:
        result["today_over_fastest"] = rows["safetensors (today)"]["total_s"] / rows[fastest]["total_s"]
    return result


def shm(work: Path) -> Path:
    root = Path("/dev/shm")
    if root.is_dir() and os.access(root, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="rollstream-bench-", dir=root))
    return work


def summary(
    sends: list[float], loads: list[float], total: int, anchor_s: float, exact: bool
) -> dict[str, Any]:
    send, load = statistics.median(sends), statistics.median(loads)
    return {
        "send_s": send,
        "load_s": load,
        "total_s": send + load,
        "s_per_gb": (send + load) / (total / 1e9),
        "over_anchor": (send + load) / anchor_s,
        "exact": exact,
    }


def report(results: list[dict[str, Any]]) -> str:
    rows = [["model", "transport", "send s", "load s", "s / GB", "x anchor", "exact"]]
    for r in results:
        a = r["anchor"]
        rows.append([f"{r['size']} ({r['gb']:.2f} GB, {r['device']})", f"anchor: {a['what']}", "", "",
                     f"{1 / a['gb_per_s']:.3f}", "1.00", ""])  # fmt: skip
        for name, w in r["ways"].items():
            rows.append(["", name, f"{w['send_s']:.3f}", f"{w['load_s']:.3f}", f"{w['s_per_gb']:.3f}",
                         f"{w['over_anchor']:.2f}", "yes" if w["exact"] else "NO"])  # fmt: skip
    return table(rows)


def start_ray() -> bool:
    try:
        import ray
    except ImportError:
        print("ray is not installed: no ray row")
        return False
    if not ray.is_initialized():
        ray.init(include_dashboard=False, num_cpus=1, log_to_driver=False)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="0.5b", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="the ray transport too (starts a local Ray)")
    parser.add_argument("--quick", action="store_true", help="the small model, 2 repeats")
    parser.add_argument("--out", type=Path, default=RESULTS / "weight_transports.json")
    args = parser.parse_args()
    if args.quick:
        args.size, args.repeats = "small", 2
    use_ray = args.ray and start_ray()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.size.split(","):
            results.append(measure(size, args.device, args.dtype, args.repeats, use_ray, Path(tmp)))
    print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "results": results}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
