"""A multi-node Ray cluster on one machine, for tests: a head and worker nodes, each a
``ray start --block`` process of its own (its own temp dir, CPUs and custom resources),
with token authentication on, as Ray 2.60 has it by default, and a token of the
cluster's own. Everything listens on 127.0.0.1 on ports picked free.

Each node is stopped by the PID of its ``ray start`` (SIGTERM: it stops the Ray
processes it started); ``kill_node`` kills a worker node's processes (the ``ray start``
and every process under it, by PID) as a machine that dies would. Nothing here acts on
a Ray process it did not start: never ``ray stop``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.helpers import wait_for

log = logging.getLogger(__name__)
# Ray's CLI of this interpreter: its `ray` script, or the module behind it where the
# environment has no script of its own (a venv layered on another one's packages)
_SCRIPT = Path(sys.executable).with_name("ray")
RAY = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RayNode:
    name: str
    process: subprocess.Popen[bytes]
    temp_dir: Path
    log_path: Path
    resources: dict[str, float]

    def processes(self) -> list[psutil.Process]:
        """The ``ray start`` of this node and every process under it."""
        try:
            top = psutil.Process(self.process.pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


@dataclass
class RayCluster:
    root: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    port: int = field(default_factory=free_port)
    client_port: int = field(default_factory=free_port)  # the head's Ray Client server
    nodes: dict[str, RayNode] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def client_address(self) -> str:
        """The head's Ray Client server, for a driver that runs no node of the cluster."""
        return f"ray://127.0.0.1:{self.client_port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process that joins this cluster needs in its environment."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ROLLSTREAM_"))}
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
            # a node that dies is declared dead within seconds, not Ray's default half minute
            RAY_health_check_period_ms="1000",
            RAY_health_check_failure_threshold="3",
            RAY_health_check_timeout_ms="1000",
        )
        return env

    def start_head(self, num_cpus: float = 1, resources: dict[str, float] | None = None) -> RayNode:
        extra = ["--head", "--port", str(self.port), "--include-dashboard=false", "--disable-usage-stats"]
        extra += ["--ray-client-server-port", str(self.client_port)]
        return self._start("head", extra, num_cpus, resources or {})

    def add_node(self, name: str, num_cpus: float = 1, resources: dict[str, float] | None = None,
                 num_gpus: int = 0, labels: dict[str, str] | None = None) -> RayNode:  # fmt: skip
        extra = ["--address", self.address]
        if num_gpus:
            extra += ["--num-gpus", str(num_gpus)]
        if labels:
            extra += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        return self._start(name, extra, num_cpus, resources or {})

    def _start(self, name: str, extra: list[str], num_cpus: float, resources: dict[str, float]) -> RayNode:
        temp_dir = self.root / name
        temp_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.root / f"{name}.log"
        command = [
            *RAY, "start", "--block", *extra,
            "--node-ip-address", "127.0.0.1",
            "--num-cpus", str(num_cpus),
            "--resources", json.dumps({name: 1, **resources}),
            "--temp-dir", str(temp_dir),
            "--object-store-memory", str(80 * 1024 * 1024),
            "--dashboard-agent-listen-port", str(free_port()),
            "--min-worker-port", "0", "--max-worker-port", "0",
        ]  # fmt: skip
        with log_path.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        node = RayNode(name, process, temp_dir, log_path, {name: 1, **resources})
        self.nodes[name] = node
        wait_for(lambda: name in self.alive_resources() or self._failed(node), timeout=120, interval=1.0)
        return node

    def _failed(self, node: RayNode) -> bool:
        if node.process.poll() is not None:
            raise AssertionError(f"ray start of node {node.name} exited: {node.log_path.read_text()[-2000:]}")
        return False

    def alive_resources(self) -> dict[str, float]:
        """The custom resources of the nodes alive, as the cluster sees them."""
        out = subprocess.run(
            [*RAY, "status", "--address", self.address],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        ).stdout
        found: dict[str, float] = {}
        for line in out.splitlines():
            parts = line.strip().split()
            # "0.0/1.0 worker1" under Resources (the usage lines of each resource)
            if len(parts) == 2 and "/" in parts[0]:
                try:
                    found[parts[1]] = float(parts[0].split("/")[1])
                except ValueError:  # memory: "0B/21.72GiB memory"
                    continue
        return found

    def kill_node(self, name: str) -> None:
        """A worker node dies: every process of it is killed at once (SIGKILL, by PID)."""
        node = self.nodes[name]
        for process in reversed(node.processes()):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=30)

    def stop(self) -> None:
        """Stop every node, worker nodes first, each by the PID of its ``ray start``, then
        whatever of its processes outlived it (by the PIDs seen under it before)."""
        for node in sorted(self.nodes.values(), key=lambda n: n.name == "head"):
            started = node.processes()
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
                try:
                    node.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait(timeout=10)
            _, alive = psutil.wait_procs(started, timeout=10)
            for process in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
