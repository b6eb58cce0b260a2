"""What one Prometheus scrape of ``rollstream metrics`` costs Redis, at 1 and at 64 producers.

The run collector (shared/runmetrics.py) reads the run's Redis-side figures once per
scrape, in one pipelined round trip, whatever the number of producers. Here a run of two
tasks on a real redis-server, with prompts fed, claims pending under each producer,
completed groups, a batch read by the trainer and a heartbeat per producer, is scraped
again and again; Redis' own time per scrape is the sum of INFO commandstats' usec over
the scrapes (CONFIG RESETSTAT first), the client's wall time per scrape beside it.
Goal: under 1 ms of Redis time per scrape at 64 producers.

    .venv/bin/python bench/metrics_scrape.py            # ~10 s
    .venv/bin/python bench/metrics_scrape.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import redis
from common import RESULTS, table, write_json

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.records import Group, Prompt, Sample
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.runmetrics import RunCollector
from rollstream.shared.settings import load_settings

TASKS = ("math", "code")
GOAL_US = 1000.0


def group(prompt: Prompt) -> Group:
    samples = [
        Sample([1, 2, 3], list(range(64)), [-0.5] * 64, [0] * 64, "stop", reward={"score": float(i % 2)})
        for i in range(4)
    ]
    return Group.for_prompt(prompt, samples=samples)


def populate(url: str, run: str, producers: int) -> None:
    """Per task: 2,000 prompts fed, 8 claims pending under each producer, 256 groups
    completed, 64 of them read by the trainer; a heartbeat per producer."""
    settings = load_settings(run=run, redis={"url": url}, tasks=[{"name": t, "n": 4} for t in TASKS])
    client = redis.Redis.from_url(url)
    control = RunControl(client, Keys(run))
    for task in TASKS:
        feeder = open_buffer(client, settings, "feeder")
        feeder.feed([Prompt(uid=f"{task}-{i}", task=task, prompt=f"q{i}") for i in range(2000)])
        maker = open_buffer(client, settings, "maker")
        for claim in maker.claim(task, 256):
            maker.complete(claim, group(claim.prompt))
        for p in range(producers):
            open_buffer(client, settings, f"producer-{p}").claim(task, 8)
        open_buffer(client, settings, "trainer").read_batch(task, 64)
    for p in range(producers):
        control.publish_status(f"producer-{p}", 0, 8)
    client.close()


def measure(url: str, run: str, scrapes: int) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    collector = RunCollector(client, Keys(run), list(TASKS), producer_max_age_s=3600)
    for _ in range(20):  # warm up: connections, scripts, caches
        list(collector.collect())
    client.config_resetstat()
    walls = []
    for _ in range(scrapes):
        started = time.perf_counter()
        families = list(collector.collect())
        walls.append(time.perf_counter() - started)
    stats = client.info("commandstats")
    client.close()
    usec = sum(v["usec"] for k, v in stats.items() if k != "cmdstat_config")
    calls = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_config")
    up = next(f for f in families if f.name == "rollstream_run_up").samples[0].value
    assert up == 1.0, "the collector could not read the run"
    return {
        "redis_us_per_scrape": usec / scrapes,
        "commands_per_scrape": calls / scrapes,
        "wall_ms_per_scrape": 1000 * statistics.median(walls),
        "families": len(families),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer scrapes")
    parser.add_argument("--scrapes", type=int, default=500)
    args = parser.parse_args()
    scrapes = 50 if args.quick else args.scrapes
    server = EmbeddedRedis().start()
    try:
        results = {}
        for producers in (1, 64):
            run = f"bench-metrics-{producers}"
            populate(server.url, run, producers)
            results[producers] = measure(server.url, run, scrapes)
    finally:
        server.stop()
    at_64 = results[64]["redis_us_per_scrape"]
    out = {
        "machine": platform.node(),
        "scrapes": scrapes,
        "tasks": len(TASKS),
        "by_producers": {str(k): v for k, v in results.items()},
        "redis_us_per_scrape_64": at_64,
        "growth_1_to_64": at_64 / results[1]["redis_us_per_scrape"],
        "goal_us": GOAL_US,
    }
    write_json(out, RESULTS / "metrics_scrape.json")
    print(
        table(
            ["producers", "Redis µs / scrape", "commands / scrape", "wall ms / scrape"],
            [
                [
                    k,
                    f"{v['redis_us_per_scrape']:.0f}",
                    f"{v['commands_per_scrape']:.0f}",
                    f"{v['wall_ms_per_scrape']:.2f}",
                ]
                for k, v in results.items()
            ],
        )
    )
    print(f"at 64 producers: {at_64:.0f} µs of Redis time per scrape (goal < {GOAL_US:.0f})")
    return 0 if at_64 < GOAL_US else 1


if __name__ == "__main__":
    raise SystemExit(main())
