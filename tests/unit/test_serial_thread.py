"""The thread an in-process judge runs in: off the event loop, one call at a time, and
never in the way of the process's exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

from rollstream.producer.judging import SerialThread

HUNG = """
import asyncio, threading
from rollstream.producer.judging import SerialThread

async def main():
    worker = SerialThread("judge")
    try:
        async with asyncio.timeout(0.2):
            await worker.call(threading.Event().wait)  # never returns
    except TimeoutError:
        print("handed back", flush=True)

asyncio.run(main())
"""


def test_calls_run_in_order_off_the_loop_and_raise_their_errors() -> None:
    seen: list[tuple[int, str]] = []

    def record(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * 2

    def fail() -> None:
        raise ValueError("bad reward")

    async def main() -> None:
        worker = SerialThread("judge")
        assert await asyncio.gather(*(worker.call(record, i) for i in range(5))) == [0, 2, 4, 6, 8]
        try:
            await worker.call(fail)
        except ValueError as exc:
            assert str(exc) == "bad reward"
        else:
            raise AssertionError("the call's error was lost")

    asyncio.run(main())
    assert seen == [(i, "judge") for i in range(5)]


def test_a_call_that_never_returns_does_not_keep_the_process_from_exiting() -> None:
    started = time.monotonic()
    # before: an executor's thread, which the interpreter waits for at exit, for ever here
    done = subprocess.run([sys.executable, "-c", HUNG], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "handed back"
    assert time.monotonic() - started < 30
