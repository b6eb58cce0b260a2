"""Garbage in the places the decoding boundary does not cover by itself: a producer
heartbeat in the state hash, a progress counter that status shows, an eval result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rollstream.cli.status import run_status
from rollstream.consumer.assembly import create_coordinator
from rollstream.shared import codec
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts

pytestmark = pytest.mark.integration


def test_an_unreadable_producer_heartbeat_is_dropped_not_a_crash(
    real_client: redis.Redis, run_name: str
) -> None:
    control = RunControl(real_client, Keys(run_name))
    control.publish_status("good", 3, 1)
    real_client.hset(Keys(run_name).state, "producer:bad", b"\xff not json")
    assert [b.producer for b in control.producers(max_age_s=60)] == ["good"]
    assert real_client.hget(Keys(run_name).state, "producer:bad") is None


def test_status_shows_a_corrupt_counter_instead_of_crashing(real_client: redis.Redis, run_name: str) -> None:
    keys = Keys(run_name)
    real_client.hset(keys.progress, mapping={"math:fed": "abc", "math:consumed": 2})
    real_client.hset(keys.state, "model_step", "x")
    status = run_status(real_client, keys)
    assert status.progress["math:fed"] == -1 and status.progress["math:consumed"] == 2
    assert status.model_step == -1


def test_an_undecodable_eval_result_is_dead_lettered_and_the_rest_kept(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory
) -> None:
    settings = make_settings(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    coordinator = create_coordinator(settings, client=client)
    keys = coordinator.keys
    (prompt,) = prompts("math", 1)
    client.xadd(keys.eval("b1"), codec.encode_group(group_for(prompt)))  # type: ignore[arg-type]
    client.xadd(keys.eval("b1"), {"group_id": "math:u9", "meta": b"\xff"})
    (good,) = coordinator._eval_results("b1")
    assert good.group_id == prompt.group_id
    ((_, dead),) = client.xrange(keys.dead)
    assert dead[b"group_id"] == b"math:u9" and b"undecodable" in dead[b"reason"]
    assert client.xlen(keys.eval("b1")) == 1


def test_a_key_of_the_wrong_type_is_one_line_not_a_traceback(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.set(Keys(run_name).fed("math"), "not a set")  # written by hand with redis-cli
    path = tmp_path / "p.jsonl"
    path.write_text('{"uid": "a", "prompt": "What is 1 + 1?"}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=redis_server.url,
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
    )
    done = subprocess.run(
        [sys.executable, "-m", "rollstream.cli.main", "feed", str(path), "--task", "math"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "Redis refused a command" in done.stderr and "WRONGTYPE" in done.stderr
    assert "Traceback" not in done.stderr
