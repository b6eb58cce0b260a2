"""rollstream processes as a process manager runs them: stopped with SIGTERM, paused,
resumed and stopped from another process, refused on settings that disagree with the
run's, kept off a Ray cluster that is not the run's, and probed with check --engines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

SLOW_ENGINES = {
    "ROLLSTREAM_TASKS": '[{"name": "math", "n": 2}]',
    "ROLLSTREAM_ENGINES__COUNT": "1",
    "ROLLSTREAM_ENGINES__NUM_CPUS": "0",
    "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "2",
    "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "400",
    "ROLLSTREAM_ENGINES__SIM__SPEED_TPS": "200",
    "ROLLSTREAM_ROLLOUT__BATCH_SIZE": "1000",
    "ROLLSTREAM_PRODUCER__IS_VALID": "keep_all",
    "ROLLSTREAM_PRODUCER__MAX_INFLIGHT": "6",
    "ROLLSTREAM_PRODUCER__HEARTBEAT_S": "0.2",
    "ROLLSTREAM_PROCESS__PROGRESS_S": "0.5",
    "ROLLSTREAM_BUFFER__CLAIM_IDLE_MS": "600000",  # nothing may rely on a reclaim here
}


def env_for(url: str, run: str, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS"))}
    return {**base, "ROLLSTREAM_REDIS__URL": url, "ROLLSTREAM_RUN": run, **SLOW_ENGINES, **extra}


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollstream.cli.main", *args]


def run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(*args), env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fed(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> dict[str, str]:
    env = env_for(redis_server.url, run_name)
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(40))
    )
    done = run(env, "feed", str(path), "--task", "math")
    assert done.returncode == 0, done.stderr
    return env


@pytest.fixture
def client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


def pending(client: redis.Redis, key: str) -> int:
    return int(client.xpending(key, "producers")["pending"])


def spawn(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_sigterm_stops_a_producer_at_once_and_it_hands_its_claims_back(
    fed: dict[str, str], client: redis.Redis, run_name: str
) -> None:
    keys = Keys(run_name)
    with spawn(fed, "produce", "--local-engines") as producer:
        # Given a producer with groups in flight (long generations: none finishes soon)
        wait_for(
            lambda: producer.poll() is not None or pending(client, keys.prompts("math")) >= 3, timeout=60
        )
        assert producer.poll() is None, producer.communicate()[1][-3000:]
        # When it gets SIGTERM
        producer.send_signal(signal.SIGTERM)
        _, err = producer.communicate(timeout=30)
    # Then it exits 0 and holds nothing: its claims went back to the aborted pool with
    # their tokens (partial mode), so nobody waits claim_idle_ms (10 minutes here) for them
    assert producer.returncode == 0, err[-3000:]
    assert "SIGTERM received" in err
    assert pending(client, keys.prompts("math")) == 0
    aborted = client.xrange(keys.aborted("math"))
    assert aborted, "in-flight groups were not handed back"
    status = orjson.loads(run(fed, "status", "--json").stdout)
    assert status["accounts"]["math"]["lost"] == 0
    assert status["processes"] == []  # its heartbeat key went with it


def test_pause_parks_the_work_resume_goes_on_and_stop_ends_the_producer(
    fed: dict[str, str], client: redis.Redis, run_name: str
) -> None:
    keys = Keys(run_name)
    control = RunControl(client, keys)
    with spawn(fed, "produce", "--local-engines") as producer:
        wait_for(
            lambda: producer.poll() is not None or pending(client, keys.prompts("math")) >= 3, timeout=60
        )
        assert producer.poll() is None
        # When the run is paused from another process
        assert run(fed, "pause").returncode == 0
        # Then the producer parks its in-flight groups and claims nothing more
        wait_for(
            lambda: pending(client, keys.prompts("math")) == 0 and pending(client, keys.aborted("math")) == 0,
            timeout=30,
        )
        status = orjson.loads(run(fed, "status", "--json").stdout)
        assert status["paused"] is True
        (beat,) = [p for p in status["processes"] if p["role"] == "producer"]
        wait_for(lambda: control.paused(), timeout=5)
        unclaimed = client.xlen(keys.prompts("math")) + client.xlen(keys.aborted("math"))
        assert unclaimed == 40 - client.xlen(keys.groups("math"))  # everything not done is back
        assert beat["detail"]["inflight"] >= 0
        # When it is resumed, Then it claims again
        assert run(fed, "resume").returncode == 0
        wait_for(lambda: pending(client, keys.prompts("math")) + pending(client, keys.aborted("math")) > 0,
                 timeout=30)  # fmt: skip
        assert control.paused() is False
        # When the run is stopped, Then the producer ends by itself with exit 0
        assert run(fed, "stop").returncode == 0
        _, err = producer.communicate(timeout=30)
    assert producer.returncode == 0, err[-3000:]
    assert "run paused" in err and "run resumed" in err and "stops" in err


def test_a_process_with_settings_that_differ_from_the_run_is_refused(
    fed: dict[str, str], run_name: str
) -> None:
    # Given a run whose settings were published by its first process (the feed above)
    different = {**fed, "ROLLSTREAM_ROLLOUT__MAX_STALENESS": "4"}
    # When a producer with another max_staleness starts
    done = run(different, "produce", "--local-engines", "--burst")
    # Then it refuses, naming the setting and both values
    assert done.returncode == 2, done.stderr[-2000:]
    assert "rollout.max_staleness (ROLLSTREAM_ROLLOUT__MAX_STALENESS)" in done.stderr
    assert "this process has 4, the run has 1" in done.stderr


@pytest.mark.usefixtures("ray_local")
def test_a_producer_never_attaches_to_a_ray_cluster_that_is_not_the_runs(
    fed: dict[str, str],
) -> None:
    import ray

    # Given a Ray cluster on this machine (this test session's) that the run never recorded,
    # even named in RAY_ADDRESS
    stray = str(ray.get_runtime_context().gcs_address)
    env = {**fed, "RAY_ADDRESS": stray, "ROLLSTREAM_PROCESS__WAIT_TIMEOUT_S": "2"}
    # When a producer of the run starts, Then it waits for the run's own address and gives up
    done = run(env, "produce")
    assert done.returncode == 4, done.stderr[-2000:]
    assert "gave up waiting for the Ray address of run" in done.stderr
    assert "Connecting to existing Ray cluster" not in done.stderr


def test_engines_process_check_engines_and_sigterm(
    fed: dict[str, str], client: redis.Redis, run_name: str
) -> None:
    control = RunControl(client, Keys(run_name))
    env = {**fed, "ROLLSTREAM_ENGINES__COUNT": "2"}
    with spawn(env, "engines", "--foreground") as engines:
        # Given the engines process, which starts a Ray of its own and records its address
        wait_for(lambda: engines.poll() is not None or control.ray_address(), timeout=90)
        assert engines.poll() is None, engines.communicate()[1][-3000:]
        wait_for(lambda: _alive(client, run_name, "engines"), timeout=60)  # beats once they are ready
        # When check --engines probes them, Then both answer
        checked = run(env, "check", "--engines")
        assert checked.returncode == 0, checked.stderr[-2000:]
        assert "engine 0 answers" in checked.stdout and "engine 1 answers" in checked.stdout
        # When the engines process gets SIGTERM, Then it removes its actors and exits 0
        engines.send_signal(signal.SIGTERM)
        _, err = engines.communicate(timeout=60)
    assert engines.returncode == 0, err[-3000:]
    assert "removed 2 engine actors" in err
    assert control.ray_address() == ""  # producers of the run will wait for a new one
    # and a check now fails, naming what is missing
    checked = run(env, "check", "--engines")
    assert checked.returncode != 0
    assert "no Ray address" in checked.stderr


def _alive(client: redis.Redis, run: str, role: str) -> bool:
    return any(True for _ in client.scan_iter(match=f"{Keys(run).alive_pattern[:-1]}{role}:*"))


def test_sigterm_after_redis_went_away_is_a_clean_exit(run_name: str, tmp_path: Path) -> None:
    """A process manager stopping everything at once may stop Redis first: a producer with
    groups in flight then gets SIGTERM with no Redis to hand its claims back to. It says
    so and exits 0, promptly (its claims stay pending in Redis' data, reclaimed after
    claim_idle_ms once Redis is back)."""
    server = EmbeddedRedis().start()
    try:
        env = env_for(server.url, run_name, ROLLSTREAM_REDIS__OUTAGE_LIMIT_S="60")
        path = tmp_path / "p.jsonl"
        path.write_text(
            "".join(f'{{"uid": "q{i}", "prompt": "What is {i}?", "answer": "{i}"}}\n' for i in range(20))
        )
        assert run(env, "feed", str(path), "--task", "math").returncode == 0
        watcher = redis.Redis.from_url(server.url)
        with spawn(env, "produce", "--local-engines") as producer:
            wait_for(
                lambda: producer.poll() is not None or pending(watcher, Keys(run_name).prompts("math")) >= 3,
                timeout=60,
            )
            assert producer.poll() is None, producer.communicate()[1][-3000:]
            watcher.close()
            server.stop()
            producer.send_signal(signal.SIGTERM)
            _, err = producer.communicate(timeout=60)
    finally:
        server.stop()
    assert producer.returncode == 0, err[-3000:]
    assert "SIGTERM received" in err
