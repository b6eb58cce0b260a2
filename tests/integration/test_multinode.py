"""A run on a multi-node Ray cluster on one machine (tests/raycluster.py): a head and two
worker nodes, each a `ray start` of its own with its own custom resources and labels,
token authentication on. The engines process, two producers and a trainer run as the
README's "On several machines" section says. Engines land on the worker nodes as the
placement settings say; `rollstream engines scale` grows and shrinks them mid-run; a
worker node killed mid-run is survived. Every prompt is trained exactly once.

One cluster for the module (it takes half a minute); the node-death test kills a
worker node, so it runs last.
"""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from rollstream.producer.fleet.scaling import EngineCount
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys, Role
from rollstream.shared.liveness import live_processes
from tests.helpers import rollstream, wait_for
from tests.raycluster import RayCluster

# the cluster's start counts in the first test's time, and each run takes a minute or two:
# three Ray nodes and a run's processes, heavy on a small machine (`make test-all`, CI)
pytestmark = [pytest.mark.integration, pytest.mark.heavy, pytest.mark.timeout(600)]

WORKERS = ("worker1", "worker2")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """Head: no engine may run there (it lacks the `rollout` resource and the `gen`
    label). Two worker nodes: 2 `rollout` each, and 2 GPUs each (declared: Ray schedules
    them, nothing uses them) for the tensor-parallel placement group test."""
    ray_cluster = RayCluster(tmp_path_factory.mktemp("ray"))
    try:
        ray_cluster.start_head(num_cpus=1)
        for name in WORKERS:
            ray_cluster.add_node(
                name, num_cpus=2, resources={"rollout": 2}, num_gpus=2, labels={"node": name, "pool": "gen"}
            )
        yield ray_cluster
    finally:
        ray_cluster.stop()


class Run:
    """The processes of one run on the cluster, by their Popen handles."""

    def __init__(self, cluster: RayCluster, url: str, run: str, folder: Path, **settings: str) -> None:
        self.folder = folder
        self.client = redis.Redis.from_url(url)
        self.keys = Keys(run)
        self.record = folder / "trainer.record.jsonl"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {
            **cluster.env,
            "ROLLSTREAM_RUN": run,
            "ROLLSTREAM_REDIS__URL": url,
            "ROLLSTREAM_RAY__ADDRESS": cluster.address,
            "ROLLSTREAM_TASKS": '[{"name": "math", "n": 2}]',
            "ROLLSTREAM_ROLLOUT__BATCH_SIZE": "4",
            "ROLLSTREAM_PRODUCER__IS_VALID": "keep_all",
            "ROLLSTREAM_PRODUCER__MAX_INFLIGHT": "4",
            "ROLLSTREAM_PRODUCER__HEARTBEAT_S": "0.5",
            "ROLLSTREAM_BUFFER__CLAIM_IDLE_MS": "3000",
            "ROLLSTREAM_ENGINES__COUNT": "2",
            "ROLLSTREAM_ENGINES__NUM_CPUS": "0",
            "ROLLSTREAM_ENGINES__MAX_RESTARTS": "-1",
            "ROLLSTREAM_ENGINES__RESOURCES": '{"rollout": 1}',
            "ROLLSTREAM_ENGINES__NODE_LABELS": '{"pool": "gen"}',
            "ROLLSTREAM_ENGINES__STRATEGY": "spread",
            "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "5",
            "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "200",
            "ROLLSTREAM_PROCESS__STOP_TIMEOUT_S": "10",
            **settings,
        }

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.folder / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(rollstream(*args), env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def alive(self) -> bool:
        for name, proc in self.procs.items():
            code = proc.poll()
            assert code is None or name == "trainer", f"{name} exited with {code}: {self.log(name)[-3000:]}"
        return True

    def feed(self, count: int) -> None:
        path = self.folder / "prompts.jsonl"
        path.write_text(
            "".join(
                f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n'
                for i in range(count)
            )
        )
        done = subprocess.run(
            rollstream("feed", str(path), "--task", "math"), env=self.env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr

    def engines_beat(self) -> dict[str, Any]:
        beats = [b for b in live_processes(self.client, self.keys) if b.role == Role.ENGINES]
        return beats[0].detail if beats else {}

    def nodes(self) -> list[str | None]:
        return list(self.engines_beat().get("nodes") or [])

    def train_step(self) -> int:
        return RunControl(self.client, self.keys).train_step()

    def scale(self, count: int) -> None:
        done = subprocess.run(
            rollstream("engines", "scale", str(count), "--wait"),
            env={**self.env, "ROLLSTREAM_PROCESS__WAIT_TIMEOUT_S": "180"},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr
        assert f"{count} engines serving" in done.stdout

    def trained(self) -> Counter[str]:
        """Group ids in committed steps, as many times as each was trained."""
        reads: dict[int, list[Any]] = {}
        times: Counter[str] = Counter()
        for line in self.record.read_bytes().splitlines():
            entry = orjson.loads(line)
            if entry["event"] == "read":
                reads[entry["step"]] = entry["groups"]
            else:
                times.update(g for g, _ in reads.pop(entry["step"], []))
        return times

    def finish(self, timeout: float = 300) -> None:
        """The trainer stops the run at its last step: every process exits 0."""
        for name, proc in self.procs.items():
            code = proc.wait(timeout=timeout)
            assert code == 0, f"{name} exited with {code}: {self.log(name)[-3000:]}"

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.client.close()


@pytest.fixture
def make_run(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> Iterator[Any]:
    runs: list[Run] = []

    def make(cluster: RayCluster, **settings: str) -> Run:
        run = Run(cluster, redis_server.url, run_name, tmp_path, **settings)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.kill_all()


def start_pipeline(run: Run, prompts: int, steps: int, step_time: float = 0.5) -> None:
    run.feed(prompts)
    run.start("engines", "engines", "--foreground")
    wait_for(lambda: run.alive() and len([n for n in run.nodes() if n]) == 2, timeout=180, interval=0.5)
    for i in range(2):
        run.start(f"producer-{i}", "produce")
    run.start(
        "trainer",
        "train",
        "--steps",
        str(steps),
        "--step-time",
        str(step_time),
        "--record",
        str(run.record),
        "--stop-run",
    )


def every_prompt_trained_once(run: Run, prompts: int) -> None:
    times = run.trained()
    expected = {f"math:q{i}" for i in range(prompts)}
    assert set(times) == expected, f"missing {sorted(expected - set(times))[:10]}"
    assert max(times.values()) == 1, [g for g, n in times.items() if n > 1]
    assert run.client.xlen(run.keys.dead) == 0


def test_tensor_parallel_engines_each_reserve_a_node_s_gpus(cluster: RayCluster, make_run: Any) -> None:
    # Given engines of 2 GPUs each (tensor_parallel_size 2) and 2 GPUs per worker node,
    run = make_run(cluster, ROLLSTREAM_ENGINES__TENSOR_PARALLEL_SIZE="2", ROLLSTREAM_ENGINES__STRATEGY="pack")
    run.start("engines", "engines", "--foreground")
    # Then each engine's placement group takes one worker node whole: one engine per node
    nodes = wait_for(lambda: run.alive() and [n for n in run.nodes() if n], timeout=180, interval=0.5)
    wait_for(lambda: len([n for n in run.nodes() if n]) == 2, timeout=60, interval=0.5)
    assert sorted(run.nodes()) == list(WORKERS), nodes


def test_engines_land_on_the_worker_nodes_and_scale_mid_run(cluster: RayCluster, make_run: Any) -> None:
    prompts, steps = 120, 30
    run = make_run(cluster)
    start_pipeline(run, prompts, steps)
    # spread, and only where `rollout` and the `gen` label are: one engine per worker node
    assert sorted(run.nodes()) == list(WORKERS)
    assert EngineCount(run.client, run.keys).serving() == 2

    # When the run is under way, scale out to 3 engines
    wait_for(lambda: run.alive() and run.train_step() >= 2, timeout=180, interval=0.5)
    run.scale(3)
    assert EngineCount(run.client, run.keys).serving() == 3
    wait_for(lambda: run.alive() and len([n for n in run.nodes() if n]) == 3, timeout=60, interval=0.5)
    assert set(run.nodes()) <= set(WORKERS)

    # Then producers send the new engine groups without a restart
    def new_engine_busy() -> bool:
        busy = run.engines_beat().get("busy") or []
        return run.alive() and len(busy) == 3 and (busy[2] or 0) > 0

    wait_for(new_engine_busy, timeout=120, interval=0.5)
    step_at_scale_in = run.train_step()
    assert step_at_scale_in < steps  # still mid-run

    # When it scales in to 1 engine (two drained and removed), the run goes on to its end
    run.scale(1)
    wait_for(lambda: run.alive() and len(run.nodes()) == 1, timeout=60, interval=0.5)
    assert run.train_step() < steps
    run.finish()
    every_prompt_trained_once(run, prompts)
    log = run.log("engines")
    assert "scaling out from 2 to 3 engines" in log and "scaling in from 3 to 1 engines" in log


def test_a_worker_node_that_dies_mid_run_is_survived(cluster: RayCluster, make_run: Any) -> None:
    # Given one engine per worker node (each takes a node's whole `rollout`)
    prompts, steps = 160, 40
    run = make_run(cluster, ROLLSTREAM_ENGINES__RESOURCES='{"rollout": 2}')
    start_pipeline(run, prompts, steps, step_time=1.0)
    assert sorted(run.nodes()) == list(WORKERS)
    wait_for(lambda: run.alive() and run.train_step() >= 2, timeout=180, interval=0.5)

    victim = run.nodes().index("worker2")
    # When worker2 dies (every process of it, kill -9), its engine has no node to go to:
    cluster.kill_node("worker2")
    # one warning says what it waits for, and the run goes on on the engine left
    warning = f"engine {victim} has not answered"
    wait_for(lambda: run.alive() and warning in run.log("engines"), timeout=120, interval=0.5)
    assert run.nodes()[victim] is None and run.nodes()[1 - victim] == "worker1"
    step = run.train_step()
    wait_for(lambda: run.alive() and run.train_step() >= step + 3, timeout=60, interval=0.5)
    assert run.train_step() < steps

    # When a node with room joins, the engine comes back there, and the run goes on to its end
    cluster.add_node(
        "worker3", num_cpus=2, resources={"rollout": 2}, labels={"node": "worker3", "pool": "gen"}
    )
    back = ["worker1", "worker3"]
    wait_for(lambda: run.alive() and sorted(map(str, run.nodes())) == back, timeout=180, interval=0.5)
    assert run.train_step() < steps
    run.finish()
    every_prompt_trained_once(run, prompts)
    log = run.log("engines")
    assert log.count("has not answered") == 1 and f"engine {victim} answers again" in log
