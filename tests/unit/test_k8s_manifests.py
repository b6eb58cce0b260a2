"""deploy/k8s read into pods as a cluster would make them (chaos/k8s_manifests.py,
chaos/k8s_env.py; tests/integration/test_k8s_hosts.py runs them): KubeRay's command
lines, the kubelet's environment, and what running them found wrong, kept fixed: the
rollstream pods' settings load with the kubelet's Service variables around (no
enableServiceLinks), and the image has `ray` on a login shell's PATH."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from chaos import k8s_manifests
from chaos.k8s_env import expand, resolve, service_variables
from chaos.k8s_manifests import ManifestError, Service
from chaos.k8s_pods import IMAGE_LINKS, ROOT, host_names, manifest_paths, trainer_command
from rollstream.shared.settings import load_settings


@pytest.fixture
def layout() -> k8s_manifests.Layout:
    made = k8s_manifests.load(
        manifest_paths(), secret_values={"REDIS_PASSWORD_PRODUCER": "pw$1", "ray-auth-token": "tok"}
    )
    resolve(made, {p.name: f"10.0.0.{i}" for i, p in enumerate(made.pods, start=1)})
    return made


def test_every_workload_becomes_its_pods(layout: k8s_manifests.Layout) -> None:
    names = {p.name for p in layout.pods}
    assert {"rollstream-redis-0", "rollstream-ray-head", "rollstream-engines", "rollstream-producer-0",
            "rollstream-producer-1", "rollstream-judge", "rollstream-feeder", "rollstream-metrics-0",
            "rollstream-archive", "rollstream-trainer"} <= names  # fmt: skip
    assert len(layout.of("rollstream-ray-gpu")) == 2  # the worker group's replicas
    hosts = host_names(layout.pods)
    assert len(set(hosts.values())) == len(hosts)
    assert all(1 <= len(h) <= 10 and h.isalnum() and h.islower() for h in hosts.values())


def test_kuberay_command_lines(layout: k8s_manifests.Layout) -> None:
    head = layout.pod("rollstream-ray-head")
    assert head.command[:3] == ["/bin/bash", "-lc", "--"]
    line = head.command[3]
    assert line.startswith("ulimit -n 65536; ray start --head ")
    argv = shlex.split(line.split("; ", 1)[1])
    assert {"--num-cpus=0", "--disable-usage-stats", "--ray-client-server-port=10001", "--block",
            "--dashboard-host=0.0.0.0", "--memory=8589934592"} <= set(argv)  # fmt: skip
    worker = shlex.split(layout.pod("rollstream-ray-gpu-worker-0").command[3].split("; ", 1)[1])
    assert "--head" not in worker
    assert "--address=rollstream-ray-head-svc.rollstream.svc.cluster.local:6379" in worker
    assert '--resources={"rollout": 4}' in worker  # as bash hands it to ray start
    assert "--num-gpus=8" in worker and "--num-cpus=32" in worker  # CPUs from the request: no limit
    assert any(s.name == "rollstream-ray-head-svc" for s in layout.services)


def test_the_environment_as_the_kubelet_makes_it(layout: k8s_manifests.Layout) -> None:
    producer = layout.pod("rollstream-producer-0")
    assert producer.env["ROLLSTREAM_REDIS__URL"] == "redis://producer:pw$1@rollstream-redis:6379/0"
    assert producer.env["RAY_AUTH_TOKEN"] == "tok"
    assert producer.env["ROLLSTREAM_RUN"] == "exp1"  # envFrom the ConfigMap
    users = layout.secrets["rollstream-redis-users"]
    assert users["REDIS_USERNAME_MONITOR"] == "monitor" and users["REDIS_PASSWORD_ADMIN"] != "change-me"
    assert any(
        s.startswith("rollstream-redis-0:redis-exporter") for s in layout.skipped
    )  # no such image here
    assert (producer.uid, producer.gid, producer.fs_group) == (1000, 1000, 1000)
    redis = layout.pod("rollstream-redis-0")
    assert redis.uid == 999 and redis.volumes["data"].source == "data-rollstream-redis-0"
    assert "ROLLSTREAM_REDIS_SERVICE_HOST" in layout.pod("rollstream-ray-head").env  # links on there
    assert expand("$(A)-$$(A)-$(B)", {"A": "x"}) == "x-$(A)-$(B)"


def test_service_variables_are_the_kubelets() -> None:
    env = service_variables(
        [Service("rollstream-redis", {"a": "b"}, [("redis", 6379)])], {"rollstream-redis": "10.1.2.3"}
    )
    assert env["ROLLSTREAM_REDIS_PORT"] == "tcp://10.1.2.3:6379"
    assert env["ROLLSTREAM_REDIS_SERVICE_PORT_REDIS"] == "6379"
    assert env["ROLLSTREAM_REDIS_PORT_6379_TCP_ADDR"] == "10.1.2.3"
    assert service_variables([Service("h", {}, [("", 1)], headless=True)], {"h": "10.0.0.1"}) == {}


def test_every_rollstream_pods_settings_load_as_the_kubelet_gives_them(
    layout: k8s_manifests.Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by running them: the kubelet's ROLLSTREAM_REDIS_PORT=tcp://... (Service
    rollstream-redis) is a ROLLSTREAM_ variable that is no setting, and every process
    exited 2 until the pods had enableServiceLinks: false."""
    ours = [p for p in layout.pods if p.command and p.command[0] == "rollstream"]
    assert len(ours) == 8
    for pod in ours:
        assert not pod.service_links, pod.name
        for name in [n for n in os.environ if n.startswith("ROLLSTREAM_")]:
            monkeypatch.delenv(name)
        for name, value in pod.env.items():
            if name.startswith("ROLLSTREAM_"):
                monkeypatch.setenv(name, value)
        assert load_settings().run == "exp1"


def test_the_image_has_ray_on_a_login_shells_path() -> None:
    """Found by running them: KubeRay's `bash -lc` reads Debian's /etc/profile, which sets
    PATH without the image's /opt/venv/bin: `ray: command not found` on every Ray pod."""
    assert "ray" in IMAGE_LINKS.findall((ROOT / "deploy" / "Dockerfile").read_text())


def test_the_trainer_command_for_a_short_run(layout: k8s_manifests.Layout) -> None:
    argv = trainer_command(layout, 3)
    assert argv[:2] == ["rollstream", "train"] and "--hf-model" not in argv and "/models/policy" not in argv
    assert argv[argv.index("--steps") + 1] == "3" and "--stop-run" in argv


def test_a_manifest_it_cannot_read_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: []}\n")
    with pytest.raises(ManifestError, match="kind Pod"):
        k8s_manifests.load([bad])
    bad.write_text(
        "apiVersion: batch/v1\nkind: Job\nmetadata: {name: j}\nspec:\n  template:\n    spec:\n"
        "      restartPolicy: Never\n      securityContext: {runAsNonRoot: true, runAsUser: 0}\n"
        '      containers: [{name: c, image: "rollstream:x", command: [x]}]\n'
    )
    with pytest.raises(ManifestError, match="runAsNonRoot"):
        k8s_manifests.load([bad])


def test_a_pods_containers_share_its_volumes_and_name() -> None:
    """ha/redis-ha.yaml: each pod a data node and a Sentinel, one name (the fieldRef that
    SELF is made of), one set of volumes; each container its own command."""
    k8s = ROOT / "deploy" / "k8s"
    made = k8s_manifests.load([k8s / "config.yaml", k8s / "redis-acl.yaml", k8s / "ha" / "redis-ha.yaml"])
    resolve(made, {p.name: "10.0.0.9" for p in made.pods})
    data, sentinel = made.pod("rollstream-redis-ha-1"), made.pod("rollstream-redis-ha-1:sentinel")
    assert sentinel.pod_name == data.name == "rollstream-redis-ha-1"
    assert (
        data.env["SELF"] == sentinel.env["SELF"] == "rollstream-redis-ha-1.rollstream-redis-ha.rollstream.svc"
    )
    assert data.command[-1] == "data" and sentinel.command[-1] == "sentinel"
    assert data.volumes is sentinel.volumes and data.volumes["data"].source == "data-rollstream-redis-ha-1"
    service = next(s for s in made.services if s.name == "rollstream-redis-ha")
    assert service.headless and [p.name for p in made.backing(service)] == [
        f"rollstream-redis-ha-{i}" for i in range(3)
    ]
    hosts = host_names(made.pods)
    assert hosts["rollstream-redis-ha-1:sentinel"] == hosts["rollstream-redis-ha-1"]
