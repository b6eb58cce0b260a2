"""A stop cancels the groups in flight while their settles run off the event loop: a
settle under way or still queued for a worker thread lands all the same, so that the
claim is handed back (or the group written), not left pending after a cold stop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from rollstream.producer.engines.base import FINISH_ABORT, Generation
from rollstream.producer.fleet.pool import LocalPool
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.keys import PRODUCERS
from rollstream.shared.records import ID_DTYPE, LOGPROB_DTYPE, Group, Sample
from tests.conftest import BufferFactory
from tests.helpers import prompts
from tests.integration.test_group_timeout import FakeEngine, runner_for

pytestmark = pytest.mark.integration


class OneWorker(ThreadPoolExecutor):
    """The loop's default executor with one busy worker: says when a call is queued."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.queued = threading.Event()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = super().submit(fn, *args, **kwargs)
        self.queued.set()
        return future


class AbortingEngine(FakeEngine):
    """Every request comes back aborted (a weight sync or a stop cut it short)."""

    async def generate(self, prompt_ids: list[int], params: Any, n: int = 1, request_id: Any = None) -> Any:
        ids, logprobs = np.array([50], dtype=ID_DTYPE), np.array([-0.1], dtype=LOGPROB_DTYPE)
        return [Generation(ids, logprobs, np.zeros(1, dtype=ID_DTYPE), FINISH_ABORT) for _ in range(n)]


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Yield to the loop until ``condition`` holds (the deadline fails the test)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def pending(buffer: ReplayBuffer) -> int:
    return int(buffer.client.xpending(buffer.keys.prompts("math"), PRODUCERS)["pending"])


@pytest.mark.timeout(60)
def test_a_group_cancelled_while_its_abort_waits_for_a_thread_still_hands_its_claim_back(
    real_buffer: BufferFactory,
) -> None:
    buffer = real_buffer("p", tasks=[{"name": "math", "n": 2}], buffer={"claim_idle_ms": 60_000})
    buffer.feed(prompts("math", 1))
    (claim,) = buffer.claim("math", 1)
    runner = runner_for(buffer, LocalPool([AbortingEngine()]), tasks=[{"name": "math", "n": 2}])
    free = threading.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        executor = OneWorker()
        loop.set_default_executor(executor)
        busy = loop.run_in_executor(None, free.wait)  # every worker thread is taken (a loaded machine)
        executor.queued.clear()
        # Given a group whose engine aborted it, its abort queued for a worker thread
        group = asyncio.create_task(runner.run(claim))
        await until(executor.queued.is_set)
        # When the stop cancels it before a thread has taken the abort up
        group.cancel()
        await asyncio.sleep(0)  # one turn of the loop: the cancellation reaches what the group awaits
        free.set()
        await asyncio.gather(group, busy, return_exceptions=True)
        assert group.cancelled()
        # Then the claim is back in the aborted pool by the time the cancelled group ends
        assert pending(buffer) == 0

    asyncio.run(main())
    assert buffer.client.xlen(buffer.keys.aborted("math")) == 1


@pytest.mark.timeout(60)
def test_completions_queued_for_a_thread_land_when_the_loop_goes_away(real_buffer: BufferFactory) -> None:
    buffer = real_buffer("p", tasks=[{"name": "math", "n": 1}], buffer={"claim_idle_ms": 60_000})
    buffer.feed(prompts("math", 1))
    (claim,) = buffer.claim("math", 1)
    ids, logprobs = np.array([50], dtype=ID_DTYPE), np.array([-0.1], dtype=LOGPROB_DTYPE)
    sample = Sample(list(ids), list(ids), list(logprobs), [0], finish_reason="stop", reward={"score": 1.0})
    group = Group.for_prompt(claim.prompt, samples=[sample], producer=buffer.consumer)
    runner = runner_for(buffer, LocalPool([FakeEngine()]), tasks=[{"name": "math", "n": 1}])
    free = threading.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        executor = OneWorker()
        loop.set_default_executor(executor)
        loop.run_in_executor(None, free.wait)
        executor.queued.clear()
        # Given a completed group whose write waits for a worker thread
        waiter = asyncio.create_task(runner.completions.complete(claim, group))
        await until(executor.queued.is_set)
        # When the producer's loop ends (asyncio.run cancels what is left) before it is written
        waiter.cancel()
        for writing in runner.completions._writing:  # the busy thread is free once the write was cancelled
            writing.add_done_callback(lambda _: free.set())

    asyncio.run(main())  # waits for the executor's threads at its end
    # Then the group was written and its claim settled all the same
    assert pending(buffer) == 0
    assert buffer.client.xlen(buffer.keys.groups("math")) == 1
