"""Judges as rq jobs on a real redis-server, served by a real `rq worker --burst` subprocess
with the JSON serializer: rewards come back, a hung judge is killed at its timeout,
a cancelled job never runs, a failing judge is retried and reported."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from rq.job import JobStatus

from rollstream.producer.judges import JudgeError, apply_rewards
from rollstream.producer.judges.rq import JUDGE_QUEUE, RQJudge
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.records import Prompt, Sample
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
THIS = "tests.integration.test_judge_rq"


# --- judges the worker imports by dotted path --------------------------------------------


def sleep_forever(prompt: Prompt, samples: list[Sample]) -> list[dict[str, float]]:
    while True:
        time.sleep(0.05)


def mark_ran(prompt: Prompt, samples: list[Sample]) -> list[dict[str, float]]:
    Path(prompt.meta["marker"]).write_text("ran")
    return [{"score": 1.0} for _ in samples]


def flaky(prompt: Prompt, samples: list[Sample]) -> list[dict[str, float]]:
    """Fails on its first attempt and succeeds on the next: attempts are counted in a file."""
    marker = Path(prompt.meta["marker"])
    attempts = len(marker.read_text()) if marker.exists() else 0
    marker.write_text("x" * (attempts + 1))
    if attempts == 0:
        raise RuntimeError("judge exploded on attempt 1")
    return [{"score": float(attempts)} for _ in samples]


# --- fixtures ----------------------------------------------------------------------------


def sample(text: str) -> Sample:
    return Sample(prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.1], response_versions=[0], text=text)


def worker_command(url: str, queue: str) -> list[str]:
    """`rq worker --burst` as the Procfile would start it: it serves the queue until empty, then exits."""
    rq_cli = Path(sys.executable).parent / "rq"
    serializer = ["--serializer", "rq.serializers.JSONSerializer"]
    return [str(rq_cli), "worker", queue, "--burst", "--url", url, "--path", str(ROOT), *serializer]


def worker_env() -> dict[str, str]:
    # the worker imports this module and the package by name, wherever pytest was started
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def run_worker(url: str, queue: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    cmd = worker_command(url, queue)
    done = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def start_worker(url: str, queue: str) -> subprocess.Popen[bytes]:
    cmd = worker_command(url, queue)
    return subprocess.Popen(
        cmd, cwd=ROOT, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


@pytest.fixture
def client(real_client: redis.Redis) -> redis.Redis:
    return real_client


@pytest.fixture
def queue(run_name: str) -> str:
    """A queue of the test's own on the shared session server, so that no test sees another's jobs."""
    return f"{JUDGE_QUEUE}-{run_name}"


# --- tests -------------------------------------------------------------------------------


def test_math_judge_job_returns_rewards(redis_server: EmbeddedRedis, client: redis.Redis) -> None:
    # Given two groups on the default "judge" queue
    judge = RQJudge(client, "math", timeout_s=10, retries=0)
    assert judge.queue.name == "judge"
    client.delete(judge.queue.key)
    p1 = Prompt(uid="u1", task="math", prompt="1/2?", prompt_ids=[5, 6, 7], meta={"answer": "1/2"})
    p2 = Prompt(uid="u2", task="math", prompt="big?", meta={"answer": 1234})
    samples1 = [sample(r"so \boxed{0.5}"), sample("it is 3"), sample(r"\boxed{\frac{1}{2}}")]
    samples2 = [sample("about 1,234 of them")]
    jobs = [judge.submit(p1, samples1), judge.submit(p2, samples2)]

    # When a burst worker serves the queue
    run_worker(redis_server.url, "judge")

    # Then each job has one reward per response
    rewards1, rewards2 = (judge.result(job, wait_s=5) for job in jobs)
    assert rewards1 == [
        {"score": 1.0, "format": 1.0},
        {"score": 0.0, "format": 0.0},
        {"score": 1.0, "format": 1.0},
    ]
    assert rewards2 == [{"score": 1.0, "format": 0.0}]
    apply_rewards(samples1, rewards1)
    assert [s.score for s in samples1] == [1.0, 0.0, 1.0]


def test_job_payload_is_json(client: redis.Redis, queue: str) -> None:
    import json
    import zlib

    judge = RQJudge(client, "math", timeout_s=5, queue_name=queue)
    job = judge.submit(
        Prompt(uid="u", task="t", prompt="q", prompt_ids=[1] * 50, meta={"answer": "1"}), [sample("1")]
    )
    raw = client.hget(job.key, "data")
    assert isinstance(raw, bytes)
    func, _instance, args, _kwargs = json.loads(zlib.decompress(raw))
    assert func == "rollstream.producer.judges.rq.run_judge"
    assert args == ["math", {"uid": "u", "task": "t", "prompt": "q", "meta": {"answer": "1"}}, ["1"]]
    judge.cancel([job])


def test_hung_judge_is_killed_at_its_timeout(
    redis_server: EmbeddedRedis, client: redis.Redis, queue: str
) -> None:
    judge = RQJudge(client, f"{THIS}:sleep_forever", timeout_s=1.5, retries=0, queue_name=queue)
    assert judge.job_timeout == 2  # rq keeps whole seconds: 1.5 is rounded up, not down
    job = judge.submit(Prompt(uid="u", task="t", prompt="q"), [sample("a")])

    started = time.monotonic()
    run_worker(redis_server.url, queue)
    elapsed = time.monotonic() - started

    with pytest.raises(JudgeError, match=rf"judge job {job.id} timed out: .*job_timeout of 2 s") as info:
        judge.result(job, wait_s=5)
    assert info.value.job_id == job.id
    assert job.get_status() == JobStatus.FAILED
    assert 2 <= elapsed < 9, f"the worker took {elapsed:.1f} s"


def test_cancelled_job_never_runs(
    redis_server: EmbeddedRedis, client: redis.Redis, queue: str, tmp_path: Path
) -> None:
    # Given two queued jobs, one of which is cancelled before any worker starts
    judge = RQJudge(client, f"{THIS}:mark_ran", timeout_s=5, queue_name=queue)
    cancelled_marker, kept_marker = tmp_path / "cancelled", tmp_path / "kept"
    cancelled = judge.submit(
        Prompt(uid="c", task="t", prompt="q", meta={"marker": str(cancelled_marker)}), []
    )
    kept = judge.submit(
        Prompt(uid="k", task="t", prompt="q", meta={"marker": str(kept_marker)}), [sample("a")]
    )
    assert judge.cancel([cancelled]) == 1

    # When a worker serves the queue
    run_worker(redis_server.url, queue)

    # Then the other job ran and the cancelled one did not
    assert judge.result(kept, wait_s=5) == [{"score": 1.0}]
    assert kept_marker.exists()
    assert not cancelled_marker.exists()
    assert cancelled.get_status() == JobStatus.CANCELED
    with pytest.raises(JudgeError, match="was canceled"):
        judge.result(cancelled, wait_s=1)
    # cancelling what is already finished or cancelled is a no-op
    assert judge.cancel([kept, cancelled]) == 0


def test_cancel_stops_a_running_job(redis_server: EmbeddedRedis, client: redis.Redis, queue: str) -> None:
    # Given a hung judge that a worker has started
    judge = RQJudge(client, f"{THIS}:sleep_forever", timeout_s=30, queue_name=queue)
    job = judge.submit(Prompt(uid="u", task="t", prompt="q"), [sample("a")])
    worker = start_worker(redis_server.url, queue)
    try:
        wait_for(lambda: job.get_status() == JobStatus.STARTED, timeout=10)

        # When its group is aborted
        assert judge.cancel([job]) == 1

        # Then the worker stops it long before its timeout, and result() says so
        with pytest.raises(JudgeError, match="was stopped"):
            judge.result(job, wait_s=5)
        assert worker.wait(timeout=10) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_failing_judge_is_retried(
    redis_server: EmbeddedRedis, client: redis.Redis, queue: str, tmp_path: Path
) -> None:
    marker = tmp_path / "attempts"
    judge = RQJudge(client, f"{THIS}:flaky", timeout_s=5, retries=1, queue_name=queue)
    job = judge.submit(Prompt(uid="u", task="t", prompt="q", meta={"marker": str(marker)}), [sample("a")])

    run_worker(redis_server.url, queue)

    assert judge.result(job, wait_s=5) == [{"score": 1.0}]
    assert marker.read_text() == "xx"


def test_failing_judge_without_retries_reports_the_exception(
    redis_server: EmbeddedRedis, client: redis.Redis, queue: str, tmp_path: Path
) -> None:
    judge = RQJudge(client, f"{THIS}:flaky", timeout_s=5, retries=0, queue_name=queue)
    job = judge.submit(
        Prompt(uid="u", task="t", prompt="q", meta={"marker": str(tmp_path / "m")}), [sample("a")]
    )
    bad_spec = RQJudge(client, "no_such_module:judge", timeout_s=5, queue_name=queue)
    bad_job = bad_spec.submit(Prompt(uid="v", task="t", prompt="q"), [sample("a")])

    run_worker(redis_server.url, queue)

    with pytest.raises(JudgeError, match="failed: RuntimeError: judge exploded on attempt 1"):
        judge.result(job, wait_s=5)
    with pytest.raises(JudgeError, match="module 'no_such_module' not found"):
        bad_spec.result(bad_job, wait_s=5)


def test_result_gives_up_at_its_deadline_without_a_worker(client: redis.Redis, queue: str) -> None:
    judge = RQJudge(client, "math", timeout_s=5, queue_name=queue)
    job = judge.submit(Prompt(uid="u", task="t", prompt="q", meta={"answer": "1"}), [sample("1")])
    started = time.monotonic()
    with pytest.raises(JudgeError, match=r"timed out waiting: not done after 0.2 s \(still queued\)"):
        judge.result(job, wait_s=0.2)
    assert time.monotonic() - started < 1
    assert judge.cancel([job]) == 1


def test_arguments_are_checked(client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        RQJudge(client, "math", timeout_s=0)
    with pytest.raises(ValueError, match="retries"):
        RQJudge(client, "math", timeout_s=1, retries=-1)
