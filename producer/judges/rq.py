"""Judges run as rq jobs, so that slow or unsafe judging (a code sandbox, a reward
model) happens in worker processes beside the producer and can be killed at a timeout.

Everything on the queue is JSON (rq's JSONSerializer, never pickle): the job
is the module-level ``run_judge`` called with the judge's spec, the prompt as
a dict and the response texts, and it returns one reward dict per text. A
worker serves it with ``rollstream judge``, or by hand with rq's own command and
the run's key prefix (the CLI puts rq's keys under the run's: ``rs:{run}:rq``)::

    RQ_KEY_PREFIX='rs:{exp1}:rq' rq worker judge --serializer rq.serializers.JSONSerializer --url redis://...

and needs this package (and any dotted-path judge) importable.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any

import redis
from rq import Queue, Retry, Worker
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from rollstream.producer.judges.base import Judge, JudgeError, apply_rewards
from rollstream.producer.judges.registry import load_judge
from rollstream.shared.codec import prompt_from_dict, prompt_to_dict
from rollstream.shared.records import Prompt, Sample

JUDGE_QUEUE = "judge"
SUBSCRIBE_WAIT_S = 5.0  # how long a judge worker waits for the reply to its command channel's SUBSCRIBE

log = logging.getLogger(__name__)

# how long a failed judge job stays inspectable (rq's default is a year)
FAILURE_TTL_S = 24 * 3600

_PENDING = (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED, JobStatus.CREATED)


@lru_cache(maxsize=32)
def _judge(spec: str) -> Judge:
    return load_judge(spec)


def _text_sample(text: str) -> Sample:
    return Sample(prompt_ids=[], response_ids=[], logprobs=[], response_versions=[], text=text)


def run_judge(spec: str, prompt: dict[str, Any], texts: list[str]) -> list[dict[str, Any]]:
    """The job body: judge the texts, and check the rewards here so a bad judge fails its job."""
    samples = [_text_sample(text) for text in texts]
    rewards = _judge(spec)(prompt_from_dict(prompt), samples)
    apply_rewards(samples, rewards)
    return [sample.reward for sample in samples]


def _failure_reason(job: Job) -> str:
    result = job.latest_result()
    text = (result.exc_string or "").strip() if result is not None else ""
    if "JobTimeoutException" in text:
        return f"timed out: killed by the worker after its job_timeout of {job.timeout} s"
    last_line = text.splitlines()[-1] if text else "no error recorded"
    return f"failed: {last_line}"


class RQJudge:
    """Submits groups to the judge queue and collects their rewards."""

    def __init__(
        self,
        redis_client: redis.Redis,
        spec: str,
        timeout_s: float,
        retries: int = 0,
        *,
        queue_name: str = JUDGE_QUEUE,
        poll_s: float = 0.02,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.spec = spec
        # rq keeps whole seconds (int()), and 0 would mean no limit at all: round up instead
        self.job_timeout = max(1, math.ceil(timeout_s))
        self.retries = retries
        self.poll_s = poll_s
        self.queue = Queue(queue_name, connection=redis_client, serializer=JSONSerializer)

    def submit(self, prompt: Prompt, samples: Sequence[Sample]) -> Job:
        data = prompt_to_dict(prompt)
        data.pop("prompt_ids", None)  # judges read text; token ids would only fatten the job
        return self.queue.enqueue(
            run_judge,
            args=(self.spec, data, [sample.text for sample in samples]),
            job_timeout=self.job_timeout,
            # rq's Retry refuses max=0: no retries is no Retry
            retry=Retry(max=self.retries) if self.retries else None,
            failure_ttl=FAILURE_TTL_S,
            description=f"judge {self.spec} {prompt.group_id}",
        )

    def result(
        self,
        job: Job,
        wait_s: float,
        given_up: threading.Event | None = None,
        queued_long: Callable[[float], None] | None = None,
    ) -> list[dict[str, Any]]:
        """The rewards of a finished job; JudgeError if it failed, was cancelled, or is not done
        in wait_s, or once ``given_up`` is set (the caller no longer waits: a stop).
        ``queued_long(seconds)`` is called once if the job is still waiting for a worker
        after a whole job timeout (no worker took it: none runs, or all are busy)."""
        given_up = given_up or threading.Event()
        started = time.monotonic()
        deadline = started + wait_s
        while True:
            try:
                status = job.get_status(refresh=True)
            except InvalidJobOperation as exc:
                raise JudgeError(
                    f"judge job {job.id} is gone from Redis (expired or deleted)", job.id
                ) from exc
            if status == JobStatus.FINISHED:
                rewards = job.return_value(refresh=True)
                if not isinstance(rewards, list):
                    raise JudgeError(f"judge job {job.id} finished without a result: {rewards!r}", job.id)
                return rewards
            if status == JobStatus.FAILED:
                raise JudgeError(f"judge job {job.id} {_failure_reason(job)}", job.id)
            if status in (JobStatus.CANCELED, JobStatus.STOPPED):
                raise JudgeError(f"judge job {job.id} was {status.value}", job.id)
            now = time.monotonic()
            if queued_long is not None and status in _PENDING and now - started >= self.job_timeout:
                queued_long(now - started)
                queued_long = None
            remaining = deadline - now
            if remaining <= 0:
                raise JudgeError(
                    f"judge job {job.id} timed out waiting: not done after {wait_s} s (still {status.value})",
                    job.id,
                )
            if given_up.wait(min(self.poll_s, remaining)):
                raise JudgeError(f"judge job {job.id}: given up waiting (still {status.value})", job.id)

    def cancel(self, jobs: Iterable[Job]) -> int:
        """Cancel the jobs not yet started and stop the running ones; the number cancelled or stopped.

        Best effort: a worker may take a job between the status read and the cancel,
        so a caller that aborts a group must discard its rewards anyway.
        """
        done = 0
        for job in jobs:
            try:
                status = job.get_status(refresh=True)
                if status in _PENDING:
                    job.cancel()
                elif status == JobStatus.STARTED:
                    send_stop_job_command(job.connection, job.id, serializer=JSONSerializer)
                else:
                    continue
            except (InvalidJobOperation, NoSuchJobError):
                continue  # finished, expired or cancelled meanwhile: nothing left to stop
            done += 1
        return done


class JudgeWorker(Worker):
    """rq's worker, whose command channel may be refused: rq subscribes each worker to a
    pub/sub channel (its prefix's ``:pubsub:<worker>``) on which a producer's
    ``cancel`` stops a running job. A Redis user without pub/sub channel permission (an
    ACL without ``&...``) is refused there; rq's subscription then failed in redis-py's
    thread with a traceback. This says it in one warning and judges on without it."""

    def subscribe(self) -> None:
        channel = self.pubsub_channel_name
        pubsub = self.connection.pubsub()  # type: ignore[no-untyped-call]
        try:
            pubsub.subscribe(**{channel: self.handle_payload})
            # the reply to SUBSCRIBE, a refusal included, comes on the pub/sub connection
            deadline = time.monotonic() + SUBSCRIBE_WAIT_S
            while time.monotonic() < deadline:
                message = pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
                if message is not None and message.get("type") == "subscribe":
                    break
        except redis.ResponseError as exc:  # NOPERM
            pubsub.close()
            pattern = channel.rsplit(":", 1)[0] + ":*"
            log.warning(
                "judge: worker %s may not subscribe to its rq command channel %s (%s): the Redis "
                "user lacks pub/sub channel permission (grant it with ACL SETUSER <user> &%s). It "
                "judges on, but a producer's stop of a running job does not reach it: such a job "
                "runs to its job_timeout (producer.judge_timeout_s)",
                self.name, channel, exc, pattern,
            )  # fmt: skip
            return
        self.pubsub = pubsub
        self.pubsub_thread = pubsub.run_in_thread(
            sleep_time=60, daemon=True, exception_handler=self._pubsub_exception_handler
        )
