"""Compose projects on a Docker engine of a test's own (tests/integration/test_compose_run.py):
the engine's teardown, which leaves nothing of it behind even after a failed step, and a
project's containers, its Redis and its Prometheus, reached at the containers' addresses
(nothing is published on the machine)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import psutil
import redis

from rollstream.shared.keys import GROUP_OF_KIND, PRODUCERS, Keys

ROLLSTREAM_SERVICES = ("engines", "producer", "judge", "feeder", "trainer", "metrics", "archive")
RUN = "exp1"  # the layout's ROLLSTREAM_RUN
TASK = "math"  # the layout's one task
SHIMS: list[psutil.Process] = []  # the containers' shims, for a teardown after the engine stalled


def run(command: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, (
        f"{command[:3]} exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    )
    return done


def stop_engine(engine: subprocess.Popen[bytes], env: dict[str, str], root: Path) -> None:
    """Everything the engine made goes, even after a failed step: its containers and
    networks while it answers, then the engine by its PID; what a stalled engine leaves
    (its containers' shims, its bridges, its mounts) by what was seen of it; and its data
    root (the images: gigabytes) once nothing is mounted there."""
    shims = [*SHIMS, *container_shims(env)]  # seen after `up`, and now if it answers
    networks: list[str] = []
    with contextlib.suppress(subprocess.SubprocessError):  # its containers first, while it answers
        ids = subprocess.run(["docker", "ps", "-aq"], env=env, capture_output=True, text=True, timeout=120)
        if ids.stdout.split():
            subprocess.run(
                ["docker", "rm", "-f", *ids.stdout.split()], env=env, capture_output=True, timeout=300
            )
        listed = ["docker", "network", "ls", "-q", "--no-trunc", "--filter", "type=custom"]
        networks = subprocess.run(listed, env=env, capture_output=True, text=True, timeout=120).stdout.split()
        subprocess.run(["docker", "network", "prune", "-f"], env=env, capture_output=True, timeout=300)
    engine.send_signal(signal.SIGTERM)  # it stops its containerd
    try:
        engine.wait(timeout=120)
    except subprocess.TimeoutExpired:
        engine.kill()
        engine.wait()
    for shim in shims:  # by the PIDs seen above, with everything under them
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in [*shim.children(recursive=True), shim]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
    for network in networks:  # a bridge network's interface is br- and its id's first 12
        if Path(f"/sys/class/net/br-{network[:12]}").exists():
            subprocess.run(["ip", "link", "delete", f"br-{network[:12]}"], capture_output=True, timeout=60)
    for line in reversed(Path("/proc/mounts").read_text().splitlines()):
        mount = line.split()[1]
        if mount.startswith(str(root)):
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=60)
    if not any(
        line.split()[1].startswith(str(root)) for line in Path("/proc/mounts").read_text().splitlines()
    ):
        for folder in ("data", "exec"):
            shutil.rmtree(root / folder, ignore_errors=True)


def container_shims(env: dict[str, str]) -> list[psutil.Process]:
    """The containerd shims of the engine's containers (each container's first process's
    parent), by PID, while the engine answers."""
    shims: list[psutil.Process] = []
    with contextlib.suppress(subprocess.SubprocessError, ValueError):
        ids = subprocess.run(["docker", "ps", "-q"], env=env, capture_output=True, text=True, timeout=120)
        if not ids.stdout.split():
            return shims
        pids = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", *ids.stdout.split()], env=env,
                              capture_output=True, text=True, timeout=120).stdout.split()  # fmt: skip
        for pid in map(int, pids):
            with contextlib.suppress(psutil.NoSuchProcess):
                parent = psutil.Process(pid).parent() if pid else None
                if parent is not None and "containerd-shim" in parent.name():
                    shims.append(parent)
    return shims


class Project:
    """One Compose project on the test's engine: its command line, its containers (keyed
    "service_N"), and Redis and Prometheus at their containers' addresses."""

    def __init__(self, name: str, compose: list[str], env: dict[str, str], password: str) -> None:
        self.name, self.compose, self.env, self.password = name, compose, env, password

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return run([*self.compose, *args], timeout=timeout, env=self.env)

    def docker(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return run(["docker", *args], timeout=timeout, env=self.env)

    def containers(self) -> dict[str, dict[str, Any]]:
        ids = self.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.name}").stdout
        found = orjson.loads(self.docker("inspect", *ids.split()).stdout) if ids.split() else []
        return {c["Config"]["Labels"]["com.docker.compose.service"] + c["Name"][-2:]: c for c in found}

    def logs(self, key: str) -> str:
        return self.run("logs", "--no-color", "--tail", "40", key.rsplit("_", 1)[0]).stdout[-4000:]

    def address(self, key: str) -> str:
        """The container's address on the project's network, "" while it has none (stopped)."""
        (network,) = self.containers()[key]["NetworkSettings"]["Networks"].values()
        return str(network["IPAddress"] or "")

    def rollstream_exited(self, killed: str = "") -> dict[str, dict[str, Any]] | None:
        """Every rollstream container, once all have exited (0, but ``killed``'s 137);
        a crash or a restart loop fails at once, not at the deadline."""
        ours = {k: c for k, c in self.containers().items() if k.rsplit("_", 1)[0] in ROLLSTREAM_SERVICES}
        for key, c in ours.items():
            assert c["State"]["Status"] != "restarting", (key, self.logs(key))
            if c["State"]["Status"] == "exited":
                assert c["State"]["ExitCode"] == (137 if key == killed else 0), (
                    key,
                    c["State"],
                    self.logs(key),
                )
        return ours if all(c["State"]["Status"] == "exited" for c in ours.values()) else None

    def redis(self) -> redis.Redis | None:
        """The project's Redis at its container's address (never a default host: the
        machine's own Redis is not this test's), None while it has no address."""
        host = self.address("redis_1")
        # as the admin user (deploy/redis/acl.sh): the default user is off
        return (
            redis.Redis(host=host, username="admin", password=self.password, socket_timeout=10)
            if host
            else None
        )

    def state(self) -> dict[str, str] | None:
        """The run's state hash (train_step, run_id), None while Redis does not answer."""
        client = self.redis()
        with contextlib.suppress(redis.RedisError, OSError):
            return (
                {k.decode(): v.decode() for k, v in client.hgetall(Keys(RUN).state).items()}
                if client
                else None
            )
        return None

    def claims(self, hostname: str) -> int | None:
        """What the producer of the container ``hostname`` holds pending (consumer
        "producer-HOSTNAME-PID") in the pools producers claim from; None while Redis does
        not answer."""
        client, keys, held = self.redis(), Keys(RUN), 0
        for kind in (k for k, group in GROUP_OF_KIND.items() if group == PRODUCERS):
            try:
                consumers = client.xinfo_consumers(keys.stream(kind, TASK), PRODUCERS) if client else None
            except redis.ResponseError:  # a pool never written to: no stream, no group
                continue
            except (redis.RedisError, OSError):
                return None
            if consumers is None:
                return None
            held += sum(int(c["pending"]) for c in consumers if f"-{hostname}-" in c["name"].decode())
        return held

    def prometheus(self, query: str) -> Any:
        """An answer of Prometheus's HTTP API, None while it does not answer."""
        host = self.address("prometheus_1")
        url = f"http://{host}:9090/api/v1/{query}"
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=10) as answer,
        ):
            return orjson.loads(answer.read())["data"]
        return None

    def running(self, key: str) -> bool:
        """True while ``key``'s container runs: a fault is injected mid-run or not at all."""
        assert self.containers()[key]["State"]["Running"], f"{key} ended before the faults: {self.logs(key)}"
        return True

    def status(self) -> dict[str, Any]:
        command = ["run", "--rm", "--no-deps", "-T", "metrics", "rollstream", "status", "--json"]
        return dict(orjson.loads(self.run(*command, timeout=300).stdout))

    def committed(self, folder: Path) -> Counter[str]:
        """How many committed steps trained each group, from the trainer's --record."""
        self.docker("cp", f"{self.name}_trainer_1:/state/record.jsonl", str(folder / "record.jsonl"))
        reads: dict[int, list[str]] = {}
        times: Counter[str] = Counter()
        for line in (folder / "record.jsonl").read_bytes().splitlines():
            entry = orjson.loads(line)
            if entry["event"] == "read":  # a step read again: the earlier read was never committed
                reads[entry["step"]] = [g for g, _ in entry["groups"]]
            else:
                times.update(reads.pop(entry["step"]))
        return times
