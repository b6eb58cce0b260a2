"""The judge's corners on the producer: groups the judge fails are said once per cause
(not silence, not a line per group), a judge queue no worker serves is said once and
loudly, and a stop does not wait on judge jobs nobody runs."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.registry import StartedJobRegistry

from rollstream.producer.assembly import build_producer
from rollstream.producer.judges.base import JudgeError
from rollstream.producer.judges.rq import RQJudge
from rollstream.producer.judging import JudgeFailures
from rollstream.producer.worker import Producer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import Keys, Role
from rollstream.shared.liveness import Liveness
from rollstream.shared.records import Prompt
from tests.helpers import prompts, wait_for, wait_for_async
from tests.integration.test_judge_rq import ROOT
from tests.integration.test_producer import settings_for

pytestmark = pytest.mark.integration

GROUP_LOG = "rollstream.producer.judging"  # JudgeFailures says it


def make(url: str, run: str, process: dict[str, Any] | None = None, **overrides: Any) -> Producer:
    settings = settings_for(url, run, **overrides)
    if process:
        settings = settings.model_copy(update={"process": settings.process.model_copy(update=process)})
    return build_producer(redis.Redis.from_url(url), settings, name="p1")


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == GROUP_LOG and r.levelno >= logging.WARNING]


def test_groups_without_an_answer_are_said_once_per_cause(
    redis_server: EmbeddedRedis, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    producer = make(redis_server.url, run_name)  # the math judge, in process
    producer.buffer.feed(
        [Prompt(uid=f"n{i}", task="math", prompt=f"What is {i}?", meta={}) for i in range(5)]
    )
    with caplog.at_level(logging.WARNING, logger=GROUP_LOG):
        asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    assert producer.stats.outcomes == {"failed": 5}
    (line,) = warnings(caplog)  # one line for the five groups
    assert "no meta['answer'] to judge against" in line and "dead-lettered" in line
    assert producer.runner.judge_failures.causes == {
        "prompt {group} has no meta['answer'] to judge against": 5
    }


def test_a_judge_queue_without_a_judge_worker_is_said_once(
    redis_server: EmbeddedRedis, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    producer = make(
        redis_server.url,
        run_name,
        buffer={"max_attempts": 1},  # each job waited for judge_timeout_s + 5 s
        producer={"judge_on_queue": True, "judge_timeout_s": 0.5},
    )
    producer.buffer.feed(prompts("math", 3))
    with caplog.at_level(logging.WARNING, logger=GROUP_LOG):
        asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    assert producer.stats.outcomes == {"failed": 3}
    (line,) = warnings(caplog)  # said once, for the three groups
    keys = Keys(run_name)
    assert "no `rollstream judge` worker is alive" in line and keys.alive(Role.JUDGE, "*") in line
    assert producer.runner.rq_judge is not None and producer.runner.rq_judge.queue.key in line
    # said once a job had waited a whole job timeout (1 s), before any group was dead-lettered
    assert "has waited 1 s" in line and "dead-lettered after 6 s" in line, line
    waiting = re.search(r"with (\d+) other groups waiting", line)
    assert waiting is not None and int(waiting.group(1)) >= 1, line
    assert producer.runner.judge_failures.judgeless == 3


def test_a_judge_worker_alive_is_not_blamed(
    redis_server: EmbeddedRedis, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A judge worker keeps its liveness key, yet the jobs time out: the cause is said,
    not a missing worker."""
    producer = make(
        redis_server.url,
        run_name,
        buffer={"max_attempts": 1},
        producer={"judge_on_queue": True, "judge_timeout_s": 0.5},
    )
    judge = Liveness(producer.buffer.client, producer.buffer.keys, Role.JUDGE, "j1", ttl_s=60)
    judge.beat()
    try:
        producer.buffer.feed(prompts("math", 2))
        with caplog.at_level(logging.WARNING, logger=GROUP_LOG):
            asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    finally:
        judge.clear()
    (line,) = warnings(caplog)
    assert "timed out waiting" in line and "no `rollstream judge` worker" not in line
    assert producer.runner.judge_failures.judgeless == 0


@pytest.mark.parametrize("how", ["grace", "cold"])
def test_a_stop_does_not_wait_for_a_judge_that_is_gone(
    redis_server: EmbeddedRedis, run_name: str, how: str
) -> None:
    """The judge worker is killed -9 while it runs the group's job: the job stays
    'started' for ever and no stop command reaches it, so the group's wait would last
    max_attempts x (judge_timeout_s + 5) s (here 45 s). A stop ends within its grace
    (stop_timeout_s / 2 for the groups, then a short settle), a cold stop at once."""
    from tests.integration.test_judge_rq import THIS, worker_command, worker_env

    stop_timeout_s = 2.0 if how == "grace" else 120.0
    producer = make(
        redis_server.url,
        run_name,
        process={"stop_timeout_s": stop_timeout_s},
        producer={"judge": f"{THIS}:sleep_forever", "judge_on_queue": True, "judge_timeout_s": 10.0},
    )
    queue = f"judge-{run_name}"  # a queue of this test's own on the shared server
    producer.runner.rq_judge = RQJudge(
        producer.buffer.client, f"{THIS}:sleep_forever", 10.0, 2, queue_name=queue
    )
    producer.buffer.feed(prompts("math", 1))
    # a worker that runs the job in its own process (no work horse to outlive its kill)
    command = [c for c in worker_command(redis_server.url, queue) if c != "--burst"]
    command += ["--worker-class", "rq.worker.SimpleWorker"]
    worker = subprocess.Popen(
        command, cwd=ROOT, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    stopped: list[float] = []

    def job_started() -> bool:
        registry = StartedJobRegistry(queue, connection=producer.buffer.client)
        return registry.count > 0

    async def main() -> None:
        stop, cold = asyncio.Event(), asyncio.Event()
        run = asyncio.create_task(producer.run(stop, cold=cold))
        try:
            await wait_for_async(job_started, timeout=30)
        finally:
            worker.kill()  # the judge is gone, its job 'started' for ever
            worker.wait()
        stopped.append(time.monotonic())
        stop.set()
        if how == "cold":
            cold.set()
        await asyncio.wait_for(run, 60)

    asyncio.run(main())  # returns once the loop's threads ended too
    took = time.monotonic() - stopped[0]
    assert took < (6.0 if how == "grace" else 4.0), f"the stop took {took:.1f} s"
    # the claim went back: nothing pending under the stopped producer
    pending = producer.buffer.client.xpending(producer.buffer.keys.prompts("math"), "producers")
    assert pending["pending"] == 0


def test_a_judge_without_pubsub_permission_warns_once_and_judges(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    """`rollstream judge` under a Redis user that may use no pub/sub channel (an ACL
    without &...): one clear warning, no redis-py thread traceback, and it judges on."""
    from tests.integration.test_acl import CATEGORIES, PASSWORD

    admin = redis.Redis.from_url(redis_server.url)
    user = f"u{run_name}"
    admin.execute_command(
        "ACL", "SETUSER", user, "on", f">{PASSWORD}", f"~rs:{{{run_name}}}:*", "resetchannels", *CATEGORIES
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=f"redis://{user}:{PASSWORD}@127.0.0.1:{redis_server.port}/0",
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
    )
    log_path = tmp_path / "judge.log"
    with log_path.open("w") as out:
        judge = subprocess.Popen(
            [sys.executable, "-m", "rollstream.cli.main", "judge"], env=env, stdout=out, stderr=out
        )
    try:
        wait_for(lambda: "pub/sub" in log_path.read_text() or judge.poll() is not None, timeout=60)
        assert judge.poll() is None, log_path.read_text()[-2000:]
        # it judges: a job on the run's queue, submitted by a process with the run's rq prefix
        submit = (
            "import sys; import redis; from rollstream.producer.judges.rq import RQJudge; "
            "from tests.helpers import prompts; from tests.integration.test_judge_rq import sample; "
            f"j = RQJudge(redis.Redis.from_url({env['ROLLSTREAM_REDIS__URL']!r}), 'math', 10.0); "
            "job = j.submit(prompts('math', 1)[0], [sample('\\\\boxed{1}')]); "
            "print(j.result(job, 30)[0]['score'])"
        )
        rq_env = {**env, "RQ_KEY_PREFIX": Keys(run_name).rq_prefix, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", submit], env=rq_env, cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert done.stdout.strip() == "1.0", done.stdout + done.stderr
    finally:
        judge.send_signal(signal.SIGTERM)
        judge.wait(timeout=60)
        admin.execute_command("ACL", "DELUSER", user)
    logged = log_path.read_text()
    assert judge.returncode == 0, logged[-2000:]
    assert "Traceback" not in logged, logged[-3000:]
    (line,) = [line for line in logged.splitlines() if "pub/sub" in line]
    assert "WARNING" in line and f"rs:{{{run_name}}}:rq:pubsub:" in line, line


def test_a_judge_worker_back_is_said_with_the_groups_lost_meanwhile(
    redis_server: EmbeddedRedis, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    failures = JudgeFailures(client, keys, "p1", "rq:queue:judge")
    with caplog.at_level(logging.WARNING, logger=GROUP_LOG):
        failures.queued_long("math:u0", 61.0, 195.0)
        failures.queued_long("math:u1", 61.0, 195.0)  # said once
        for uid in ("u0", "u1"):
            failures.failed(f"math:{uid}", JudgeError("judge job j timed out waiting", "j"))
        judge = Liveness(client, keys, Role.JUDGE, "j1", ttl_s=60)
        judge.beat()
        try:
            failures.judged()
            failures.judged()  # said once too
        finally:
            judge.clear()
    lines = warnings(caplog)
    assert len(lines) == 2, lines
    assert "has waited 61 s" in lines[0]
    assert "alive again; 2 groups were dead-lettered while none was" in lines[1]
    assert (failures.warned, failures.judgeless) == (False, 0)
