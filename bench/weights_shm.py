"""The shm weight transport against the file transport on tmpfs and a plain memory copy of
the same bytes, side by side in one run (bench/weight_transports.py measures each the
same way: the trainer's send, then the hf engine's load, event to live, its weights
checked equal to the trainer's after every sync):

  anchor            a host memcpy of the model's bytes (on a GPU: pinned device -> host
                    -> device, the floor for engines on the trainer's node)
  file shm          safetensors shards on /dev/shm, all tensors
  file shm changed  the same, a step that changed half of the tensors (changed_only)
  shm               the shared-memory transport, all tensors
  shm changed       the same, half of the tensors changed

Prints each way's seconds and its ratio to the anchor, then shm over file.

    .venv/bin/python bench/weights_shm.py --quick          # a tiny model, seconds
    .venv/bin/python bench/weights_shm.py                  # ~64 MB of fp32
    .venv/bin/python bench/weights_shm.py --size 0.5b      # ~2 GB: ~10 GB of memory at peak
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json
from hf_decode import RESULTS, table
from weight_transports import measure

WAYS = ["file shm", "file shm changed", "shm", "shm changed"]


def ratios(result: dict[str, Any]) -> list[list[str]]:
    ways = result["ways"]
    rows = [
        ["", "shm / file shm (all tensors)", f"{ways['shm']['total_s'] / ways['file shm']['total_s']:.2f}"]
    ]
    rows.append(["", "shm changed / file shm changed",
                 f"{ways['shm changed']['total_s'] / ways['file shm changed']['total_s']:.2f}"])  # fmt: skip
    return rows


def report(results: list[dict[str, Any]]) -> str:
    rows = [["model", "way", "send s", "load s", "x anchor", "exact"]]
    for r in results:
        a = r["anchor"]
        rows.append([f"{r['size']} ({r['gb']:.3f} GB, {r['device']})", f"anchor: {a['what']}",
                     f"{a['seconds']:.4f}", "", "1.00", ""])  # fmt: skip
        for name, w in r["ways"].items():
            rows.append(["", name, f"{w['send_s']:.4f}", f"{w['load_s']:.4f}", f"{w['over_anchor']:.2f}",
                         "yes" if w["exact"] else "NO"])  # fmt: skip
        rows += [[a, b, c, "", "", ""] for a, b, c in ratios(r)]
    return table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="small", help="comma-separated: tiny, small, 0.5b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the tiny model, 3 repeats")
    parser.add_argument("--out", type=Path, default=RESULTS / "weights_shm.json")
    args = parser.parse_args()
    if args.quick:
        args.size, args.repeats = "tiny", 3
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.size.split(","):
            results.append(measure(size, args.device, args.dtype, args.repeats, False, Path(tmp), only=WAYS))
    print(report(results))
    write_json({"machine": platform.node(), "cpus": os.cpu_count(), "results": results}, args.out)


if __name__ == "__main__":
    main()
