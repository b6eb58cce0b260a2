"""The judge's side of a group on the producer: the thread an in-process judge runs in
(``SerialThread``: never on the event loop), and what the producer says when the judge
fails groups (``JudgeFailures``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from rollstream.producer.judges.base import JudgeError
from rollstream.shared.keys import Keys, Role

MAX_CAUSES = 256  # distinct judge-failure causes remembered (each logged once)
T = TypeVar("T")

log = logging.getLogger(__name__)


class SerialThread:
    """Runs calls one at a time in a daemon thread of its own, off the event loop. A
    daemon, unlike an executor's thread: a call that never returns (a hung judge) cannot
    keep the process from exiting once its group has been handed back at a stop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        self._calls.put((loop, future, fn, args))
        return await future

    def _serve(self) -> None:
        while True:
            loop, future, fn, args = self._calls.get()
            if future.cancelled():  # its group was handed back meanwhile
                continue
            try:
                result, error = fn(*args), None
            except BaseException as exc:
                result, error = None, exc

            def settle(
                future: asyncio.Future[Any] = future, result: Any = result, error: Any = error
            ) -> None:
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            with contextlib.suppress(RuntimeError):  # the loop is gone
                loop.call_soon_threadsafe(settle)


class JudgeFailures:
    """What the producer says when the judge fails groups, which then go to the dead
    letters (each with its reason): one warning per cause, not a line per group, and not
    silence (every prompt of a dataset without ``meta.answer`` fails the same way). On
    the judge queue, no ``rollstream judge`` worker alive (the run's liveness keys) while
    jobs wait is said once, loudly, as soon as a job has waited a whole job timeout for
    a worker (or at the first failure), with the groups it holds; said again only after
    a judge worker was seen alive in between."""

    def __init__(self, client: redis.Redis, keys: Keys, producer: str, queue_key: str | None) -> None:
        self.client = client
        self.judges = keys.alive(Role.JUDGE, "*")
        self.producer = producer
        self.queue_key = queue_key  # the rq queue's key, when the judge runs on the queue
        self.waiting = 0  # groups waiting on the judge queue now (the event loop counts them)
        self.warned = False  # "no judge worker" was said, and no judge worker seen since
        self.judgeless = 0  # groups failed on the queue with no judge worker alive, since the warning
        self.causes: dict[str, int] = {}  # groups failed per cause
        self._lock = threading.Lock()  # the calls come from the loop's worker threads

    def queued_long(self, group_id: str, waited_s: float, dead_after_s: float) -> None:
        """A group's judge job still waits for a worker after a whole job timeout."""
        with self._lock:
            if self.warned or self._judge_alive() is not False:
                return
            self.warned = True
        log.warning(
            "producer %s: no `rollstream judge` worker is alive (no %s key) to run the jobs on the "
            "judge queue %s (producer.judge_on_queue is set): group %s has waited %.0f s for one, "
            "with %d other groups waiting on the queue; each is dead-lettered after %.0f s unless a "
            "judge worker runs: start `rollstream judge` (said once, not per group)",
            self.producer, self.judges, self.queue_key, group_id, waited_s, max(0, self.waiting - 1),
            dead_after_s,
        )  # fmt: skip

    def judged(self) -> None:
        """A job on the queue was judged after the warning: a judge worker runs again."""
        with self._lock:
            if not self.warned or not self._judge_alive():
                return
            self.warned, lost = False, self.judgeless
            self.judgeless = 0
        log.warning(
            "producer %s: a judge worker is alive again; %d groups were dead-lettered while none was",
            self.producer, lost,
        )  # fmt: skip

    def failed(self, group_id: str, exc: JudgeError) -> None:
        """One group failed for ``exc`` (called off the event loop: it may ask Redis)."""
        if self.queue_key is not None:
            alive = self._judge_alive()
            if alive is False:
                with self._lock:
                    self.judgeless += 1
                    said, self.warned = self.warned, True
                if not said:
                    log.warning(
                        "producer %s: no `rollstream judge` worker is alive (no %s key) to run the jobs "
                        "on the judge queue %s (producer.judge_on_queue is set): group %s is dead-lettered "
                        "(%s) and so will be the %d other groups waiting on the queue and every group "
                        "after them until a judge worker runs; start `rollstream judge` "
                        "(said once, not per group)",
                        self.producer, self.judges, self.queue_key, group_id, exc, self.waiting,
                    )  # fmt: skip
                return
            if alive and self.warned:
                self.judged()
        cause = str(exc).replace(group_id, "{group}")
        if exc.job_id:
            cause = cause.replace(exc.job_id, "{job}")
        seen = self.causes.get(cause)
        if seen is not None:
            self.causes[cause] = seen + 1
            return
        if len(self.causes) == MAX_CAUSES:
            log.warning("producer %s: the judge failed group %s: %s", self.producer, group_id, exc)
            return
        self.causes[cause] = 1
        log.warning(
            "producer %s: the judge failed group %s: %s; it is dead-lettered, and so is every group "
            "that fails this way (said once per cause: `rollstream show dead` lists them)",
            self.producer, group_id, exc,
        )  # fmt: skip

    def _judge_alive(self) -> bool | None:
        """Whether a judge worker keeps a liveness key; None when Redis does not say."""
        try:
            return next(iter(self.client.scan_iter(match=self.judges, count=1000)), None) is not None
        except redis.RedisError:
            return None
