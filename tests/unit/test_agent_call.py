"""An agent's plain plug-in call (an environment's reset / step / close) runs off the event
loop, in a thread that cannot keep the process from exiting once its group is given up."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollstream.producer.agents.base import call


def test_a_plain_call_runs_off_the_loop_and_returns_its_value() -> None:
    async def main() -> tuple[int, bool]:
        loop_thread = threading.get_ident()
        return await call(lambda x: (x + 1, threading.get_ident() != loop_thread), 1)

    assert asyncio.run(main()) == (2, True)


def test_a_plain_call_raises_its_error() -> None:
    def fails() -> None:
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        asyncio.run(call(fails))


def test_a_hung_environment_call_does_not_hold_the_loops_end() -> None:
    started, release = threading.Event(), threading.Event()

    def hangs() -> None:
        started.set()
        release.wait(60)

    async def main() -> None:
        group = asyncio.ensure_future(call(hangs))
        await asyncio.to_thread(started.wait, 10)
        group.cancel()  # the producer stops: the group is handed back, its call given up
        await asyncio.gather(group, return_exceptions=True)

    ended = threading.Event()
    runner = threading.Thread(target=lambda: (asyncio.run(main()), ended.set()), daemon=True)
    runner.start()
    try:
        # asyncio.run ends (and the process could exit) while the environment still hangs
        assert ended.wait(10), "asyncio.run waited for the hung environment call"
    finally:
        release.set()
        runner.join(10)
