"""deploy/compose run for real (`make compose-check`): a Docker engine of the test's own
(its own data root, exec root and socket in a temporary folder, --iptables=false and no
default bridge, so the machine's firewall and networks stay as they are; stopped by its
PID), a base image built from Debian's packages (debootstrap: python3, its venv, Redis),
the rollstream image built from deploy/Dockerfile on it from a wheelhouse of the pinned
versions (deploy/constraints.txt), then Compose's layout: Redis, a Ray head and worker,
the engines process, two producers, the judge, the feeder, the trainer, the metrics and
the archiver. Two runs on the same images:

- a short run: the trainer's steps done, every rollstream container has exited 0,
  `rollstream status` finds nothing lost and the trainer's --record no group trained twice;
- a run with faults, Prometheus and Alertmanager beside it: Prometheus scrapes every
  rollstream process (`up`) and the run's metrics; a producer holding claims is killed
  (`docker kill`: no restart), the other takes its claims back; redis-server is killed
  (SIGKILL, as the kernel's OOM killer would) and Compose's restart policy brings it back
  from its append-only file (the same run id, no step lost); the run still ends with
  nothing lost and nothing trained twice.

What differs from `docker compose up` as the README has it: Debian's docker-compose
(Compose v1) wants no top-level `name:` (the project is named with -p), no port is
published on the machine (the test reaches Redis and Prometheus at their containers'
addresses), no registry is reachable, so Prometheus and Alertmanager run from images of
the machine's Debian binaries on the same base (an override names them; the Compose
file keeps the upstream images) and Grafana is not started, and an override makes the
runs short (small batches, simulated engines at 50x, claims taken back after 10 s).
Needs root, docker.io, docker-compose, debootstrap, prometheus and
prometheus-alertmanager, and a Debian mirror and a Python package index for the base
image and the wheelhouse."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from rollstream.shared.keys import RUN_ID, TRAIN_STEP
from tests.compose_project import ROLLSTREAM_SERVICES, SHIMS, Project, container_shims, run, stop_engine
from tests.conftest import CI
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.heavy, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ("dockerd", "docker", "docker-compose", "debootstrap", "prometheus", "prometheus-alertmanager")
RUN_SERVICES = ("redis", "ray-head", "ray-worker", "engines", "producer", "judge", "feeder", "trainer",
                "metrics", "archive")  # fmt: skip
STEPS = 3  # the short run's
# The run with faults: slower engines (responses of ~500 tokens at 2x), so that the
# producers, not the trainer, set the pace: each holds claims all along (a producer ahead
# of the trainer waits holding none), and the run outlasts both faults and their recovery
FAULT_STEPS = 14
FAULT_PACE = {
    "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "2",
    "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "500",
}
MONITORING = ("prometheus", "alertmanager")
# each Redis user's password (deploy/redis/acl.sh): .env's, as example.env lists them
ROLES = (
    "ADMIN",
    "PRODUCER",
    "TRAINER",
    "FEEDER",
    "ENGINES",
    "JUDGE",
    "ARCHIVE",
    "METRICS",
    "MONITOR",
    "EXPORTER",
)
REDIS_PASSWORDS = tuple(f"REDIS_PASSWORD_{role}" for role in ROLES)


def requirements() -> None:
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    why = ""
    if missing:
        why = (
            f"needs {', '.join(missing)} (apt-get install docker.io docker-compose debootstrap prometheus "
            "prometheus-alertmanager)"
        )
    elif os.geteuid() != 0:
        why = "needs root: it starts a Docker engine of its own"
    if why:
        if CI:
            raise RuntimeError(f"CI runs the Compose check: it {why}")
        pytest.skip(f"the Compose check {why}")


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
        stop_engine(engine, env, root)
        log.close()


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
    shutil.rmtree(rootfs)  # hundreds of megabytes, twice: the engine holds the image now
    (work / "rootfs.tar").unlink()
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
    shutil.rmtree(context)  # the wheelhouse: hundreds of megabytes more
    return base


MONITORING_DOCKERFILE = """FROM {base}
COPY {name} /bin/{name}
COPY share /usr/share/prometheus
RUN mkdir -p /etc/{name} /{name} && chown 65534:65534 /{name}
USER 65534:65534
WORKDIR /{name}
ENTRYPOINT ["/bin/{name}"]
CMD {cmd}
"""


@pytest.fixture(scope="module")
def monitoring(
    docker: dict[str, str], images: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """Prometheus and Alertmanager images (service -> tag) from the machine's Debian
    binaries on the base image: no registry is reachable here. Laid out as the upstream
    images are (entry point, default flags, nobody's data folder), which the Compose
    file keeps naming for its users; only this test's override names these."""
    work = tmp_path_factory.mktemp("monitoring")
    flags = {
        "prometheus": ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"],
        "alertmanager": ["--config.file=/etc/alertmanager/alertmanager.yml", "--storage.path=/alertmanager"],
    }
    tags = {}
    for name, binary in zip(MONITORING, ("prometheus", "prometheus-alertmanager"), strict=True):
        context = work / name
        context.mkdir()
        shutil.copy2(str(shutil.which(binary)), context / name)
        (context / "share").mkdir()  # Debian's alertmanager reads its templates from there
        if name == "alertmanager":
            shutil.copytree("/usr/share/prometheus/alertmanager", context / "share" / name, symlinks=True)
        cmd = orjson.dumps(flags[name]).decode()
        (context / "Dockerfile").write_text(MONITORING_DOCKERFILE.format(base=images, name=name, cmd=cmd))
        tags[name] = f"rollstream-check-{name}:debian"
        run(
            ["docker", "build", "--network=none", "-t", tags[name], "."], timeout=600, cwd=context, env=docker
        )
    return tags


def compose_project(folder: Path, base: str, name: str, env: dict[str, str], steps: int,
                    pace: dict[str, str] | None = None,
                    monitoring: dict[str, str] | None = None) -> Project:  # fmt: skip
    """Compose's layout as deploy/compose has it, for Compose v1, in ``folder`` beside a copy
    of what its relative paths name; an override for a short run (``pace`` over its
    settings, the trainer keeping its --record; the images of ``monitoring`` for those
    services, scraping every 2 s); .env with new secrets."""
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
        "ROLLSTREAM_BUFFER__CLAIM_IDLE_MS": "10000",
        **(pace or {}),
    }
    services: dict[str, Any] = {name: {"environment": short} for name in ROLLSTREAM_SERVICES}
    services["trainer"]["command"] = [
        *layout["services"]["trainer"]["command"],
        "--record",
        "/state/record.jsonl",
    ]
    for service, image in (monitoring or {}).items():
        services[service] = {"image": image}
    if monitoring:
        scrape = yaml.safe_load((compose_dir / "prometheus.yml").read_text())
        scrape["global"]["scrape_interval"] = "2s"
        for job in scrape["scrape_configs"]:
            for sd in job.get("dns_sd_configs", []):
                sd["refresh_interval"] = "2s"
        (compose_dir / "prometheus.yml").write_text(yaml.safe_dump(scrape, sort_keys=False))
    (compose_dir / "compose.check.yaml").write_text(yaml.safe_dump({"services": services}))
    password = secrets.token_hex(16)  # the admin user's: the test's own look at Redis
    (compose_dir / ".env").write_text(
        "".join(
            f"{key}={secrets.token_hex(16)}\n" for key in REDIS_PASSWORDS if key != "REDIS_PASSWORD_ADMIN"
        )
        + f"REDIS_PASSWORD_ADMIN={password}\nRAY_AUTH_TOKEN={secrets.token_hex(16)}\n"
        f"GRAFANA_ADMIN_PASSWORD={secrets.token_hex(16)}\n"
        f"IMAGE=rollstream:check\nREDIS_IMAGE={base}\nTRAIN_STEPS={steps}\n"
    )
    files = ["-f", str(compose_dir / "compose.yaml"), "-f", str(compose_dir / "compose.check.yaml")]
    compose = ["docker-compose", "-p", name, "--env-file", str(compose_dir / ".env"), *files]
    return Project(name, compose, env, password)


def finished(project: Project, steps: int, folder: Path, killed: str = "") -> None:
    """The run's end: every rollstream container exited (0, but ``killed``), both
    producers among them; `rollstream status` at the last step with nothing lost; no
    group trained by two committed steps (the trainer's --record)."""
    ours = wait_for(lambda: project.rollstream_exited(killed), timeout=900, interval=3.0)
    assert {k.rsplit("_", 1)[0] for k in ours} == set(ROLLSTREAM_SERVICES)
    assert len([k for k in ours if k.startswith("producer")]) == 2  # deploy.replicas
    report = project.status()
    assert report["train_step"] == steps
    (account,) = report["accounts"].values()
    assert account["trained"] >= steps and account["lost"] == 0, account
    times = project.committed(folder)
    assert len(times) >= steps, times  # every step trained groups
    assert [g for g, n in times.items() if n > 1] == [], "groups trained by two committed steps"


def test_compose_runs_a_short_run_to_its_end_with_nothing_lost(
    docker: dict[str, str], images: str, tmp_path: Path
) -> None:
    project = compose_project(tmp_path, images, "rscheck", docker, STEPS)
    try:
        project.run("up", "--no-build", "-d", *RUN_SERVICES, timeout=600)
        SHIMS.extend(container_shims(docker))
        finished(project, STEPS, tmp_path)
    finally:
        with contextlib.suppress(subprocess.SubprocessError, AssertionError):
            project.run("down", "-v", "-t", "20", timeout=300)


def scraped(project: Project) -> None:
    """Prometheus scrapes every rollstream process (each one's address a target, up),
    holds the run's own series from the metrics process and knows the Alertmanager."""

    def every_process_up() -> bool:
        project.running("trainer_1")
        now = project.containers()
        ours = [k for k in now if k.rsplit("_", 1)[0] in ROLLSTREAM_SERVICES]
        want = {f"{project.address(k)}:9100" for k in ours}
        answer = project.prometheus("query?query=up")
        up = {r["metric"]["instance"] for r in answer["result"] if r["value"][1] == "1"} if answer else set()
        return len(ours) == len(ROLLSTREAM_SERVICES) + 1 and want <= up  # two producers

    wait_for(every_process_up, timeout=600, interval=3.0)
    metrics = f"{project.address('metrics_1')}:9100"

    def run_series() -> bool:
        answer = project.prometheus("query?query=rollstream_run_up")
        return bool(answer) and any(
            r["metric"]["instance"] == metrics and r["value"][1] == "1" for r in answer["result"]
        )

    wait_for(run_series, timeout=300, interval=2.0)
    # and it sends its alerts to the layout's Alertmanager
    wait_for(
        lambda: (project.prometheus("alertmanagers") or {}).get("activeAlertmanagers"),
        timeout=300,
        interval=2.0,
    )
    alertmanager = project.containers()["alertmanager_1"]  # its templates found: never restarted
    running = alertmanager["State"]["Running"] and alertmanager["RestartCount"] == 0
    assert running, project.logs("alertmanager_1")


def kill_a_producer(project: Project) -> str:
    """From train step 2, a producer that holds claims is killed (`docker kill`: SIGKILL,
    and Docker restarts no container it was told to kill); the other takes its claims
    back (after claim_idle_ms) and the run goes on. The producer's key."""

    def holding() -> tuple[str, str] | None:
        project.running("trainer_1")
        state = project.state() or {}
        if int(state.get(TRAIN_STEP, 0)) < 2:
            return None
        now = project.containers()
        for key in ("producer_1", "producer_2"):
            if project.claims(now[key]["Config"]["Hostname"]):
                return key, now[key]["Config"]["Hostname"]
        return None

    victim, hostname = wait_for(holding, timeout=600, interval=0.5)
    project.docker("kill", "-s", "KILL", f"{project.name}_{victim}")
    held, step = project.claims(hostname), int((project.state() or {})[TRAIN_STEP])  # as it left them
    assert held, f"{victim} held no claims when it was killed"

    def taken_back() -> bool:
        project.running("trainer_1")
        state = project.state() or {}
        return project.claims(hostname) == 0 and int(state.get(TRAIN_STEP, 0)) > step

    wait_for(taken_back, timeout=600, interval=2.0)
    print(f"{victim} killed at train step {step} holding {held} claims; taken back")
    return victim


def crash_redis(project: Project) -> None:
    """redis-server is killed (SIGKILL to its PID, as the kernel's OOM killer would: a
    crash, which the restart policy answers) mid-run; Docker starts it again and it
    comes back from its append-only file: the same run id, no committed step lost."""
    before = wait_for(project.state, timeout=120, interval=1.0)
    redis_container = project.containers()["redis_1"]
    project.running("trainer_1")
    os.kill(redis_container["State"]["Pid"], signal.SIGKILL)

    def back() -> dict[str, str] | None:
        now = project.containers()["redis_1"]
        restarted = now["RestartCount"] > redis_container["RestartCount"]
        return project.state() if restarted and now["State"]["Health"]["Status"] == "healthy" else None

    after = wait_for(back, timeout=300, interval=1.0)
    assert after[RUN_ID] == before[RUN_ID], (before, after)
    assert int(after[TRAIN_STEP]) >= int(before[TRAIN_STEP]), (before, after)
    print(f"redis-server killed at train step {before[TRAIN_STEP]}; back at {after[TRAIN_STEP]}")


def test_compose_run_survives_a_killed_producer_and_redis_scraped_by_prometheus(
    docker: dict[str, str], images: str, monitoring: dict[str, str], tmp_path: Path
) -> None:
    project = compose_project(tmp_path, images, "rsfaults", docker, FAULT_STEPS, FAULT_PACE, monitoring)
    start = time.monotonic()
    try:
        project.run("up", "--no-build", "-d", *RUN_SERVICES, *MONITORING, timeout=600)
        SHIMS.extend(container_shims(docker))
        print(f"up: {time.monotonic() - start:.0f} s")
        scraped(project)
        print(f"every process up in Prometheus: {time.monotonic() - start:.0f} s")
        victim = kill_a_producer(project)
        print(f"claims taken back: {time.monotonic() - start:.0f} s")
        crash_redis(project)
        print(f"Redis back: {time.monotonic() - start:.0f} s")
        finished(project, FAULT_STEPS, tmp_path, killed=victim)
        print(f"the run's end, accounted: {time.monotonic() - start:.0f} s")
    finally:
        with contextlib.suppress(subprocess.SubprocessError, AssertionError):
            project.run("down", "-v", "-t", "20", timeout=300)
