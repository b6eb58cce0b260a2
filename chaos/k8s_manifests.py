"""deploy/k8s's manifests read as a cluster would turn them into pods (chaos/k8s_pods.py
runs those pods on emulated hosts): each pod's command line, environment, user and
volumes, from the manifests themselves, never copied by hand.

What a part of Kubernetes would do, and how closely this follows it:

- controllers: a Deployment or StatefulSet makes ``replicas`` pods, a Job one (its
  ``parallelism``); KubeRay makes the RayCluster's head pod and ``replicas`` pods per
  worker group, and the head's Service ``<cluster>-head-svc``;
- the kubelet's environment: the Services' variables first (``enableServiceLinks``,
  on by default: ``<SERVICE>_SERVICE_HOST``, ``<SERVICE>_PORT=tcp://...`` and the
  rest, the address being the first pod's, as there is no cluster IP here), then
  ``envFrom`` (ConfigMaps, Secrets, their ``prefix``), then ``env`` in order, with
  ``$(VAR)`` of a variable defined before expanded (``$$`` is a ``$``) and ``valueFrom``
  (secretKeyRef, configMapKeyRef, fieldRef of the pod's name, namespace and IP); then
  ``$(VAR)`` in ``command`` and ``args`` (chaos/k8s_env.py); the image's variables beneath;
- KubeRay's command line (its ``generateRayStartCommand`` conventions): ``ray start
  [--head]`` and each rayStartParam as ``--key=value`` (``"true"`` as a bare
  ``--key``, ``"false"`` left out), with what KubeRay adds when missing: ``--block``,
  ``--dashboard-host=0.0.0.0`` on the head, ``--address=<head-svc FQDN>:6379`` on a
  worker, ``--metrics-export-port=8080``, ``--dashboard-agent-listen-port=52365``,
  ``--num-cpus`` / ``--memory`` / ``--num-gpus`` from the container's limits (CPU and
  memory from the requests when there is no limit); run as KubeRay does, ``bash -lc
  "ulimit -n 65536; ray start ..."``. Approximated: the order of the flags (KubeRay's
  is Go's map order), the probes and KubeRay's other variables beside those set here.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

NAMESPACE = "rollstream"
CLUSTER_DOMAIN = "cluster.local"
GCS_PORT = 6379  # KubeRay's default head port
KUBERAY_HEAD_PORTS = {"gcs": GCS_PORT, "client": 10001, "dashboard": 8265, "metrics": 8080}
# the image's environment (deploy/Dockerfile's ENV, USER and WORKDIR)
IMAGE_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "HOME": "/home/rollstream"}
IMAGE_WORKDIR = "/home/rollstream"
WORKLOADS = ("Deployment", "StatefulSet", "Job")
# the images this machine stands in for: rollstream's (its venv) and Redis's (its redis-server);
# a container of another (the Redis exporter) is not started, and said so (Layout.skipped)
IMAGES = ("rollstream:", "redis:")
PLACEHOLDERS = ("change-me",)  # a Secret's value that the test makes up (the others are kept)
IGNORED = ("Namespace", "PersistentVolumeClaim", "NetworkPolicy", "PodDisruptionBudget",
           "ScaledObject", "TriggerAuthentication")  # fmt: skip


class ManifestError(ValueError):
    """A manifest that a cluster would refuse or that this reading does not handle: what."""


@dataclass
class Volume:
    name: str
    kind: str  # emptyDir, claim, configMap, secret
    source: str = ""  # the claim's, ConfigMap's or Secret's name
    medium: str = ""  # emptyDir: "" or "Memory"
    size: str = ""  # emptyDir's sizeLimit
    items: dict[str, str] = field(default_factory=dict)  # configMap / secret: file -> content


@dataclass
class Mount:
    path: str
    volume: str
    read_only: bool = False


@dataclass
class Pod:
    name: str  # as Kubernetes names it: rollstream-producer-0, rollstream-ray-gpu-worker-0
    owner: str  # the workload: rollstream-producer, rollstream-ray-head
    kind: str  # Deployment, StatefulSet, Job, RayHead, RayWorker
    labels: dict[str, str]
    command: list[str]  # the container's command and args, $(VAR) expanded
    env: dict[str, str]  # ordered: the image's, the Services', envFrom, env
    uid: int | None
    gid: int | None
    fs_group: int | None
    run_as_non_root: bool
    no_new_privs: bool
    read_only_root: bool
    volumes: dict[str, Volume]
    mounts: list[Mount]
    readiness: list[str] | None = None  # an exec readiness probe's command
    liveness: dict[str, Any] = field(default_factory=dict)  # the probe, as written
    ports: dict[str, int] = field(default_factory=dict)  # the container's named ports
    service_links: bool = True
    backoff_limit: int = 0  # a Job's: failed pods made again
    fail_codes: tuple[int, ...] = ()  # a Job's podFailurePolicy: these exits fail it at once
    env_from: list[dict[str, Any]] = field(default_factory=list)  # the container's, as written
    env_list: list[dict[str, Any]] = field(default_factory=list)
    address: str = ""  # filled in once its host has one
    pod_name: str = ""  # the pod's: a container past the first is ``<pod>:<container>``
    image: str = ""

    def __post_init__(self) -> None:
        self.pod_name = self.pod_name or self.name

    @property
    def is_job(self) -> bool:
        return self.kind == "Job"


@dataclass
class Service:
    name: str
    selector: dict[str, str]
    ports: list[tuple[str, int]]  # (name, port)
    headless: bool = False


@dataclass
class Layout:
    pods: list[Pod]
    services: list[Service]
    claims: dict[str, str]  # claim name -> access mode
    maps: dict[str, dict[str, str]] = field(default_factory=dict)  # ConfigMaps' data
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # Secrets' (the values given)
    skipped: list[str] = field(default_factory=list)  # containers of an image not stood in for

    def pod(self, name: str) -> Pod:
        return next(p for p in self.pods if p.name == name)

    def of(self, owner: str) -> list[Pod]:
        return [p for p in self.pods if p.owner == owner]

    def backing(self, service: Service) -> list[Pod]:
        """The pods a Service selects (by their first container)."""
        selector = service.selector.items()
        return [p for p in self.pods if selector and selector <= p.labels.items() and p.name == p.pod_name]


def read_documents(paths: Iterable[Path]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            if not isinstance(doc, dict) or "kind" not in doc:
                raise ManifestError(f"{path}: a document without a kind")
            docs.append(doc)
    return docs


def load(
    paths: Iterable[Path],
    settings: Mapping[str, str] | None = None,
    replicas: Mapping[str, int] | None = None,
    commands: Mapping[str, list[str]] | None = None,
    secret_values: Mapping[str, str] | None = None,
) -> Layout:
    """The pods of ``paths``' objects. ``settings``: ConfigMap ``rollstream-settings``
    entries replaced or added (as one edits config.yaml's); ``replicas``: a workload's or
    Ray worker group's (``<cluster>/<group>``) count; ``commands``: a container's command
    line by workload name, replacing the manifest's; ``secret_values``: each Secret
    key's value (a fresh random one for every placeholder ``change-me`` not named)."""
    docs = read_documents(paths)
    maps: dict[str, dict[str, str]] = {}
    secret_maps: dict[str, dict[str, str]] = {}
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            maps[doc["metadata"]["name"]] = {k: str(v) for k, v in (doc.get("data") or {}).items()}
        elif doc["kind"] == "Secret":
            keys = {**(doc.get("stringData") or {}), **(doc.get("data") or {})}
            chosen = secret_values or {}
            secret_maps[doc["metadata"]["name"]] = {
                k: chosen.get(k) or (secrets.token_hex(16) if str(v) in PLACEHOLDERS else str(v))
                for k, v in keys.items()
            }
    if settings:
        maps.setdefault("rollstream-settings", {}).update(settings)
    services = [_service(d) for d in docs if d["kind"] == "Service"]
    claims = {
        d["metadata"]["name"]: d["spec"]["accessModes"][0]
        for d in docs
        if d["kind"] == "PersistentVolumeClaim"
    }
    reader = _Reader(maps, secret_maps, dict(replicas or {}), dict(commands or {}))
    pods: list[Pod] = []
    for doc in docs:
        kind = doc["kind"]
        if kind in WORKLOADS:
            pods += reader.workload(doc, claims)
        elif kind == "RayCluster":
            ray_pods, head_svc = reader.ray_cluster(doc)
            pods += ray_pods
            services.append(head_svc)
        elif kind not in (*IGNORED, "ConfigMap", "Secret", "Service"):
            raise ManifestError(f"{doc['metadata']['name']}: kind {kind} is not read here")
    names = [p.name for p in pods]
    if len(set(names)) != len(names):
        raise ManifestError(f"two pods of the same name: {names}")
    return Layout(pods, services, claims, maps, secret_maps, reader.skipped)


def _service(doc: dict[str, Any]) -> Service:
    spec = doc["spec"]
    ports = [(p.get("name", ""), int(p["port"])) for p in spec.get("ports", [])]
    headless = spec.get("clusterIP") == "None"
    return Service(doc["metadata"]["name"], dict(spec.get("selector") or {}), ports, headless)


class _Reader:
    def __init__(
        self,
        maps: dict[str, dict[str, str]],
        secret_maps: dict[str, dict[str, str]],
        replicas: dict[str, int],
        commands: dict[str, list[str]],
    ) -> None:
        self.maps, self.secret_maps = maps, secret_maps
        self.replicas, self.commands = replicas, commands
        self.skipped: list[str] = []

    def workload(self, doc: dict[str, Any], claims: dict[str, str]) -> list[Pod]:
        name, kind, spec = doc["metadata"]["name"], doc["kind"], doc["spec"]
        count = self.replicas.get(name, int(spec.get("parallelism" if kind == "Job" else "replicas", 1)))
        template = spec["template"]
        restart = template["spec"].get("restartPolicy", "Always")
        if kind == "Job" and restart not in ("Never", "OnFailure"):
            raise ManifestError(f"{name}: a Job's restartPolicy must be Never or OnFailure, not {restart}")
        extra: dict[str, Volume] = {}
        for claim_template in spec.get("volumeClaimTemplates", []):
            vol = claim_template["metadata"]["name"]
            extra[vol] = Volume(vol, "claim", f"{vol}-{name}-{{i}}")
        fail_codes: list[int] = []
        for rule in (spec.get("podFailurePolicy") or {}).get("rules", []):
            codes = rule.get("onExitCodes") or {}
            if rule.get("action") == "FailJob" and codes.get("operator") == "In":
                fail_codes += [int(c) for c in codes.get("values", [])]
        pods = []
        for i in range(count):
            pod_name = f"{name}-{i}" if kind != "Job" else name if count == 1 else f"{name}-{i}"
            volumes = {v: Volume(x.name, x.kind, x.source.format(i=i)) for v, x in extra.items()}
            for index, container in enumerate(template["spec"]["containers"]):
                if not str(container.get("image", "")).startswith(IMAGES):
                    self.skipped.append(f"{pod_name}:{container['name']} ({container.get('image')})")
                    continue
                pod = self.pod(pod_name, name, kind, template, volumes, index=index)
                if kind == "Job":
                    pod.backoff_limit, pod.fail_codes = int(spec.get("backoffLimit", 6)), tuple(fail_codes)
                pods.append(pod)
        for pod in pods:
            for vol in pod.volumes.values():
                if vol.kind == "claim" and "{i}" not in vol.source and vol.source not in claims:
                    claims.setdefault(vol.source, "ReadWriteMany")  # made before the run (the README)
        return pods

    def ray_cluster(self, doc: dict[str, Any]) -> tuple[list[Pod], Service]:
        cluster = doc["metadata"]["name"]
        spec = doc["spec"]
        head_svc = f"{cluster}-head-svc"
        fqdn = f"{head_svc}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
        head_name = f"{cluster}-head"
        head = spec["headGroupSpec"]
        pods = [self._ray_pod(head_name, head_name, "RayHead", cluster, "headgroup", head, fqdn)]
        for group in spec.get("workerGroupSpecs", []):
            gname = group["groupName"]
            count = self.replicas.get(f"{cluster}/{gname}", int(group.get("replicas", 1)))
            for i in range(count):
                pod_name = f"{cluster}-{gname}-worker-{i}"
                pods.append(
                    self._ray_pod(pod_name, f"{cluster}-{gname}", "RayWorker", cluster, gname, group, fqdn)
                )
        svc = Service(head_svc, {"ray.io/cluster": cluster, "ray.io/node-type": "head"},
                      list(KUBERAY_HEAD_PORTS.items()))  # fmt: skip
        return pods, svc

    def _ray_pod(
        self, name: str, owner: str, kind: str, cluster: str, group: str, spec: dict[str, Any], fqdn: str
    ) -> Pod:
        template = spec["template"]
        container = template["spec"]["containers"][0]
        params = {k: str(v) for k, v in (spec.get("rayStartParams") or {}).items()}
        head = kind == "RayHead"
        if head:
            params.setdefault("dashboard-host", "0.0.0.0")
        else:
            params.setdefault("address", f"{fqdn}:{GCS_PORT}")
        params["block"] = "true"
        params.setdefault("dashboard-agent-listen-port", "52365")
        params.setdefault("metrics-export-port", "8080")
        resources = container.get("resources", {})
        limits, requests = resources.get("limits", {}), resources.get("requests", {})
        cpu = limits.get("cpu", requests.get("cpu"))
        if "num-cpus" not in params and cpu is not None:
            params["num-cpus"] = str(int(_quantity(str(cpu))))
        memory = limits.get("memory", requests.get("memory"))
        if "memory" not in params and memory is not None:
            params["memory"] = str(int(_quantity(str(memory))))
        gpus = limits.get("nvidia.com/gpu")
        if "num-gpus" not in params and gpus is not None:
            params["num-gpus"] = str(int(_quantity(str(gpus))))
        flags = []
        for key, value in params.items():
            if value.lower() in ("true", "false") and key not in ("log-color", "include-dashboard"):
                if value.lower() == "true":
                    flags.append(f"--{key}")
            else:
                flags.append(f"--{key}={value}")
        start = f"ray start{' --head' if head else ''} {' '.join(flags)}"
        labels = {**(template.get("metadata", {}).get("labels") or {}), "ray.io/cluster": cluster,
                  "ray.io/node-type": "head" if head else "worker", "ray.io/group": group}  # fmt: skip
        kuberay_env = {
            "RAY_CLUSTER_NAME": cluster,
            "RAY_CLOUD_INSTANCE_ID": name,
            "RAY_NODE_TYPE_NAME": group,
            "RAY_IP": "127.0.0.1" if head else fqdn,
            "RAY_PORT": str(GCS_PORT),
            "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
            "KUBERAY_GEN_RAY_START_CMD": start,
            **({"RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}"} if head else {}),
        }
        command = ["/bin/bash", "-lc", "--", f"ulimit -n 65536; {start}"]
        pod = self.pod(name, owner, kind, template, {}, command=command, extra_env=kuberay_env)
        pod.labels.update(labels)
        return pod

    def pod(
        self,
        name: str,
        owner: str,
        kind: str,
        template: dict[str, Any],
        volumes: dict[str, Volume],
        command: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        index: int = 0,
    ) -> Pod:
        """Container ``index`` of the pod (the containers of a pod share its host, volumes
        and address; each its own command, environment and user)."""
        spec = template["spec"]
        container = spec["containers"][index]
        if index:
            name, pod_name = f"{name}:{container['name']}", name
        else:
            pod_name = name
        pod_ctx, ctx = spec.get("securityContext") or {}, container.get("securityContext") or {}
        uid = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
        gid = ctx.get("runAsGroup", pod_ctx.get("runAsGroup"))
        non_root = bool(ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot", False)))
        if non_root and uid == 0:
            raise ManifestError(f"{owner}: runAsNonRoot with runAsUser 0: the kubelet refuses to start it")
        for vol in spec.get("volumes", []):
            volumes[vol["name"]] = self._volume(owner, vol)
        mounts = []
        for m in container.get("volumeMounts", []):
            if m["name"] not in volumes:
                raise ManifestError(f"{owner}: volumeMount {m['name']!r} names no volume of the pod")
            if "subPath" in m:
                raise ManifestError(f"{owner}: subPath mounts are not read here")
            mounts.append(Mount(m["mountPath"], m["name"], bool(m.get("readOnly", False))))
        probe = (container.get("readinessProbe") or {}).get("exec", {}).get("command")
        env = dict(IMAGE_ENV)
        env["HOSTNAME"] = pod_name
        env.update(extra_env or {})
        pod = Pod(
            name=name,
            pod_name=pod_name,
            image=str(container.get("image", "")),
            owner=owner,
            kind=kind,
            labels=dict((template.get("metadata") or {}).get("labels") or {}),
            command=[],
            env=env,
            uid=uid,
            gid=gid,
            fs_group=pod_ctx.get("fsGroup"),
            run_as_non_root=non_root,
            no_new_privs=ctx.get("allowPrivilegeEscalation") is False,
            read_only_root=bool(ctx.get("readOnlyRootFilesystem", False)),
            volumes=volumes,
            mounts=mounts,
            readiness=probe,
            liveness=dict(container.get("livenessProbe") or {}),
            ports={p["name"]: int(p["containerPort"]) for p in container.get("ports", []) if "name" in p},
            service_links=spec.get("enableServiceLinks", True) is not False,
            env_from=list(container.get("envFrom", [])),
            env_list=list(container.get("env", [])),
        )
        argv = (
            command or self.commands.get(owner) or [*container.get("command", []), *container.get("args", [])]
        )
        if not argv:
            raise ManifestError(f"{owner}: no command (the image's entrypoint is not read here)")
        pod.command = list(argv)
        return pod

    def _volume(self, owner: str, vol: dict[str, Any]) -> Volume:
        name = vol["name"]
        if "emptyDir" in vol:
            empty = vol["emptyDir"] or {}
            return Volume(
                name, "emptyDir", medium=empty.get("medium", ""), size=str(empty.get("sizeLimit", ""))
            )
        if "persistentVolumeClaim" in vol:
            return Volume(name, "claim", vol["persistentVolumeClaim"]["claimName"])
        if "configMap" in vol:
            source = vol["configMap"]["name"]
            if source not in self.maps:
                raise ManifestError(
                    f"{owner}: volume {name!r} names ConfigMap {source!r}, which no manifest has"
                )
            return Volume(name, "configMap", source, items=dict(self.maps[source]))
        if "secret" in vol:
            source = vol["secret"]["secretName"]
            if source not in self.secret_maps:
                raise ManifestError(
                    f"{owner}: volume {name!r} names Secret {source!r}, which no manifest has"
                )
            return Volume(name, "secret", source, items=dict(self.secret_maps[source]))
        raise ManifestError(f"{owner}: volume {name!r} of a kind not read here: {sorted(vol)}")


def _quantity(text: str) -> float:
    """A Kubernetes quantity (``8Gi``, ``500m``, ``2``) as a number."""
    units = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "m": 1e-3,
    }
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)
