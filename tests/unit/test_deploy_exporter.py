"""Every layout runs the Redis exporter beside each Redis node, reaching it with the
Redis password and serving on :9121, and its Prometheus scrapes it as job `redis`: the
alert rules on Redis's memory, replication and append-only file (deploy/prometheus/
alerts.yml) and the dashboard's Redis panels have nothing to show without it. The images
are the version of Debian's package, whose names tests/integration/test_alerts_live.py
checks against the rules."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import yaml

from tests.redis_exporter import DEFAULT_PORT
from tests.unit.test_deploy_hardening import COMPOSE, DEPLOY, ROOT, compose, k8s_objects

EXPORTER_IMAGE = re.compile(r"(?:\$\{REDIS_EXPORTER_IMAGE:-)?oliver006/redis_exporter:v(\d+\.\d+\.\d+)\}?")


def images() -> list[str]:
    """The exporter images every layout names."""
    found = [s["image"] for s in compose()["services"].values() if "redis_exporter" in s.get("image", "")]
    overlay = yaml.safe_load((COMPOSE.parent / "compose.ha.yaml").read_text())["services"]
    found += [s["image"] for s in overlay.values() if "redis_exporter" in s.get("image", "")]
    for obj in k8s_objects():
        if obj["kind"] == "StatefulSet":
            found += [
                c["image"]
                for c in obj["spec"]["template"]["spec"]["containers"]
                if "redis_exporter" in c["image"]
            ]
    return found


def test_compose_runs_an_exporter_beside_each_redis_node() -> None:
    services = compose()["services"]
    overlay = yaml.safe_load((COMPOSE.parent / "compose.ha.yaml").read_text())["services"]
    beside = {"redis-exporter": ("redis", services), "redis-replica-exporter": ("redis-replica", overlay)}
    for name, (node, layout) in beside.items():
        exporter = layout[name]
        assert exporter["environment"]["REDIS_ADDR"] == f"redis://{node}:6379", name
        # its own ACL user (deploy/redis/acl.sh's exporter), not a process's
        assert exporter["environment"]["REDIS_USER"] == "exporter", name
        assert exporter["environment"]["REDIS_PASSWORD"] == "${REDIS_PASSWORD_EXPORTER}", name
        assert node in exporter["depends_on"] and exporter["read_only"] is True, name
    # Prometheus finds them by their service names, on the exporter's port
    config = yaml.safe_load((COMPOSE.parent / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "redis"]
    (sd,) = job["dns_sd_configs"]
    assert sorted(sd["names"]) == sorted(beside) and sd["port"] == DEFAULT_PORT


def redis_pods() -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]
        for o in k8s_objects()
        if o["kind"] == "StatefulSet" and o["metadata"]["name"].startswith("rollstream-redis")
    }


def test_every_kubernetes_redis_pod_has_an_exporter_beside_its_redis() -> None:
    pods = redis_pods()
    assert set(pods) == {"rollstream-redis", "rollstream-redis-ha"}
    for name, pod in pods.items():
        containers = {c["name"]: c for c in pod["spec"]["containers"]}
        exporter = containers["redis-exporter"]
        env = {e["name"]: e for e in exporter["env"]}
        assert env["REDIS_ADDR"]["value"] == "redis://127.0.0.1:6379", name
        secret = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert env["REDIS_USER"]["value"] == "exporter", name
        assert secret == {"name": "rollstream-redis-users", "key": "REDIS_PASSWORD_EXPORTER"}, name
        # the Redis container writes the ACL file from that Secret, the exporter's user in it
        users = {"secretRef": {"name": "rollstream-redis-users"}}
        assert users in containers["redis"].get("envFrom", []), name
        (port,) = exporter["ports"]
        assert port["containerPort"] == DEFAULT_PORT and len(port["name"]) <= 15, name
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(DEFAULT_PORT), name
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true", name
        assert exporter["resources"]["limits"]["memory"], name


def test_the_network_policy_lets_prometheus_reach_the_exporters() -> None:
    (policy,) = [
        o
        for o in k8s_objects()
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rollstream-redis"
    ]
    selected = set(policy["spec"]["podSelector"]["matchExpressions"][0]["values"])
    assert selected == set(redis_pods())
    open_to_all = [r for r in policy["spec"]["ingress"] if r["from"] == [{"namespaceSelector": {}}]]
    assert [p["port"] for r in open_to_all for p in r["ports"]] == [DEFAULT_PORT]


def test_one_machine_s_prometheus_scrapes_the_exporter_that_slurm_and_systemd_run() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "redis"]
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{DEFAULT_PORT}"]
    sbatch = (DEPLOY / "slurm" / "rollstream.sbatch").read_text()
    started = 'prometheus-redis-exporter -redis.addr "redis://${HEAD_IP}:6379"'
    assert f'{started} -web.listen-address ":{DEFAULT_PORT}"' in sbatch
    systemd = (DEPLOY / "systemd" / "README.md").read_text()
    assert f'ARGS="-redis.addr=redis://127.0.0.1:6379 -web.listen-address=:{DEFAULT_PORT}"' in systemd
    assert "systemctl enable --now prometheus-redis-exporter" in systemd
    # and `make test` installs Debian's package for the tests that run it
    debs = re.search(r"^DEBS := (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert debs and "prometheus-redis-exporter" in debs.group(1).split()


def test_every_exporter_image_is_the_version_the_tests_check() -> None:
    """One version everywhere, that of Debian's package where it is installed (whose series
    the live test checks the rules' names against)."""
    found = images()
    assert len(found) == 4, found
    versions = {EXPORTER_IMAGE.fullmatch(image).group(1) for image in found}  # type: ignore[union-attr]
    assert len(versions) == 1, found
    binary = shutil.which("prometheus-redis-exporter")
    if binary is not None:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        installed = re.search(r"Exporter v?(\d+\.\d+\.\d+)", done.stdout + done.stderr)
        assert installed and {installed.group(1)} == versions, (done.stdout + done.stderr)[-500:]
