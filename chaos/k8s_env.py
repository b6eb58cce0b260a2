"""The kubelet's environment for the pods that chaos/k8s_manifests.py reads: the
Services' variables (``enableServiceLinks``), ``envFrom``, ``env`` with ``$(VAR)`` and
``valueFrom``, then ``$(VAR)`` in the command line (the order is told there)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from chaos.k8s_manifests import NAMESPACE, Layout, ManifestError, Pod, Service


def service_variables(services: Iterable[Service], address: Mapping[str, str]) -> dict[str, str]:
    """The kubelet's variables for the Services (``enableServiceLinks``), each at
    ``address[service name]``; headless Services and those with no pod get none."""
    env: dict[str, str] = {}
    for svc in services:
        ip = address.get(svc.name)
        if svc.headless or not ip or not svc.ports:
            continue
        base = svc.name.upper().replace("-", "_")
        first = svc.ports[0][1]
        env[f"{base}_SERVICE_HOST"] = ip
        env[f"{base}_SERVICE_PORT"] = str(first)
        for port_name, port in svc.ports:
            if port_name:
                env[f"{base}_SERVICE_PORT_{port_name.upper().replace('-', '_')}"] = str(port)
        env[f"{base}_PORT"] = f"tcp://{ip}:{first}"
        for _, port in svc.ports:
            tcp = f"{base}_PORT_{port}_TCP"
            env.update({tcp: f"tcp://{ip}:{port}", f"{tcp}_PROTO": "tcp", f"{tcp}_PORT": str(port),
                        f"{tcp}_ADDR": ip})  # fmt: skip
    return env


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)``: a defined variable's value, an undefined one left as
    written, ``$$`` a single ``$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REF.sub(one, text)


def resolve(layout: Layout, addresses: Mapping[str, str]) -> None:
    """Each pod's address (``addresses``: pod name -> address) and its environment as the
    kubelet makes it: the Services' variables, envFrom, env; then $(VAR) in the command."""
    for pod in layout.pods:
        pod.address = addresses[pod.name]
    at = {}
    for svc in layout.services:
        backing = layout.backing(svc)
        if backing:
            at[svc.name] = backing[0].address
    links = service_variables(layout.services, at)
    for pod in layout.pods:
        _finish_env(layout, pod, links)


def _finish_env(layout: Layout, pod: Pod, services: dict[str, str]) -> None:
    """The Services' variables, envFrom, env, then $(VAR) in the command line."""
    env = dict(pod.env)
    if pod.service_links:
        env.update(services)
    for source in pod.env_from:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            ref, table, what = source["configMapRef"], layout.maps, "ConfigMap"
        else:
            ref, table, what = source["secretRef"], layout.secrets, "Secret"
        if ref["name"] not in table:
            if ref.get("optional"):
                continue
            raise ManifestError(f"{pod.owner}: envFrom names {what} {ref['name']!r}, which no manifest has")
        env.update({prefix + k: v for k, v in table[ref["name"]].items()})
    for var in pod.env_list:
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
        else:
            value = _value_from(layout, pod, var)
            if value is not None:  # None: an optional reference to a key no manifest has
                env[var["name"]] = value
    pod.env = env
    pod.command = [expand(arg, env) for arg in pod.command]


def _value_from(layout: Layout, pod: Pod, var: dict[str, Any]) -> str | None:
    source = var.get("valueFrom") or {}
    for key, table, what in (("secretKeyRef", layout.secrets, "Secret"),
                             ("configMapKeyRef", layout.maps, "ConfigMap")):  # fmt: skip
        if key in source:
            ref = source[key]
            value = table.get(ref["name"], {}).get(ref["key"])
            if value is None and ref.get("optional"):
                return None
            if value is None:
                raise ManifestError(
                    f"{pod.owner}: {var['name']} from {what} {ref['name']!r} key {ref['key']!r}, "
                    "which no manifest has"
                )
            return value
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        fields = {"metadata.name": pod.pod_name, "metadata.namespace": NAMESPACE, "status.podIP": pod.address}
        if path not in fields:
            raise ManifestError(f"{pod.owner}: {var['name']} from fieldRef {path}, not read here")
        return fields[path]
    raise ManifestError(f"{pod.owner}: {var['name']} has neither a value nor a valueFrom read here")
