"""What deploy/ must hold beyond being valid (issue: the layouts passed their validators
and never ran): Ray drivers without a Ray node join through Ray Client; the image has
ray[default] from pinned versions and no secrets; the trainer trains and its weights
reach the engines; a process that ends with the run is not started again; pods and units
run without privileges; probes fail on Redis's error replies and do not kill the engines
for one slow engine; Redis has a memory ceiling; the Slurm job ends. Each check reads the
files (no cluster, no Docker), and where a script decides, runs it against stubs."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import CI

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose" / "compose.yaml"


def documents(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects() -> list[dict[str, Any]]:
    return [d for p in sorted([*K8S.glob("*.yaml"), *(K8S / "ha").glob("*.yaml")]) for d in documents(p)]


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(object name[/group], pod spec) of every workload and RayCluster group."""
    for obj in k8s_objects():
        name = obj["metadata"]["name"]
        if obj["kind"] in {"Deployment", "Job", "StatefulSet"}:
            yield name, obj["spec"]["template"]["spec"]
        elif obj["kind"] == "RayCluster":
            yield f"{name}/head", obj["spec"]["headGroupSpec"]["template"]["spec"]
            for group in obj["spec"]["workerGroupSpecs"]:
                yield f"{name}/{group['groupName']}", group["template"]["spec"]


def rollstream_command(container: dict[str, Any]) -> list[str]:
    command = container.get("command") or []
    return list(command[1:]) if command[:1] == ["rollstream"] else []


# --- the image --------------------------------------------------------------------------


def test_the_image_installs_ray_default_at_the_clusters_pinned_version() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert '"ray[default]"' in dockerfile  # the dashboard agent KubeRay's probes ask, Ray Client
    assert re.search(r"--constraint \S*deploy/constraints.txt", dockerfile)
    assert re.search(r"^ARG BASE=\S+:\S+", dockerfile, re.M)  # a pinned upstream base by default
    assert re.search(r"^USER 1000", dockerfile, re.M)
    # the checkout is built and removed, never a process's working directory: its bare
    # rollstream/ folder would shadow the installed package in Ray's workers
    copied = re.search(r"^COPY \. (\S+)$", dockerfile, re.M)
    assert copied and f"rm -rf {copied.group(1)}" in dockerfile
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", dockerfile, re.M)
    assert not workdir.startswith(copied.group(1))
    pins = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, line  # every line an exact pin
            pins[name.lower()] = version
    assert {"ray", "redis", "pydantic", "aiohttp", "grpcio"} <= set(pins)
    (cluster,) = [o for o in k8s_objects() if o["kind"] == "RayCluster"]
    assert cluster["spec"]["rayVersion"] == pins["ray"]


def docker_ignored(patterns: list[str], path: str) -> bool:
    """Docker's .dockerignore, as far as this file uses it: the last pattern that matches
    the path or one of its parent folders decides; `!` includes again."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        options = [pattern, pattern.removeprefix("**/")] if pattern.startswith("**/") else [pattern]
        for prefix in prefixes:
            tails = ["/".join(prefix.split("/")[i:]) for i in range(len(prefix.split("/")))]
            if any(fnmatch.fnmatchcase(prefix, o) for o in options) or (
                pattern.startswith("**/") and any(fnmatch.fnmatchcase(t, options[1]) for t in tails)
            ):
                ignored = not negate
    return ignored


def test_the_build_context_leaves_secrets_environments_and_run_data_out() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in ("deploy/compose/.env", ".env", ".venv/bin/python", "var/redis/appendonly.aof", ".git/config",
                 "rollstream/__pycache__/x.pyc", "weights/step-1/model.safetensors"):  # fmt: skip
        assert docker_ignored(patterns, path), path
    for path in ("pyproject.toml", "deploy/constraints.txt", "deploy/compose/example.env", "cli/main.py"):
        assert not docker_ignored(patterns, path), path


# --- Ray: drivers without a Ray node ------------------------------------------------------


def test_compose_s_ray_drivers_join_through_the_heads_ray_client_server() -> None:
    services = compose()["services"]
    address = services["engines"]["environment"]["ROLLSTREAM_RAY__ADDRESS"]
    match = re.fullmatch(r"ray://ray-head:(\d+)", address)
    assert match, address  # never the GCS port: these containers run no raylet
    assert f"--ray-client-server-port={match.group(1)}" in services["ray-head"]["command"]
    for name in ("producer", "engines"):
        assert services[name]["environment"]["ROLLSTREAM_RAY__ADDRESS"] == address


# --- the trainer and its weights --------------------------------------------------------------


def mounts_by_path(spec: dict[str, Any]) -> dict[str, str]:
    """mountPath -> claim name, of one pod spec's first container."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", [])
              if "persistentVolumeClaim" in v}  # fmt: skip
    return {m["mountPath"]: claims.get(m["name"], "") for m in spec["containers"][0].get("volumeMounts", [])}


def test_the_kubernetes_trainer_trains_a_model_and_its_weights_reach_every_gpu_worker() -> None:
    (job,) = [
        o for o in k8s_objects() if o["kind"] == "Job" and o["metadata"]["name"] == "rollstream-trainer"
    ]
    spec = job["spec"]["template"]["spec"]
    args = rollstream_command(spec["containers"][0])
    assert "--hf-model" in args  # not the placeholder trainer on 8 GPUs
    weights_dir = args[args.index("--weights-dir") + 1]
    claim = mounts_by_path(spec)[weights_dir]
    assert claim
    (pvc,) = [
        o for o in k8s_objects() if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == claim
    ]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]  # one writer pod, many reader nodes
    (cluster,) = [o for o in k8s_objects() if o["kind"] == "RayCluster"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        assert mounts_by_path(group["template"]["spec"]).get(weights_dir) == claim, group["groupName"]
    settings = next(
        o
        for o in k8s_objects()
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rollstream-settings"
    )
    assert settings["data"].get("ROLLSTREAM_WEIGHTS__KIND", "file") == "file"


def test_compose_s_trainer_weights_volume_reaches_every_ray_worker() -> None:
    services = compose()["services"]
    command = [str(a) for a in services["trainer"]["command"]]
    weights_dir = command[command.index("--weights-dir") + 1]
    (volume,) = [v.split(":")[0] for v in services["trainer"]["volumes"] if v.split(":")[1] == weights_dir]
    for worker in ("ray-worker", "ray-gpu"):
        mounted = {v.split(":")[1]: v.split(":")[0] for v in services[worker].get("volumes", [])}
        assert mounted.get(weights_dir) == volume, worker


# --- a finished run's processes stay finished ---------------------------------------------------


def test_a_process_that_ends_with_the_run_is_a_job_not_restarted_after_it() -> None:
    # the producers (KEDA scales a Deployment) and the run's metrics (serving the final
    # figures) stay Deployments, as processes.yaml says why
    deployments = {
        tuple(rollstream_command(spec["containers"][0])[:1])
        for o in k8s_objects()
        if o["kind"] == "Deployment"
        for spec in [o["spec"]["template"]["spec"]]
        if rollstream_command(spec["containers"][0])
    }
    assert deployments == {("produce",), ("metrics",)}
    header = (K8S / "processes.yaml").read_text().split("---")[0]
    assert "KEDA" in header and "Deployments" in header
    jobs = [o for o in k8s_objects() if o["kind"] == "Job"]
    assert {rollstream_command(j["spec"]["template"]["spec"]["containers"][0])[0] for j in jobs} == {
        "engines", "judge", "feed", "archive", "train"}  # fmt: skip
    for job in jobs:
        assert job["spec"]["template"]["spec"]["restartPolicy"] in {"Never", "OnFailure"}
        rules = job["spec"]["podFailurePolicy"]["rules"]
        assert any(r["action"] == "FailJob" and 5 in r["onExitCodes"]["values"] for r in rules)


# --- privileges ---------------------------------------------------------------------------------


def test_every_pod_runs_as_a_non_root_user_with_its_volumes_writable() -> None:
    seen = 0
    for name, spec in pod_specs():
        seen += 1
        context = spec.get("securityContext", {})
        assert context.get("runAsNonRoot") is True, name
        assert isinstance(context.get("runAsUser"), int) and context["runAsUser"] > 0, name
        if any("persistentVolumeClaim" in v for v in spec.get("volumes", [])):
            assert context.get("fsGroup") == context["runAsUser"], name  # claims root-owned otherwise
        for container in spec["containers"]:
            own = container.get("securityContext", {})
            assert own.get("allowPrivilegeEscalation") is False, name
            assert own.get("capabilities", {}).get("drop") == ["ALL"], name
            if rollstream_command(container):  # rollstream's processes write only their volumes and /tmp
                assert own.get("readOnlyRootFilesystem") is True, name
                assert "/tmp" in {m["mountPath"] for m in container.get("volumeMounts", [])}, name
    assert seen >= 10


def test_a_network_policy_denies_by_default_and_lets_rollstream_reach_redis_and_ray() -> None:
    policies = {o["metadata"]["name"]: o for o in k8s_objects() if o["kind"] == "NetworkPolicy"}
    deny = [p for p in policies.values() if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"]
    ports = {
        (name, port["port"])
        for name, p in policies.items()
        for rule in p["spec"].get("ingress", [])
        for port in rule.get("ports", [])
    }
    assert ("rollstream-redis", 6379) in ports and ("rollstream-ray", 10001) in ports
    # every workload pod of rollstream carries the label the policies let in
    for obj in k8s_objects():
        if obj["kind"] in {"Deployment", "Job"}:
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert labels.get("app.kubernetes.io/part-of") == "rollstream", obj["metadata"]["name"]


def test_the_systemd_units_are_hardened_and_serve_metrics_each_on_its_own_port() -> None:
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    ports = {}
    for unit in units:
        lines = unit.read_text().splitlines()
        for needed in ("NoNewPrivileges=yes", "ProtectSystem=strict", "CapabilityBoundingSet=",
                       "ProtectHome=yes", "RestrictSUIDSGID=yes"):  # fmt: skip
            assert needed in lines, (unit.name, needed)
        if "bin/rollstream " in unit.read_text():
            (port,) = [
                line.split("=", 2)[2]
                for line in lines
                if line.startswith("Environment=ROLLSTREAM_METRICS__PORT=")
            ]
            ports[unit.name] = port
    assert len(set(ports.values())) == len(ports) >= 7, ports
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if CI:
            raise RuntimeError("no systemd-analyze: CI has systemd's tools")
        pytest.skip("no systemd-analyze")
    for unit in units:
        done = subprocess.run(
            [analyze, "security", "--offline=true", str(unit)], capture_output=True, text=True
        )
        exposure = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
        assert exposure and float(exposure.group(1)) <= 4.0, (unit.name, done.stdout[-500:])


# --- probes -------------------------------------------------------------------------------------


def probe_commands() -> list[tuple[str, str]]:
    """(where, shell text) of every probe or health check that runs redis-cli ping."""
    found: list[tuple[str, str]] = []
    for path in [*DEPLOY.rglob("*.yaml")]:
        for doc in documents(path):
            stack = [doc]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    stack.extend(node.values())
                    test = node.get("test") or (node.get("exec") or {}).get("command")
                    if isinstance(test, list) and any("ping" in str(a) for a in test):
                        found.append((path.name, " ".join(map(str, test))))
                elif isinstance(node, list):
                    stack.extend(node)
    return found


@pytest.mark.parametrize("reply", ["PONG", "NOAUTH Authentication required.", "LOADING Redis is loading"])
def test_every_redis_probe_passes_on_pong_alone(tmp_path: Path, reply: str) -> None:
    # a redis-cli that prints this reply and exits 0, as the real one does on an error reply
    stub = tmp_path / "redis-cli"
    stub.write_text(f"#!/bin/sh\necho '{reply}'\n")
    stub.chmod(0o755)
    probes = probe_commands()
    assert len(probes) >= 8
    for where, text in probes:
        match = re.search(r"(?:CMD-SHELL|sh -c) (.*)$", text)
        assert match, f"{where}: `{text}` passes on any reply"
        script = match.group(1).replace("$$", "$")  # Compose's escaped $
        done = subprocess.run(
            ["sh", "-c", script], env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
        )
        assert (done.returncode == 0) == (reply == "PONG"), (where, script, reply)


def test_no_liveness_probe_scrapes_every_engine_or_gives_up_within_a_second() -> None:
    for name, spec in pod_specs():
        for container in spec["containers"]:
            for kind in ("livenessProbe", "readinessProbe"):
                probe = container.get(kind)
                if probe and "httpGet" in probe:
                    assert probe.get("timeoutSeconds", 1) >= 5, (name, kind)
            if rollstream_command(container)[:1] == ["engines"]:
                assert "httpGet" not in container["livenessProbe"], name


# --- Redis's memory -------------------------------------------------------------------------------


# Redis's units (redis.conf: 1gb = 1024^3, 1g = 10^9) and Kubernetes' (Gi, G)
UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kb": 2**10, "mb": 2**20, "gb": 2**30,
         "ki": 2**10, "mi": 2**20, "gi": 2**30}  # fmt: skip


def memory_bytes(text: str) -> int:
    match = re.fullmatch(r"(\d+)([a-zA-Z]*)", text.strip())
    assert match, text
    return int(match.group(1)) * UNITS[match.group(2).lower()]


def test_every_redis_config_sets_maxmemory_under_its_containers_limit() -> None:
    def maxmemory(conf: str) -> str:
        (value,) = re.findall(r"^\s*maxmemory\s+(\S+)\s*$", conf, re.M)
        return value

    assert memory_bytes(maxmemory((DEPLOY / "redis.conf").read_text())) >= 10**9
    checked = 0
    for path in (K8S / "redis.yaml", K8S / "ha" / "redis-ha.yaml"):
        docs = documents(path)
        (conf,) = [
            d["data"]["redis.conf"] for d in docs if d["kind"] == "ConfigMap" and "redis.conf" in d["data"]
        ]
        (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
        (redis,) = [
            c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] in {"redis", "data"}
        ]
        assert memory_bytes(maxmemory(conf)) < memory_bytes(redis["resources"]["limits"]["memory"]), path.name
        checked += 1
    assert checked == 2


def test_the_kubernetes_failover_set_waits_for_every_replica_it_may_promote() -> None:
    (sts,) = [d for d in documents(K8S / "ha" / "redis-ha.yaml") if d["kind"] == "StatefulSet"]
    replicas = sts["spec"]["replicas"] - 1
    readme = (K8S / "README.md").read_text()
    assert f'ROLLSTREAM_REDIS__WAIT_REPLICAS: "{replicas}"' in readme
    assert f"ROLLSTREAM_REDIS__WAIT_REPLICAS={replicas}" in (K8S / "ha" / "redis-ha.yaml").read_text()


def test_grafana_s_admin_password_is_a_secret_of_the_env_file() -> None:
    grafana = compose()["services"]["grafana"]["environment"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", grafana["GF_SECURITY_ADMIN_PASSWORD"])
    assert "GRAFANA_ADMIN_PASSWORD=" in (DEPLOY / "compose" / "example.env").read_text()


# --- the Slurm job ends -----------------------------------------------------------------------------

STUBS = {
    # srun: drop its options, run the command here
    "srun": "#!/bin/bash\n"
    'while [[ $# -gt 0 ]]; do case "$1" in -w) shift 2;; -*) shift;; *) break;; esac; done\n'
    'exec "$@"\n',
    "scontrol": "#!/bin/sh\nprintf 'node1\\nnode2\\nnode3\\n'\n",
    "hostname": "#!/bin/sh\necho 127.0.0.1\n",
    # Redis, its exporter and the Ray nodes never exit by themselves
    "redis-server": "#!/bin/sh\nexec sleep 600\n",
    "prometheus-redis-exporter": '#!/bin/sh\necho "$REDIS_PASSWORD $*" > "$EXPORTER"\nexec sleep 600\n',
    "ray": '#!/bin/sh\n[ "$1" = status ] && exit 0\nexec sleep 600\n',
    # the trainer ends at once; every other process exits 0 soon after (the run stopped)
    "rollstream": '#!/bin/sh\n[ "$1" = train ] && exit 0\n'
    'sleep 1\necho "$1 $ROLLSTREAM_METRICS__PORT" >> "$PORTS"\n',
}


def test_the_slurm_job_ends_when_the_trainer_has_trained(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "PORTS": str(tmp_path / "ports"),
        "EXPORTER": str(tmp_path / "exporter"),
    }
    started = time.monotonic()
    script = str(DEPLOY / "slurm" / "rollstream.sbatch")
    job = subprocess.Popen(["bash", script], env=env, cwd=ROOT, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out, _ = job.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # its own session: only what this test started
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert job.returncode == 0, out.decode(errors="replace")[-2000:]
    assert time.monotonic() - started < 90
    served = dict(line.split() for line in (tmp_path / "ports").read_text().splitlines())
    assert set(served) == {"engines", "produce", "judge", "feed", "metrics", "archive"}
    assert len(set(served.values())) == len(served)  # each on a port of its own
    # the Redis exporter beside Redis, on its port, with the job's password in its environment
    password, *args = (tmp_path / "exporter").read_text().split()
    assert len(password) == 48 and password not in args
    assert args == ["-redis.addr", "redis://127.0.0.1:6379", "-web.listen-address", ":9121"]
