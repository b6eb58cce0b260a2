"""The chaos suite kills only the engine actors of the cluster it started: a process on
the same machine titled like an engine actor (another run's, another user's) survives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.run import ENGINE_ACTOR, Chaos, Child, engine_actor_pids
from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="ps and exec -a")

# Stands in for `rollstream engines --foreground`: its child is titled as Ray titles an
# actor at work, and it reaps that child when it dies (as a raylet does).
ENGINES = (
    "import subprocess, sys, time\n"
    "actor = subprocess.Popen(['bash', '-c', 'exec -a " + ENGINE_ACTOR + ".generate sleep 300'])\n"
    "print(actor.pid, flush=True)\n"
    "actor.wait()\n"
    "time.sleep(300)\n"
)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_only_the_runs_own_engine_actor_is_killed(tmp_path: Path) -> None:
    decoy = subprocess.Popen(["bash", "-c", f"exec -a {ENGINE_ACTOR} sleep 300"])
    engines = subprocess.Popen([sys.executable, "-c", ENGINES], stdout=subprocess.PIPE)
    try:
        assert engines.stdout is not None
        actor = int(engines.stdout.readline())
        # both are what `pgrep -f ray::EngineActor` finds; only one is this run's
        wait_for(lambda: engine_actor_pids(engines.pid) == [actor])
        assert decoy.pid not in engine_actor_pids(engines.pid)

        chaos = Chaos(tmp_path, prompts=1, steps=1, seconds_between_faults=1.0, faults=(), seed=0)
        chaos.children["engines"] = Child("engines", lambda: [], tmp_path / "engines.log", proc=engines)
        chaos._kill_engine_actor()
        wait_for(lambda: not _exists(actor))
        chaos._kill_engine_actor()  # none of the run's left: nothing else is killed
        assert decoy.poll() is None, "a process outside the run's cluster was killed"
        assert [d for _, kind, d in chaos.timeline if kind == "kill -9"] == [f"engine actor (pid {actor})"]
    finally:
        for proc in (decoy, engines):
            proc.kill()
            proc.wait()
        if engines.stdout is not None:
            engines.stdout.close()
