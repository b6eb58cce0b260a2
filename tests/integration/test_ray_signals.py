"""A process that starts Ray keeps SIGTERM its own (producer/ray_signals.py): a SIGTERM
once Ray is up, and another after ``ray.shutdown``, reach the process's handler, which
stops it with exit 0, where Ray's handlers ended it with status 15 (``sys.exit``), 1
(its local cluster's) or -15 (the default action its C-level handler left behind).
The demo, on Ray through the learning recipe, reports what it trained and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import rollstream, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# a caller of the recipes: its own SIGTERM handler, a local Ray started as run_learning does
CALLER = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
import ray
from rollstream.producer.ray_signals import init_ray_keeping_signals
init_ray_keeping_signals(local=True)
print("ray up", flush=True)
while not got:
    time.sleep(0.05)
ray.shutdown()
print("ray down", flush=True)
while len(got) < 2:
    time.sleep(0.05)
print("stopped by", len(got), "SIGTERMs", flush=True)
"""

RAY_STACK_TRACE = "SIGTERM received at time"  # the core worker's failure-signal handler


class Watched:
    """A process with its stdout and stderr in files, read while it runs."""

    def __init__(self, folder: Path, command: list[str]) -> None:
        self.out, self.err = folder / "out", folder / "err"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS"))}
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=folder)

    def says(self, text: str) -> bool:
        assert self.proc.poll() is None, f"exited with {self.proc.returncode}: {self.err.read_text()[-3000:]}"
        return text in self.out.read_text()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[list[Watched]]:
    started: list[Watched] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=30)


@pytest.mark.timeout(240)
def test_sigterm_with_ray_up_and_after_its_shutdown_is_the_processs_own(
    watched: list[Watched], tmp_path: Path
) -> None:
    caller = Watched(tmp_path, [sys.executable, "-c", CALLER])
    watched.append(caller)
    wait_for(lambda: caller.says("ray up"), timeout=180, interval=0.2)

    caller.proc.send_signal(signal.SIGTERM)  # Ray's sys.exit(15) without the hardening
    wait_for(lambda: caller.says("ray down"), timeout=60, interval=0.2)
    code = caller.stop()  # the default action that ray.shutdown left behind without it

    err = caller.err.read_text()
    assert code == 0, err[-3000:]
    assert "stopped by 2 SIGTERMs" in caller.out.read_text()
    assert RAY_STACK_TRACE not in err


@pytest.mark.heavy
@pytest.mark.timeout(420)
def test_the_learning_demo_stops_on_sigterm_after_a_step_and_reports(
    watched: list[Watched], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    demo = Watched(tmp_path, rollstream("demo", "--steps", "700", "--plot", ""))
    watched.append(demo)
    wait_for(lambda: demo.says("engines ready; training"), timeout=360, interval=0.2)  # with step 1

    code = demo.stop()

    out, err = demo.out.read_text(), demo.err.read_text()
    assert code == 0, err[-3000:]
    assert "stopped by SIGTERM after" in out
    steps = int(out.split("stopped by SIGTERM after ")[1].split()[0])
    assert 1 <= steps < 700
    assert "summary" in out and "prompts lost" in out
    lost = next(line for line in out.splitlines() if line.strip().startswith("prompts lost"))
    assert lost.split()[-1] == "0", out[-2000:]
    assert RAY_STACK_TRACE not in err
