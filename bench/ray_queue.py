"""B1's second comparison: the same groups carried by ray.util.queue.Queue from a Ray
task to the driver — the way Ray-actor buffers of other frameworks move them — one
record per put / get, and in batches of 64 (put_nowait_batch / get_nowait_batch).

A record is what such buffers hold: a dict of numpy arrays (prompt ids, and per
sample response ids, logprobs, versions) plus its metadata. bench/run_all.py puts
the faster way beside bench/buffer.py's ours (buffer.ratio_vs_ray_queue).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import ray
from common import RESULTS, spread, write_json
from ray.util.queue import Queue
from workload import PROMPT_TOKENS, RESPONSE_TOKENS, SAMPLES, build_group

BATCH = 64


def main() -> None:
    args = parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=2)
    runs: dict[str, list[float]] = {"one": [], "batch64": []}
    for _ in range(args.repeats):  # interleaved, as the machine's load drifts
        runs["one"].append(move(args.groups_one, batch=1))
        runs["batch64"].append(move(args.groups_batch, batch=BATCH))
    ray.shutdown()
    result: dict[str, Any] = {
        "shape": {"samples": SAMPLES, "response_tokens": RESPONSE_TOKENS, "prompt_tokens": PROMPT_TOKENS},
        "groups_per_s": {way: spread(values) for way, values in runs.items()},
        "faster": max(runs, key=lambda w: statistics.median(runs[w])),
    }
    result["faster_groups_per_s"] = result["groups_per_s"][result["faster"]]["median"]
    write_json(result, RESULTS / "ray_queue.json")
    for way, s in result["groups_per_s"].items():
        print(f"ray queue {way:8} {s['median']:8,.0f} groups/s [{s['min']:,.0f}-{s['max']:,.0f}]")
    print(f"faster way: {result['faster']} ({result['faster_groups_per_s']:,.0f} groups/s)")


def record() -> dict[str, Any]:
    group = build_group(0)
    return {
        "group_id": group.group_id,
        "model_step": group.model_step,
        "prompt_ids": group.samples[0].prompt_ids,
        "samples": [
            {
                "response_ids": s.response_ids,
                "logprobs": s.logprobs,
                "versions": s.response_versions,
                "reward": s.reward,
            }
            for s in group.samples
        ],
    }


@ray.remote(num_cpus=0)
def produce(queue: Queue, groups: int, batch: int) -> None:
    item = record()
    for start in range(0, groups, batch):
        n = min(batch, groups - start)
        if batch == 1:
            queue.put(item)
        else:
            while queue.full():
                time.sleep(0.001)
            queue.put_nowait_batch([item] * n)


def move(groups: int, batch: int) -> float:
    """groups/s from the producing task's start to the driver holding the last one."""
    queue = Queue(maxsize=4 * BATCH)
    started = time.perf_counter()
    task = produce.remote(queue, groups, batch)
    tokens = got = 0
    while got < groups:
        if batch == 1:
            items = [queue.get()]
        else:
            items = queue.get_nowait_batch(min(batch, queue.qsize())) if queue.qsize() else []
            if not items:
                time.sleep(0.001)
        for item in items:  # touch the arrays, as a trainer would
            tokens += sum(int(np.asarray(s["response_ids"]).size) for s in item["samples"])
        got += len(items)
    elapsed = time.perf_counter() - started
    ray.get(task)
    queue.shutdown()
    assert tokens == groups * SAMPLES * RESPONSE_TOKENS
    return groups / elapsed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups-one", type=int, default=600, help="groups moved one per put / get")
    parser.add_argument("--groups-batch", type=int, default=3000, help="groups moved in batches of 64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke size")
    args = parser.parse_args()
    if args.quick:
        args.groups_one, args.groups_batch, args.repeats = 60, 256, 1
    return args


if __name__ == "__main__":
    main()
