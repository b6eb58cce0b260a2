"""A command whose reply read is cut short by an exception (a signal handler's, as rq's
warm stop raises in the middle of its blocking dequeue) leaves no reply behind for the
next command on a Sentinel-managed client, and `rollstream judge` with the Sentinels' URL
stops at the run's stop. Before the fix the connection went back to the pool with the
blocking command's reply still to come: the next command read it for its own (a wrong
answer), and the judge hung until rq's dequeue timeout, then died on "Wrong number of
response items from pipeline execution"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollstream.shared.connection import connect
from rollstream.shared.settings import RedisSettings
from tests.ha import SentinelSet
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def sentinels() -> Iterator[SentinelSet]:
    ha = SentinelSet().start()
    try:
        yield ha
    finally:
        ha.stop()


class Interrupted(Exception):
    pass


def test_a_read_cut_short_leaves_no_reply_for_the_next_command(sentinels: SentinelSet) -> None:
    client = connect(RedisSettings(url=sentinels.url))
    client.set("k", "v")

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):  # a blocking read cut short, its reply still to come
            client.blpop(["nothing-here"], timeout=3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # the next commands get their own replies, not the BLPOP's nil of 3 s later
    assert client.get("k") == b"v"
    assert client.incr("n") == 1
    assert client.get("k") == b"v"


def test_the_judge_stops_at_the_runs_stop_with_the_sentinels_url(
    sentinels: SentinelSet, run_name: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(ROLLSTREAM_REDIS__URL=sentinels.url, ROLLSTREAM_RUN=run_name,
               ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]')  # fmt: skip
    log = tmp_path / "judge.log"
    with log.open("wb") as out:
        judge = subprocess.Popen([sys.executable, "-m", "rollstream.cli.main", "judge"], env=env,
                                 stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        # Given the judge idle in rq's blocking dequeue
        started = b"published the run's shared settings"
        wait_for(lambda: started in log.read_bytes() or judge.poll() is not None, timeout=60)
        assert judge.poll() is None, log.read_text()
        # When the run stops, Then the judge stops, cleanly
        stop = subprocess.run([sys.executable, "-m", "rollstream.cli.main", "stop"], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert stop.returncode == 0, stop.stderr
        assert judge.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if judge.poll() is None:
            judge.kill()
            judge.wait()
    assert b"judge: worker" in log.read_bytes() and b"stopped" in log.read_bytes()
