"""Prometheus metrics on a real redis-server: a producer counts what it produces, a
weight sync's latency and the admission waits; `rollstream metrics` serves the run's
Redis-side figures as a process of its own and stops with the run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import redis

from rollstream.producer.assembly import build_producer
from rollstream.shared import telemetry
from rollstream.shared.embedded import EmbeddedRedis, free_port
from rollstream.shared.events import STOP, WEIGHT_SYNC, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import prompts, wait_for, wait_for_async

pytestmark = pytest.mark.integration


def value(name: str, **labels: str) -> float:
    return telemetry.REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_producer_counts_groups_tokens_latencies_syncs_and_admission_waits(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": "math", "n": 2}],
        engines={"count": 2, "sim": {"time_compression": 50.0, "median_tokens": 100, "sigma": 0.5}},
        # the bound admits 4 groups at step 0: the other 4 prompts wait for the sync
        rollout={"mode": "async", "batch_size": 4, "max_staleness": 0},
        producer={"max_tokens": 400, "is_valid": "keep_all", "heartbeat_s": 0.2, "max_inflight": 16},
    )
    client = redis.Redis.from_url(redis_server.url)
    open_buffer(client, settings, "feed").feed(prompts("math", 8))
    telemetry.identify(run_name, "producer")
    producer = build_producer(client, settings, name="p1")
    me = {"run": run_name, "role": "producer"}
    math = {**me, "task": "math"}

    async def scenario() -> None:
        stop = asyncio.Event()
        run = asyncio.create_task(producer.run(stop))
        done = {**math, "outcome": "completed"}
        await wait_for_async(lambda: value("rollstream_groups_produced_total", **done) == 4, timeout=30)
        await wait_for_async(lambda: value("rollstream_admission_waits_total", **math) > 0, timeout=30)
        assert value("rollstream_inflight_groups", **me) == 0
        RunControl(client, Keys(run_name)).publish(WEIGHT_SYNC, 1)
        await wait_for_async(lambda: value("rollstream_groups_produced_total", **done) == 8, timeout=30)
        stop.set()
        await run

    asyncio.run(scenario())
    assert value("rollstream_samples_produced_total", **math, outcome="completed") == 16
    assert value("rollstream_generated_tokens_total", **math) > 0
    assert value("rollstream_group_generation_seconds_count", **math) == 8
    assert value("rollstream_judge_seconds_count", **math) == 8
    assert value("rollstream_weight_sync_seconds_count", **me) == 1
    assert 0 <= value("rollstream_weight_sync_seconds_sum", **me) < 30
    assert value("rollstream_engine_reload_seconds_count", **me) == 1
    assert value("rollstream_process_model_step", **me) == 1
    assert value("rollstream_inflight_requests", **me, engine="0") == 0


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def env_for(url: str, run: str, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS", "PORT"))}
    return {**base, "ROLLSTREAM_REDIS__URL": url, "ROLLSTREAM_RUN": run, **extra}


def start(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollstream.cli.main", "metrics"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _answers(port: int) -> str | None:
    try:
        return scrape(port)
    except OSError:
        return None


def test_the_metrics_process_serves_the_run_on_PORT_and_stops_with_it(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    port = free_port()
    env = env_for(redis_server.url, run_name, PORT=str(port), ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]')
    proc = start(env)
    try:
        client = redis.Redis.from_url(redis_server.url)
        settings = load_settings(
            run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}]
        )
        open_buffer(client, settings, "feed").feed(prompts("math", 6))
        fed = f'rollstream_progress_fed_total{{run="{run_name}",task="math"}} 6.0'
        body = wait_for(lambda: (b := _answers(port)) is not None and fed in b and b, timeout=60)
        assert f'rollstream_run_up{{run="{run_name}"}} 1.0' in body
        assert f'rollstream_stream_prompts_lag{{run="{run_name}",task="math"}} 6.0' in body
        assert "process_cpu_seconds_total" in body  # the process's own figures beside the run's
        RunControl(client, Keys(run_name)).publish(STOP)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert f"metrics starting: run '{run_name}'" in out


def test_the_metrics_process_without_a_port_says_how_to_give_one(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", "metrics"],
        env=env_for(redis_server.url, run_name), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        "no metrics port: set metrics.port (ROLLSTREAM_METRICS__PORT) or $PORT" in done.stderr + done.stdout
    )


def test_the_scrape_cost_benchmark_at_smoke_size(tmp_path: Path) -> None:
    """bench/metrics_scrape.py as `make bench` runs it: one pipelined round trip a scrape,
    whatever the number of producers (its timing lives in the benchmark's output)."""
    env = {**os.environ, "ROLLSTREAM_BENCH_RESULTS": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "bench/metrics_scrape.py", "--quick"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "metrics_scrape.json").read_text())
    by = result["by_producers"]
    assert by["1"]["commands_per_scrape"] == by["64"]["commands_per_scrape"]  # not one per producer
    assert result["redis_us_per_scrape_64"] > 0
