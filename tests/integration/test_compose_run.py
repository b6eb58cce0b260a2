"""deploy/compose run for real (`make compose-check`): a Docker engine of the test's own
(its own data root, exec root and socket in a temporary folder, --iptables=false and no
default bridge, so the machine's firewall and networks stay as they are; stopped by its
PID), a base image built from Debian's packages (debootstrap: python3, its venv, Redis),
the rollstream image built from deploy/Dockerfile on it from a wheelhouse of the pinned
versions (deploy/constraints.txt), then Compose's layout: Redis, a Ray head and worker,
the engines process, two producers, the judge, the feeder, the trainer, the metrics and
the archiver. The trainer's steps done, every rollstream container has exited 0 and
`rollstream status` finds nothing lost; everything is torn down.

What differs from `docker compose up` as the README has it: Debian's docker-compose
(Compose v1) wants no top-level `name:` (the project is named with -p), no port is
published on the machine, Prometheus, Alertmanager and Grafana (images from a registry)
are not started, and an override makes the run short (3 steps, small batches, simulated
engines at 50x). Needs root, docker.io, docker-compose and debootstrap, and a Debian
mirror and a Python package index for the base image and the wheelhouse."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest
import yaml

from tests.conftest import CI
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.heavy, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ("dockerd", "docker", "docker-compose", "debootstrap")
PROJECT = "rscheck"
RUN_SERVICES = ("redis", "ray-head", "ray-worker", "engines", "producer", "judge", "feeder", "trainer",
                "metrics", "archive")  # fmt: skip
ROLLSTREAM_SERVICES = ("engines", "producer", "judge", "feeder", "trainer", "metrics", "archive")
STEPS = 3
# each Redis user's password (deploy/redis/acl.sh): .env's, as example.env lists them
ROLES = ("ADMIN", "PRODUCER", "TRAINER", "FEEDER", "ENGINES", "JUDGE", "ARCHIVE", "METRICS", "MONITOR")
REDIS_PASSWORDS = tuple(f"REDIS_PASSWORD_{role}" for role in ROLES)
SHIMS: list[psutil.Process] = []  # the containers' shims, for a teardown after the engine stalled


def requirements() -> None:
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    why = ""
    if missing:
        why = f"needs {', '.join(missing)} (apt-get install docker.io docker-compose debootstrap)"
    elif os.geteuid() != 0:
        why = "needs root: it starts a Docker engine of its own"
    if why:
        if CI:
            raise RuntimeError(f"CI runs the Compose check: it {why}")
        pytest.skip(f"the Compose check {why}")


def run(command: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, (
        f"{command[:3]} exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    )
    return done


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A Docker engine of this test's own; the environment that talks to it."""
    requirements()
    root = tmp_path_factory.mktemp("docker")
    socket = root / "docker.sock"
    log = (root / "dockerd.log").open("wb")
    engine = subprocess.Popen(
        ["dockerd", "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
         "-H", f"unix://{socket}", "--pidfile", str(root / "dockerd.pid"),
         "--iptables=false", "--ip-masq=false", "--bridge=none"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    env = {**os.environ, "DOCKER_HOST": f"unix://{socket}"}
    try:

        def up() -> bool:
            assert engine.poll() is None, (root / "dockerd.log").read_text()[-3000:]
            return subprocess.run(["docker", "info"], env=env, capture_output=True).returncode == 0

        wait_for(up, timeout=120, interval=1.0)
        yield env
    finally:
        shims = [*SHIMS, *container_shims(env)]  # seen after `up`, and now if it answers
        with contextlib.suppress(subprocess.SubprocessError):  # its containers first, while it answers
            ids = subprocess.run(
                ["docker", "ps", "-aq"], env=env, capture_output=True, text=True, timeout=120
            )
            if ids.stdout.split():
                subprocess.run(
                    ["docker", "rm", "-f", *ids.stdout.split()], env=env, capture_output=True, timeout=300
                )
        engine.send_signal(signal.SIGTERM)  # it stops its containerd
        try:
            engine.wait(timeout=120)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait()
        log.close()
        # what an engine killed mid-way leaves: its containers' shims (by the PIDs seen
        # above, with everything under them) and its mounts under this test's folder
        for shim in shims:
            with contextlib.suppress(psutil.NoSuchProcess):
                for process in [*shim.children(recursive=True), shim]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
        for line in reversed(Path("/proc/mounts").read_text().splitlines()):
            mount = line.split()[1]
            if mount.startswith(str(root)):
                subprocess.run(["umount", "-l", mount], capture_output=True, timeout=60)


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


@pytest.fixture(scope="module")
def images(docker: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """rollstream:check, built from deploy/Dockerfile on a Debian base; its base's name."""
    work = tmp_path_factory.mktemp("images")
    rootfs = work / "rootfs"
    packages = "python3,python3-venv,ca-certificates,redis-server,redis-tools"
    run(["debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", str(rootfs)], timeout=900)
    base = "rollstream-check-base:bookworm"
    run(["tar", "-C", str(rootfs), "-cf", str(work / "rootfs.tar"), "."], timeout=300)
    run(["docker", "import", str(work / "rootfs.tar"), base], timeout=300, env=docker)
    # the build context: the checkout's files (as git has them) and a wheelhouse beside
    context = work / "context"
    files = run(["git", "ls-files", "-z"], timeout=60, cwd=ROOT).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, context / name)
    constraints = ROOT / "deploy" / "constraints.txt"
    wheelhouse = str(context / "wheelhouse")
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", wheelhouse, "--constraint",
         str(constraints), str(context), "ray[default]", "async-timeout"], timeout=900)  # fmt: skip
    run(["docker", "build", "--network=none", "-f", "deploy/Dockerfile", "--build-arg", f"BASE={base}",
         "--build-arg", "PIP_ARGS=--no-index --find-links /src/wheelhouse", "-t", "rollstream:check", "."],
        timeout=900, cwd=context, env=docker)  # fmt: skip
    return base


def compose_files(folder: Path, base: str) -> list[str]:
    """Compose's layout as deploy/compose has it, for Compose v1, in ``folder`` beside a copy
    of what its relative paths name; an override for a short run; .env with new secrets."""
    shutil.copytree(ROOT / "deploy", folder / "deploy")
    shutil.copytree(ROOT / "examples", folder / "examples")
    compose_dir = folder / "deploy" / "compose"
    layout = yaml.safe_load((compose_dir / "compose.yaml").read_text())
    layout.pop("name")
    for service in layout["services"].values():
        service.pop("ports", None)  # nothing published on the machine
    (compose_dir / "compose.yaml").write_text(yaml.safe_dump(layout, sort_keys=False))
    short = {
        "ROLLSTREAM_ROLLOUT__BATCH_SIZE": "8",
        "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "50",
        "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "50",
        "ROLLSTREAM_PROCESS__STOP_TIMEOUT_S": "10",
    }
    override = {"services": {name: {"environment": short} for name in ROLLSTREAM_SERVICES}}
    (compose_dir / "compose.check.yaml").write_text(yaml.safe_dump(override))
    (compose_dir / ".env").write_text(
        "".join(
            f"{key}={secrets.token_hex(16)}\n"
            for key in ("RAY_AUTH_TOKEN", "GRAFANA_ADMIN_PASSWORD", *REDIS_PASSWORDS)
        )
        + f"IMAGE=rollstream:check\nREDIS_IMAGE={base}\nTRAIN_STEPS={STEPS}\n"
    )
    files = ["-f", str(compose_dir / "compose.yaml"), "-f", str(compose_dir / "compose.check.yaml")]
    return ["docker-compose", "-p", PROJECT, "--env-file", str(compose_dir / ".env"), *files]


def test_compose_runs_a_short_run_to_its_end_with_nothing_lost(
    docker: dict[str, str], images: str, tmp_path: Path
) -> None:
    compose = compose_files(tmp_path, images)
    try:
        run([*compose, "up", "--no-build", "-d", *RUN_SERVICES], timeout=600, env=docker)
        SHIMS.extend(container_shims(docker))

        def containers() -> dict[str, dict[str, Any]]:
            project = f"label=com.docker.compose.project={PROJECT}"
            ids = run(["docker", "ps", "-aq", "--filter", project], timeout=180, env=docker).stdout.split()
            found = orjson.loads(run(["docker", "inspect", *ids], timeout=180, env=docker).stdout)
            return {c["Config"]["Labels"]["com.docker.compose.service"] + c["Name"][-2:]: c for c in found}

        def rollstream_exited() -> dict[str, dict[str, Any]] | None:
            now = containers()
            ours = {k: c for k, c in now.items() if k.rsplit("_", 1)[0] in ROLLSTREAM_SERVICES}
            for name, c in ours.items():  # a crash shows at once, not at the deadline
                assert c["State"]["Status"] != "restarting", (name, logs(name))
                if c["State"]["Status"] == "exited":
                    assert c["State"]["ExitCode"] == 0, (name, c["State"]["ExitCode"], logs(name))
            done = all(c["State"]["Status"] == "exited" for c in ours.values())
            return ours if done else None

        def logs(service: str) -> str:
            out = run(
                [*compose, "logs", "--no-color", "--tail", "40", service.rsplit("_", 1)[0]],
                timeout=180,
                env=docker,
            )
            return out.stdout[-4000:]

        ours = wait_for(rollstream_exited, timeout=900, interval=3.0)
        assert {k.rsplit("_", 1)[0] for k in ours} == set(ROLLSTREAM_SERVICES)
        assert len([k for k in ours if k.startswith("producer")]) == 2  # deploy.replicas
        status_command = ["run", "--rm", "--no-deps", "-T", "metrics", "rollstream", "status", "--json"]
        status = run([*compose, *status_command], timeout=300, env=docker)
        report = orjson.loads(status.stdout)
        assert report["train_step"] == STEPS
        (account,) = report["accounts"].values()
        assert account["trained"] >= STEPS and account["lost"] == 0, account
    finally:
        with contextlib.suppress(subprocess.SubprocessError, AssertionError):
            run([*compose, "down", "-v", "-t", "20"], timeout=300, env=docker)
