"""A run whose Ray drivers run no Ray node, as in a container or pod of their own (deploy/
Compose and Kubernetes): the engines process and a producer each in a PID namespace of
their own (`unshare --pid`: the raylet's process is not in their view, which Ray's GCS
path needs), joining through the head's Ray Client server (ray.address ray://HEAD:PORT)
with token authentication on. The run trains its steps, every process exits 0, and
`rollstream status` finds nothing lost."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys, Role
from rollstream.shared.liveness import live_processes
from tests.conftest import CI
from tests.helpers import rollstream, wait_for
from tests.raycluster import RayCluster

pytestmark = [pytest.mark.integration, pytest.mark.heavy, pytest.mark.timeout(600)]


def pid_namespace() -> list[str]:
    """The command prefix that runs a process in a PID namespace of its own (and a /proc
    of it), killed with the unshare process the test holds."""
    unshare = shutil.which("unshare")
    prefix = [unshare or "unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if os.geteuid() != 0:
        prefix[1:1] = ["--user", "--map-root-user"]
    works = unshare is not None and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0
    if not works:
        if CI:
            raise RuntimeError("CI runs this test: it needs unshare with PID namespaces (util-linux)")
        pytest.skip("no PID namespaces here (unshare --pid)")
    return prefix


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    ray_cluster = RayCluster(tmp_path_factory.mktemp("ray"))
    try:
        ray_cluster.start_head(num_cpus=1)
        ray_cluster.add_node("worker1", num_cpus=2, resources={"rollout": 2})
        yield ray_cluster
    finally:
        ray_cluster.stop()


def test_drivers_outside_every_ray_node_run_a_whole_run_through_ray_client(
    cluster: RayCluster, redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    prefix = pid_namespace()
    env = {
        **cluster.env,
        "ROLLSTREAM_RUN": run_name,
        "ROLLSTREAM_REDIS__URL": redis_server.url,
        "ROLLSTREAM_RAY__ADDRESS": cluster.client_address,
        "ROLLSTREAM_TASKS": '[{"name": "math", "n": 2}]',
        "ROLLSTREAM_ROLLOUT__BATCH_SIZE": "4",
        "ROLLSTREAM_PRODUCER__IS_VALID": "keep_all",
        "ROLLSTREAM_PRODUCER__HEARTBEAT_S": "0.5",
        "ROLLSTREAM_ENGINES__COUNT": "1",
        "ROLLSTREAM_ENGINES__NUM_CPUS": "0",
        "ROLLSTREAM_ENGINES__RESOURCES": '{"rollout": 1}',
        "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "20",
        "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "50",
        "ROLLSTREAM_PROCESS__STOP_TIMEOUT_S": "10",
    }
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "{i} + 1?", "answer": "{i + 1}"}}\n' for i in range(12))
    )
    fed = subprocess.run(
        rollstream("feed", str(prompts), "--task", "math"), env=env, capture_output=True, text=True
    )
    assert fed.returncode == 0, fed.stderr
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, *args: str, namespaced: bool = True) -> None:
        with (tmp_path / f"{name}.log").open("wb") as out:
            command = [*prefix, *rollstream(*args)] if namespaced else rollstream(*args)
            procs[name] = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    def engines_up() -> bool:
        code = procs["engines"].poll()
        assert code is None, f"engines exited with {code}: {log('engines')[-3000:]}"
        return any(b.role == Role.ENGINES for b in live_processes(client, keys))

    try:
        start("engines", "engines", "--foreground")
        wait_for(engines_up, timeout=240, interval=0.5)
        # the engines process records the address it joined by, which producers follow
        assert RunControl(client, keys).ray_address() == cluster.client_address
        start("producer", "produce")
        start("trainer", "train", "--steps", "3", "--step-time", "0.1", "--stop-run",
              "--weights-dir", str(tmp_path / "weights"), namespaced=False)  # fmt: skip
        for name in ("trainer", "producer", "engines"):
            code = procs[name].wait(timeout=300)
            assert code == 0, f"{name} exited with {code}: {log(name)[-3000:]}"
        assert RunControl(client, keys).train_step() == 3
        status = subprocess.run(rollstream("status", "--json"), env=env, capture_output=True, text=True)
        assert status.returncode == 0, status.stderr
        accounts = orjson.loads(status.stdout)["accounts"]
        assert accounts["math"]["trained"] >= 12 // 4 * 3 // 3 and accounts["math"]["lost"] == 0, accounts
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()  # unshare --kill-child takes its child with it
                proc.wait(timeout=60)
        client.close()
