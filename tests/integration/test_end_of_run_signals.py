"""A process of the run keeps SIGTERM its own through the end of a run: a process manager's
SIGTERM while it joins the Ray cluster, after it left it, or after its rq worker stopped
(waiting for the run's other processes to stop) is a stop, never death by signal, Ray's
sys.exit(15) or rq's cold shutdown."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import STOP, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.liveness import Liveness, live_processes
from tests.helpers import rollstream, wait_for
from tests.integration.test_processes import env_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Logged:
    """A rollstream process with its stderr in a file (read while it runs)."""

    def __init__(self, env: dict[str, str], folder: Path, name: str, *args: str) -> None:
        self.err = folder / f"{name}.err"
        with self.err.open("w") as err:
            self.proc = subprocess.Popen(rollstream(*args), env=env, stdout=subprocess.DEVNULL, stderr=err)

    def says(self, text: str) -> bool:
        assert self.proc.poll() is None, f"exited with {self.proc.returncode}: {self.log()[-3000:]}"
        return text in self.err.read_text()

    def log(self) -> str:
        return self.err.read_text()


@pytest.fixture
def formation(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> Iterator[tuple[dict[str, str], list[Logged]]]:
    env = env_for(redis_server.url, run_name, ROLLSTREAM_PROCESS__STOP_TIMEOUT_S="120")
    started: list[Logged] = []
    yield env, started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=30)


def test_sigterm_after_ray_shutdown_while_waiting_for_the_others_is_a_clean_exit(
    formation: tuple[dict[str, str], list[Logged]], redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env, started = formation
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    # Given the engines process and a producer attached to its Ray cluster
    engines = Logged(env, tmp_path, "engines", "engines", "--foreground")
    started.append(engines)
    wait_for(lambda: engines.says("engines ready"), timeout=120)
    producer = Logged(env, tmp_path, "producer", "produce")
    started.append(producer)
    wait_for(lambda: producer.says("joins run"), timeout=120)
    # and another process of the run (a trainer) that has not finished its stop yet
    other = Liveness(client, keys, "trainer", "still-stopping", ttl_s=300)
    other.beat()
    # When the run stops, the producer leaves Ray and waits for the trainer to go
    RunControl(client, keys).publish(STOP)
    wait_for(lambda: producer.says("waiting for trainer still-stopping"), timeout=120)
    # and then the process manager's SIGTERM comes (another process of the formation exited)
    producer.proc.send_signal(signal.SIGTERM)
    engines.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in producer.log() or producer.proc.poll() is not None, timeout=30)
    other.clear()
    # Then both end with status 0, not killed by the signal
    assert producer.proc.wait(timeout=120) == 0, producer.log()[-3000:]
    assert engines.proc.wait(timeout=120) == 0, engines.log()[-3000:]


def test_sigterm_while_the_producer_joins_ray_is_a_clean_stop(
    formation: tuple[dict[str, str], list[Logged]], tmp_path: Path
) -> None:
    env, started = formation
    engines = Logged(env, tmp_path, "engines", "engines", "--foreground")
    started.append(engines)
    wait_for(lambda: engines.says("engines ready"), timeout=120)
    # Given a producer inside ray.init (it says so before it connects)
    producer = Logged(env, tmp_path, "producer", "produce")
    started.append(producer)
    wait_for(lambda: producer.says("Connecting to existing Ray cluster"), timeout=120, interval=0.005)
    # When SIGTERM comes, Then it stops with status 0 (Ray's own handler exited with 15)
    producer.proc.send_signal(signal.SIGTERM)
    assert producer.proc.wait(timeout=120) == 0, producer.log()[-3000:]
    assert "SIGTERM received" in producer.log()
    engines.proc.send_signal(signal.SIGTERM)
    assert engines.proc.wait(timeout=120) == 0, engines.log()[-3000:]


def test_the_runs_stop_while_the_judge_starts_ends_it(
    formation: tuple[dict[str, str], list[Logged]], redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env, started = formation
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    # Given a judge that has just started (its rq worker not yet listening)
    judge = Logged(env, tmp_path, "judge", "judge")
    started.append(judge)
    wait_for(lambda: client.keys(keys.alive_pattern), timeout=60, interval=0.001)  # its heartbeat, at once
    # When the run stops at once, Then the judge stops (its worker judged on, for ever)
    RunControl(client, keys).publish(STOP)
    assert judge.proc.wait(timeout=60) == 0, judge.log()[-3000:]
    assert not any(p.role == "judge" for p in live_processes(client, keys))


def test_sigterm_while_the_judge_waits_for_the_others_keeps_it_waiting(
    formation: tuple[dict[str, str], list[Logged]], redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env, started = formation
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    # Given the judge, its rq worker listening, and another process of the run still stopping
    judge = Logged({**env, "ROLLSTREAM_LOG__LEVEL": "DEBUG"}, tmp_path, "judge", "judge")
    started.append(judge)
    wait_for(lambda: judge.says("*** Listening on"), timeout=60)
    other = Liveness(client, keys, "trainer", "still-stopping", ttl_s=300)
    other.beat()
    # When the run stops, its rq worker stops and it waits for the trainer to go
    RunControl(client, keys).publish(STOP)
    wait_for(lambda: judge.says("waiting for trainer still-stopping"), timeout=60)
    # and the process manager's SIGTERM comes
    judge.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in judge.log() or judge.proc.poll() is not None, timeout=30)
    # Then it is a stop like the first (rq's cold shutdown ended the wait at once)
    assert judge.proc.poll() is None, judge.log()[-3000:]
    assert "cold shut down" not in judge.log()
    other.clear()
    assert judge.proc.wait(timeout=60) == 0, judge.log()[-3000:]
