"""A real 3-master Redis Cluster (redis-server --cluster-enabled yes, redis-cli --cluster
create, on free ports): two runs whose hash tags live on different masters, each end to
end as processes (feed, produce with local engines, train), and `rollstream status`
against the cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from rollstream.shared.keys import Keys
from tests.ha import Cluster
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
BATCH = 4


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    nodes = Cluster().start()
    yield nodes
    nodes.stop()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollstream.cli.main", *args]


def _env(url: str, run: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=url,
        ROLLSTREAM_RUN=run,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
        ROLLSTREAM_ROLLOUT__BATCH_SIZE=str(BATCH),
        ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="20",
        ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS="100",
        ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
        ROLLSTREAM_PRODUCER__HEARTBEAT_S="0.2",
    )
    return env


@pytest.mark.timeout(300)
def test_two_runs_on_different_masters_each_run_end_to_end(
    cluster: Cluster, run_name: str, tmp_path: Path
) -> None:
    # two runs whose keys hash to different masters
    by_master: dict[int, str] = {}
    for i in range(50):
        run = f"{run_name}{i}"
        by_master.setdefault(cluster.node_of(Keys(run).state).port, run)
    runs = list(by_master.values())[:2]
    assert len(runs) == 2
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "{i} + 1?", "answer": "{i + 1}"}}\n' for i in range(40))
    )
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for run in runs:
            env = _env(cluster.url, run)
            feed = subprocess.run(_cli("feed", str(prompts), "--task", "math"), env=env, capture_output=True,
                                  text=True, timeout=60, cwd=ROOT)  # fmt: skip
            assert feed.returncode == 0, feed.stderr
            for name, args in (
                ("producer", ["produce", "--local-engines"]),
                ("trainer", ["train", "--steps", str(STEPS), "--step-time", "0.1", "--stop-run"]),
            ):
                log = tmp_path / f"{run}-{name}.log"
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        _cli(*args), env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
                    )
                procs.append((f"{run} {name}", proc, log))
        wait_for(lambda: all([p.poll() is not None for _, p, _ in procs]), timeout=240)
    finally:
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tails = "\n".join(f"--- {name}\n{log.read_text(errors='replace')[-2000:]}" for name, _, log in procs)
    assert [p.returncode for _, p, _ in procs] == [0] * 4, tails
    for run in runs:
        status = subprocess.run(_cli("status", "--json"), env=_env(cluster.url, run), capture_output=True,
                                text=True, timeout=60, cwd=ROOT)  # fmt: skip
        assert status.returncode == 0, status.stderr
        result = orjson.loads(status.stdout)
        account = result["accounts"]["math"]
        assert result["train_step"] == STEPS and account["trained"] == STEPS * BATCH, account
        assert account["lost"] == 0 and account["fed"] == 40, account
        for command in (["show", "dead"], ["steps"], ["check"], ["pause"], ["resume"]):  # the CLI's others
            done = subprocess.run(_cli(*command), env=_env(cluster.url, run), capture_output=True, text=True,
                                  timeout=60, cwd=ROOT)  # fmt: skip
            assert done.returncode == 0, (command, done.stderr)
        # the run's keys are all on its own master
        master = cluster.node_of(Keys(run).state).client()
        assert master.exists(Keys(run).groups("math")) and master.exists(Keys(run).progress)


def test_the_rq_judge_queue_is_refused_on_a_cluster_naming_the_setting(
    cluster: Cluster, run_name: str
) -> None:
    """rq's keys share no hash tag (its MULTIs cross slots): said at start, not faked."""
    env = _env(cluster.url, run_name)
    judge = subprocess.run(_cli("judge"), env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert judge.returncode == 2 and "redis.url" in judge.stderr and "rq judge worker" in judge.stderr
    env["ROLLSTREAM_PRODUCER__JUDGE_ON_QUEUE"] = "true"
    produce = subprocess.run(_cli("produce", "--local-engines", "--burst"), env=env, capture_output=True,
                             text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert produce.returncode == 2, produce.stderr
    assert "producer.judge_on_queue" in produce.stderr and "Redis Cluster" in produce.stderr
