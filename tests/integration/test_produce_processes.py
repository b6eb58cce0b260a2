"""`rollstream produce` as processes on one run: killed with SIGKILL mid-batch, and two
at once. Nothing is lost, nothing is produced twice."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from tests.helpers import ProducerProcess, rollstream, wait_for

pytestmark = pytest.mark.integration


def producer_env(url: str, run: str) -> dict[str, str]:
    return {
        **os.environ,
        "ROLLSTREAM_REDIS__URL": url,
        "ROLLSTREAM_RUN": run,
        "ROLLSTREAM_TASKS": '[{"name": "math", "n": 2}]',
        "ROLLSTREAM_BUFFER__CLAIM_IDLE_MS": "1500",
        "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "5",
        "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "300",
        "ROLLSTREAM_ROLLOUT__BATCH_SIZE": "1000",
        "ROLLSTREAM_PRODUCER__IS_VALID": "keep_all",
        "ROLLSTREAM_PRODUCER__MAX_INFLIGHT": "8",
        "ROLLSTREAM_PRODUCER__HEARTBEAT_S": "0.2",
    }


def feed(env: dict[str, str], tmp_path: Path, count: int) -> None:
    path = os.path.join(str(tmp_path), "p.jsonl")
    with open(path, "w") as handle:
        for i in range(count):
            handle.write(f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n')
    done = subprocess.run(rollstream("feed", path, "--task", "math"), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def group_uids(client: redis.Redis, run: str) -> list[str]:
    return [f[b"group_id"].decode() for _, f in client.xrange(Keys(run).groups("math"))]


def test_a_producer_killed_mid_batch_loses_no_prompt(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = producer_env(redis_server.url, run_name)
    client = redis.Redis.from_url(redis_server.url)
    feed(env, tmp_path, 30)
    keys = Keys(run_name)
    doomed = ProducerProcess(env, tmp_path, "doomed")
    try:
        # Given a producer in the middle of its work: some groups done, some claimed
        wait_for(
            lambda: (
                doomed.running()
                and client.xlen(keys.groups("math")) >= 3
                and client.xpending(keys.prompts("math"), "producers")["pending"] > 0
            ),
            timeout=60,
        )
    finally:
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait()
    # When another producer works in burst mode
    survivor = subprocess.run(
        rollstream("produce", "--local-engines", "--burst"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert survivor.returncode == 0, survivor.stderr[-2000:]
    # Then every fed prompt is in exactly one group
    uids = Counter(group_uids(client, run_name))
    assert set(uids) == {f"math:q{i}" for i in range(30)}
    assert max(uids.values()) == 1
    assert client.xlen(keys.prompts("math")) == 0


def test_two_producers_share_a_run_without_duplicates(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = producer_env(redis_server.url, run_name)
    client = redis.Redis.from_url(redis_server.url)
    control = RunControl(client, Keys(run_name))
    procs = [ProducerProcess(env, tmp_path, f"p{i}") for i in range(2)]
    try:
        # both are up before there is work, so that both get some
        wait_for(lambda: all(p.running() for p in procs) and len(control.producers(max_age_s=5)) == 2, 60)
        feed(env, tmp_path, 40)
        wait_for(lambda: all(p.running() for p in procs) and len(group_uids(client, run_name)) >= 40, 120)
    finally:
        for p in procs:
            p.proc.send_signal(signal.SIGTERM)
        results = [p.finish() for p in procs]
    assert all(code == 0 for code, _, _ in results), [err[-1500:] for _, _, err in results]
    uids = Counter(group_uids(client, run_name))
    assert len(uids) == 40 and max(uids.values()) == 1
    completed = [int(out.split("completed ")[1].split(",")[0].split(";")[0]) for _, out, _ in results]
    assert sum(completed) == 40
    assert all(c > 0 for c in completed)  # both did work
    assert client.hget(Keys(run_name).progress, "math:completed") == b"40"


def test_a_second_sigterm_is_a_cold_stop_that_hands_claims_back(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    # groups that would take many minutes, and a warm stop that would wait 120 s for them
    env = {
        **producer_env(redis_server.url, run_name),
        "ROLLSTREAM_ENGINES__SIM__SPEED_TPS": "1",
        "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "1",
        "ROLLSTREAM_ROLLOUT__ON_WEIGHT_SYNC": "drain",
        "ROLLSTREAM_PROCESS__STOP_TIMEOUT_S": "240",
    }
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    feed(env, tmp_path, 4)
    producer = ProducerProcess(env, tmp_path, "cold")
    try:
        # Given a producer with groups in flight
        wait_for(
            lambda: producer.running() and client.xpending(keys.prompts("math"), "producers")["pending"] == 4,
            timeout=60,
        )
        # When it gets SIGTERM, starts its warm stop, then gets a second SIGTERM
        producer.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "a second one stops at once" in producer.err.read_text(), timeout=30)
        producer.proc.send_signal(signal.SIGTERM)
        # Then it stops at once (well inside the warm stop's 120 s), exit 0
        code, _, err = producer.finish(timeout=60)
    finally:
        if producer.proc.poll() is None:
            producer.proc.kill()
            producer.proc.wait()
    assert code == 0, err[-2000:]
    assert "cold stop" in err
    # and every claim was handed back: nothing pending, every prompt claimable again
    streams = [keys.prompts("math"), keys.aborted("math")]
    pending = [client.xpending(s, "producers")["pending"] for s in streams if client.exists(s)]
    assert sum(pending) == 0, err[-3000:]
    assert client.xlen(keys.groups("math")) == 0
    left = sum(client.xlen(s) for s in streams)
    assert left == 4
