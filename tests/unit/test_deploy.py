"""deploy/ holds only what rollstream accepts: every `rollstream` command line in its
files (Compose, Kubernetes, Slurm, systemd, and the commands of its READMEs) parses
with the CLI, every `ROLLSTREAM_*` variable is a setting and its value valid; the
Compose file is valid against the Compose specification's schema, the built-in
Kubernetes objects against Kubernetes' own, the KubeRay / KEDA objects against their
CRDs' schemas (vendored in deploy/k8s/schemas) and for what rollstream relies on (no
cluster needed)."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollstream.cli.metrics import KEDA_PATH
from rollstream.cli.parser import build_parser
from rollstream.producer.fleet.demand import KEDA_VALUE
from rollstream.shared.settings import load_settings
from tests.helpers import require

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TEXT_FILES = ("*.sbatch", "*.service", "*.env", "*.md")
SHELL_END = re.compile(r"\s(?:&&|\|\||[&|;>]|2>)(?:\s|$)|\s&$")
VARIABLE = re.compile(r"ROLLSTREAM_[A-Z0-9_]+")
ASSIGNMENT = re.compile(r"(ROLLSTREAM_[A-Z0-9_]+)=('[^']*'|\"[^\"]*\"|[^\s`]+)")


def yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def text_files() -> list[Path]:
    return sorted(p for pattern in TEXT_FILES for p in DEPLOY.rglob(pattern))


def expand(text: str) -> str:
    """Shell, Compose and Kubernetes interpolations replaced: ``${X:-default}`` by its
    default, any other ``${X...}``, ``$(X)`` or ``$X`` by ``x``."""
    text = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", text)
    text = re.sub(r"\$\{[^}]*\}|\$\([A-Za-z_][A-Za-z0-9_]*\)|\$[A-Za-z_][A-Za-z0-9_]*", "x", text)
    return text


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def documents(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `rollstream`) of every rollstream command line in deploy/."""
    found: list[tuple[str, list[str]]] = []
    for path in yaml_files():
        for doc in documents(path):
            for node in walk(doc):
                if isinstance(node, list) and node and node[0] == "rollstream":
                    found.append((str(path.relative_to(DEPLOY)), [expand(str(a)) for a in node[1:]]))
    for path in text_files():
        text = path.read_text()
        if path.suffix == ".md":  # the commands of fenced code blocks only
            text = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S))
        text = text.replace("\\\n", " ")
        for number, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("#") or (path.suffix == ".service" and not line.startswith("Exec")):
                continue
            for match in re.finditer(r"(?:^|\s|/bin/)rollstream\s+(\S.*)", line):
                before = line[: match.start() + 1].split()[-1:]
                if before and before[0].startswith("-") and "=" not in before[0]:
                    continue  # the value of an option (a user name: `-u rollstream`), not a command
                rest = SHELL_END.split(" " + match.group(1) + " ", maxsplit=1)[0]
                found.append(
                    (f"{path.relative_to(DEPLOY)}:{number}", shlex.split(expand(rest), comments=True))
                )
    return found


def variables() -> dict[str, dict[str, str]]:
    """Per file: each ROLLSTREAM_ variable it names, with the value it gives (or "")."""
    out: dict[str, dict[str, str]] = {}
    for path in yaml_files():
        found: dict[str, str] = {}
        for doc in documents(path):
            for node in walk(doc):
                if isinstance(node, dict):
                    for key, value in node.items():
                        if isinstance(key, str) and VARIABLE.fullmatch(key):
                            found[key] = str(value)
                    if VARIABLE.fullmatch(str(node.get("name", ""))) and "value" in node:
                        found[node["name"]] = str(node["value"])
                elif isinstance(node, str):
                    for name in VARIABLE.findall(node):
                        found.setdefault(name, "")
        out[str(path.relative_to(DEPLOY))] = found
    for path in text_files():
        found = {}
        text = path.read_text()
        if path.suffix == ".service":  # a template unit's instance (%i) as systemd fills it in
            text = text.replace("%i", "1")
        for line in text.splitlines():
            for name, value in ASSIGNMENT.findall(line):
                found[name] = shlex.split(value)[0] if value.strip() else ""
            for name in VARIABLE.findall(line):
                found.setdefault(name, "")
        out[str(path.relative_to(DEPLOY))] = found
    return out


def test_every_yaml_file_in_deploy_parses() -> None:
    assert len(yaml_files()) >= 10
    for path in yaml_files():
        assert documents(path), f"{path}: no YAML document"


def test_every_rollstream_command_in_deploy_is_one_the_cli_accepts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    found = commands()
    used = {argv[0] for _, argv in found if argv}
    # every process of a run appears somewhere: the search itself works
    wanted = {"engines", "produce", "judge", "feed", "train", "metrics", "archive", "check", "status"}
    assert wanted <= used, used
    parser = build_parser()
    bad = []
    for where, argv in found:
        try:
            parser.parse_args(argv)
        except SystemExit:
            bad.append(f"{where}: rollstream {shlex.join(argv)}: {capsys.readouterr().err.strip()}")
    assert not bad, "\n".join(bad)


def test_deploy_yaml_is_linted() -> None:
    require("yamllint", "test", load=False)
    done = subprocess.run(
        [sys.executable, "-m", "yamllint", "-c", str(DEPLOY / ".yamllint.yaml"), str(DEPLOY)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_command_check_catches_a_flag_the_cli_does_not_have(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engines", "scale", "4", "--replicas", "2"])
    assert "--replicas" in capsys.readouterr().err


def test_every_rollstream_variable_in_deploy_is_a_setting_with_a_valid_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    per_file = variables()
    given = {name: value for found in per_file.values() for name, value in found.items() if value}
    assert len(given) >= 10
    for where, found in per_file.items():
        # what a file sets, together (one process's environment) ...
        with monkeypatch.context() as env:
            for name, value in found.items():
                if value:
                    env.setenv(name, expand(value))
            load_settings()  # raises SettingsError naming a variable that is no setting or not valid
        # ... and what it only names (a README's advice), each alone, with a value given elsewhere
        for name in (n for n, v in found.items() if not v):
            assert name in given, f"{where}: {name} is named but given a value nowhere in deploy/"
            with monkeypatch.context() as env:
                env.setenv(name, expand(given[name]))
                load_settings()


def test_a_variable_that_is_no_setting_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollstream.shared.errors import SettingsError

    monkeypatch.setenv("ROLLSTREAM_PROMPTS_FILE", "/data/p.jsonl")
    with pytest.raises(SettingsError, match="ROLLSTREAM_PROMPTS_FILE"):
        load_settings()


def test_the_compose_file_is_valid_against_the_compose_specification(tmp_path: Path) -> None:
    require("check_jsonschema", "test", load=False)
    check = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    compose = DEPLOY / "compose" / "compose.yaml"
    done = subprocess.run([*check, str(compose)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    # and the check is not vacuous: a key Compose does not have fails it
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        compose.read_text().replace("    deploy:\n      replicas: 2", "    deploy:\n      replica: 2")
    )
    assert broken.read_text() != compose.read_text()
    assert subprocess.run([*check, str(broken)], capture_output=True).returncode != 0


def kubernetes_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in documents(p)]


def test_the_kubernetes_objects_are_valid() -> None:
    kubernetes_validate = require("kubernetes_validate", "test")
    custom = {"RayCluster", "ScaledObject", "TriggerAuthentication"}
    kinds = set()
    for where, obj in kubernetes_objects():
        kinds.add(obj["kind"])
        assert obj["metadata"].get("namespace", "rollstream") == "rollstream", where
        if obj["kind"] not in custom:
            kubernetes_validate.validate(obj, "1.30", strict=True)
    assert {"StatefulSet", "Secret", "Deployment", "Job", "RayCluster", "ScaledObject"} <= kinds


# The custom objects' CRD schemas (openAPIV3Schema of the version used, descriptions
# removed), vendored from KubeRay and KEDA: deploy/k8s/schemas/README.md
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "ray.io_v1_raycluster.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda.sh_v1alpha1_triggerauthentication.json",
}


def strict(schema: Any) -> Any:
    """A CRD schema as the API server's strict field validation reads it (kubectl's
    default since 1.27: an unknown field is an error): every object schema with
    properties, unless it preserves unknown fields, allows no others."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    preserves = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not preserves:
        out["additionalProperties"] = False
    return out


def crd_errors(obj: dict[str, Any]) -> list[str]:
    import jsonschema

    name = CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])]
    schema = strict(json.loads((DEPLOY / "k8s" / "schemas" / name).read_text()))
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in validator.iter_errors(obj)]


def test_the_custom_objects_are_valid_against_their_crd_schemas() -> None:
    require("jsonschema", "test", load=False)
    custom = [(where, o) for where, o in kubernetes_objects() if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS]
    # KEDA reads its figure over HTTP with no credentials: no TriggerAuthentication (yet)
    assert {o["kind"] for _, o in custom} == {"RayCluster", "ScaledObject"}
    for where, obj in custom:
        errors = crd_errors(obj)
        assert not errors, f"{where}: {obj['kind']} {obj['metadata']['name']}:\n" + "\n".join(errors)


def test_the_crd_check_catches_a_misspelt_field_and_a_wrong_type() -> None:
    require("jsonschema", "test", load=False)
    objects = {o["kind"]: o for _, o in kubernetes_objects()}
    ray_cluster = copy.deepcopy(objects["RayCluster"])
    group = ray_cluster["spec"]["workerGroupSpecs"][0]
    group["replica"] = group.pop("replicas")  # RayCluster has no `replica`
    assert any("replica" in e for e in crd_errors(ray_cluster))
    ray_cluster = copy.deepcopy(objects["RayCluster"])
    ray_cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # a string map
    assert crd_errors(ray_cluster)
    scaled = copy.deepcopy(objects["ScaledObject"])
    scaled["spec"]["maxReplicas"] = "ten"
    assert any("maxReplicas" in e for e in crd_errors(scaled))
    scaled = copy.deepcopy(objects["ScaledObject"])
    trigger = scaled["spec"]["triggers"][0]
    trigger["valueLocation"] = trigger["metadata"].pop("valueLocation")  # a metadata field, not the trigger's
    assert any("valueLocation" in e for e in crd_errors(scaled))


def test_the_custom_objects_hold_together() -> None:
    """What rollstream relies on in the KubeRay and KEDA objects, beyond their CRD
    schemas: the Ray address the settings name is the RayCluster's head service,
    worker nodes offer the resource the engines ask for, token authentication is on,
    and KEDA scales the producers on the prompts stream that rollstream names."""
    objects = {(o["kind"], o["metadata"]["name"]): o for _, o in kubernetes_objects()}
    settings = objects[("ConfigMap", "rollstream-settings")]["data"]
    ray_cluster = objects[("RayCluster", "rollstream-ray")]
    assert ray_cluster["apiVersion"] == "ray.io/v1"
    # the processes' pods run no Ray node: Ray Client on the head, which serves it
    assert settings["ROLLSTREAM_RAY__ADDRESS"] == "ray://rollstream-ray-head-svc:10001"
    assert ray_cluster["spec"]["headGroupSpec"]["rayStartParams"]["ray-client-server-port"] == "10001"
    assert settings["RAY_AUTH_MODE"] == "token"
    wanted = yaml.safe_load(settings["ROLLSTREAM_ENGINES__RESOURCES"])
    for group in ray_cluster["spec"]["workerGroupSpecs"]:
        offered = yaml.safe_load(yaml.safe_load(group["rayStartParams"]["resources"]))
        assert set(wanted) <= set(offered)
    assert "resources" not in ray_cluster["spec"]["headGroupSpec"]["rayStartParams"]  # no engines on the head
    for spec in [ray_cluster["spec"]["headGroupSpec"], *ray_cluster["spec"]["workerGroupSpecs"]]:
        (container,) = spec["template"]["spec"]["containers"]
        assert {e["name"] for e in container["env"]} >= {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}

    scaled = objects[("ScaledObject", "rollstream-producer")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert ("Deployment", scaled["spec"]["scaleTargetRef"]["name"]) in objects
    (trigger,) = scaled["spec"]["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("metrics-api", "AverageValue")
    # KEDA asks `rollstream metrics` for the producers wanted: its Service, port and path, the
    # answer's field, one replica per producer wanted, bounded as KEDA bounds the replicas
    meta = trigger["metadata"]
    assert (meta["format"], meta["valueLocation"], meta["targetValue"]) == ("json", KEDA_VALUE, "1")
    url = urllib.parse.urlsplit(meta["url"])
    service, namespace = url.hostname.split(".")[:2]  # type: ignore[union-attr]
    ports = {p["name"]: p["port"] for p in objects[("Service", service)]["spec"]["ports"]}
    assert (namespace, url.port, url.path) == ("rollstream", ports["metrics"], KEDA_PATH)
    assert str(url.port) == settings["ROLLSTREAM_METRICS__PORT"]
    selector = objects[("Service", service)]["spec"]["selector"]
    assert (
        objects[("Deployment", service)]["spec"]["template"]["metadata"]["labels"].items() >= selector.items()
    )
    bounds = urllib.parse.parse_qs(url.query)
    assert (int(bounds["min"][0]), int(bounds["max"][0])) == (
        scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]
    )  # fmt: skip
    assert "authenticationRef" not in trigger
    # KEDA (its own namespace) may reach the metrics port; it needs no Redis
    ingress = objects[("NetworkPolicy", "rollstream-metrics")]["spec"]["ingress"]
    assert any({"namespaceSelector": {}} in r["from"] and {"port": url.port} in r["ports"] for r in ingress)
    redis_from = objects[("NetworkPolicy", "rollstream-redis")]["spec"]["ingress"][0]["from"]
    assert not [f for f in redis_from if "keda" in str(f.get("namespaceSelector"))]


def test_a_lost_run_is_never_restarted() -> None:
    """Exit 5 (the run is lost) is final under every supervisor deploy/ configures (README,
    the exit statuses); other failures are restarted."""
    units = [p for p in (DEPLOY / "systemd").glob("*.service") if "bin/rollstream " in p.read_text()]
    assert len(units) >= 6
    for unit in units:
        lines = unit.read_text().splitlines()
        assert "Restart=on-failure" in lines, unit.name
        prevent = [
            line.split("=", 1)[1].split() for line in lines if line.startswith("RestartPreventExitStatus=")
        ]
        assert prevent and "5" in prevent[0], unit.name
    (job,) = [d for d in documents(DEPLOY / "k8s" / "trainer-job.yaml") if d["kind"] == "Job"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert any(r["action"] == "FailJob" and 5 in r["onExitCodes"]["values"] for r in rules)
