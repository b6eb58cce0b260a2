"""deploy/'s Redis with failover, checked without a cluster or docker: the Compose overlay
(compose/compose.ha.yaml) against the Compose specification and merged with compose.yaml,
the Kubernetes set (k8s/ha/) against Kubernetes' schemas and KEDA's CRDs, and what holds
them together: every rollstream process on the Sentinels with redis.wait_replicas, the
URL naming the Sentinels and the set's name that the nodes use, the start script the same
everywhere, the persistence settings rollstream needs. (tests/unit/test_deploy.py checks
every rollstream command and ROLLSTREAM_ variable in these files too, and yamllint;
tests/integration/test_deploy_ha.py runs the start script with real servers.)"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import yaml

from rollstream.shared import redisurl
from rollstream.shared.settings import load_settings
from tests.helpers import require
from tests.unit.test_deploy import DEPLOY, crd_errors, documents, expand

COMPOSE = DEPLOY / "compose"
HA = DEPLOY / "k8s" / "ha"
SCRIPT = DEPLOY / "redis-ha.sh"
# what rollstream needs of every Redis it runs on (README "Durability"; RedisOutOfMemory)
PERSISTENCE = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}


def conf_settings(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=1)
        if parts and not parts[0].startswith("#") and len(parts) == 2:
            out[parts[0]] = parts[1]
    return out


def test_every_redis_config_in_deploy_keeps_an_append_only_file_and_never_evicts() -> None:
    configs = {"redis.conf": (DEPLOY / "redis.conf").read_text()}
    for path in (DEPLOY / "k8s" / "redis.yaml", HA / "redis-ha.yaml"):
        for doc in documents(path):
            if doc["kind"] == "ConfigMap" and "redis.conf" in doc["data"]:
                configs[path.name] = doc["data"]["redis.conf"]
    assert len(configs) == 3
    for name, text in configs.items():
        found = conf_settings(text)
        assert {k: found.get(k) for k in PERSISTENCE} == PERSISTENCE, name


def test_the_start_script_parses_and_is_the_same_everywhere() -> None:
    assert subprocess.run(["sh", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    (config,) = [d for d in documents(HA / "redis-ha.yaml") if d["kind"] == "ConfigMap"]
    assert config["data"]["redis-ha.sh"] == SCRIPT.read_text(), "k8s/ha/redis-ha.yaml holds a stale copy"
    overlay = yaml.safe_load((COMPOSE / "compose.ha.yaml").read_text())
    for name in ("redis", "redis-replica", "sentinel-1"):
        assert "../redis-ha.sh:/usr/local/bin/redis-ha.sh:ro" in overlay["services"][name]["volumes"], name


def test_the_compose_overlay_is_valid_against_the_compose_specification() -> None:
    require("check_jsonschema", "test", load=False)
    check = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    done = subprocess.run([*check, str(COMPOSE / "compose.ha.yaml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def merged(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge of a service: mappings merged, a command replaced."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def test_the_compose_overlay_puts_every_rollstream_process_on_the_sentinels() -> None:
    base = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    overlay = yaml.safe_load((COMPOSE / "compose.ha.yaml").read_text())["services"]
    sentinels = sorted(name for name in overlay if name.startswith("sentinel-"))
    data = ["redis", "redis-replica"]
    assert len(sentinels) == 3
    node_env = overlay["sentinel-1"]["environment"]
    service = node_env["SERVICE"]
    # the nodes: each announces its own service name, the first primary is `redis`, the
    # Sentinels the nodes ask are those of the overlay, quorum a majority of them
    assert node_env["FIRST"] == "redis:6379"
    assert node_env["SENTINELS"].split() == [f"{s}:26379" for s in sentinels]
    for name in [*data, *sentinels]:
        assert overlay[name]["environment"]["SELF"] == name
        assert overlay[name]["environment"]["SERVICE"] == service
        assert overlay[name]["command"][-1] == ("data" if name in data else "sentinel")
    assert {v.split(":")[1] for n in data for v in overlay[n]["volumes"] if v.endswith(":/data")} == {"/data"}
    assert len({v for n in data for v in overlay[n]["volumes"] if v.endswith(":/data")}) == 2  # a volume each
    processes = [name for name, s in base.items() if s.get("command", [""])[0] == "rollstream"]
    with_settings = [name for name, s in base.items() if "ROLLSTREAM_RUN" in s.get("environment", {})]
    assert {"trainer", "producer", "feeder", "engines"} <= set(processes)
    for name in with_settings:
        service_def = merged(base[name], overlay.get(name, {}))
        env = service_def["environment"]
        if name not in processes:  # a Ray node needs no Redis user (deploy/redis/acl.sh)
            assert "ROLLSTREAM_REDIS__URL" not in env, name
            continue
        url = expand(env["ROLLSTREAM_REDIS__URL"])
        assert redisurl.scheme_of(url) in redisurl.SENTINELS, name
        target = redisurl.parse(url)
        assert [f"{h}:{p}" for h, p in target.hosts] == [f"{s}:26379" for s in sentinels], name
        assert target.service == service and "sentinel_password" in target.options, name
        assert env["ROLLSTREAM_REDIS__WAIT_REPLICAS"] == "1", name
        assert set(sentinels) <= set(service_def["depends_on"]), name  # started once the Sentinels answer
        load_settings(redis={"url": url, "wait_replicas": int(env["ROLLSTREAM_REDIS__WAIT_REPLICAS"])})


def ha_objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for p in sorted(HA.glob("*.yaml")) for d in documents(p)}


def test_the_kubernetes_set_is_valid() -> None:
    kubernetes_validate = require("kubernetes_validate", "test")
    require("jsonschema", "test", load=False)
    objects = ha_objects()
    assert {kind for kind, _ in objects} >= {"StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget",
                                             "ScaledObject"}  # fmt: skip
    for (kind, name), obj in objects.items():
        assert obj["metadata"]["namespace"] == "rollstream", name
        if kind in ("ScaledObject", "TriggerAuthentication"):
            assert not crd_errors(obj), crd_errors(obj)
        else:
            kubernetes_validate.validate(obj, "1.30", strict=True)


def test_the_kubernetes_set_holds_together() -> None:
    objects = ha_objects()
    sts = objects[("StatefulSet", "rollstream-redis-ha")]
    headless = objects[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    pods = [
        f"{sts['metadata']['name']}-{i}.{headless['metadata']['name']}.{sts['metadata']['namespace']}.svc"
        for i in range(sts["spec"]["replicas"])
    ]
    assert len(pods) == 3
    containers = {c["name"]: c for c in sts["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"redis", "sentinel", "redis-exporter"}
    del containers["redis-exporter"]  # beside the data node (tests/unit/test_deploy_exporter.py)
    env = {name: {e["name"]: e.get("value") for e in c["env"]} for name, c in containers.items()}
    for role, values in env.items():
        assert containers[role]["command"][-1] == ("data" if role == "redis" else "sentinel")
        assert values["SELF"] == "$(POD_NAME)." + pods[0].split(".", 1)[1]
        assert values["FIRST"] == f"{pods[0]}:6379"
        assert values["SENTINELS"].split() == [f"{p}:26379" for p in pods]
    assert env["redis"]["SERVICE"] == env["sentinel"]["SERVICE"]
    service = env["redis"]["SERVICE"]
    # the data node's folder is its claim; the budget keeps a majority up through a drain
    claim = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert {"name": claim, "mountPath": env["redis"]["DATA"]} in containers["redis"]["volumeMounts"]
    assert objects[("PodDisruptionBudget", "rollstream-redis-ha")]["spec"]["maxUnavailable"] == 1
    # the URL k8s/README.md gives the processes names these Sentinels and this set
    readme = (DEPLOY / "k8s" / "README.md").read_text()
    (line,) = [w for w in readme.split() if w.startswith("ROLLSTREAM_REDIS__URL=") and "+sentinel" in w]
    target = redisurl.parse(expand(line.split("=", 1)[1].strip("'\"")))
    assert [f"{h}:{p}" for h, p in target.hosts] == [f"{p}:26379" for p in pods]
    assert target.service == service
    # KEDA reads the producers the run wants from `rollstream metrics`, which follows the
    # failover itself: keda.yaml's ScaledObject as it is, no Sentinel nor password
    (plain,) = [d for d in documents(DEPLOY / "k8s" / "keda.yaml") if d["kind"] == "ScaledObject"]
    assert objects[("ScaledObject", "rollstream-producer")] == plain
    assert not [kind for kind, _ in objects if kind == "TriggerAuthentication"]


PROCESS_USERS = {"engines", "producer", "judge", "feeder", "metrics", "archive", "trainer"}


def test_the_k8s_readme_s_commands_move_every_process_to_the_sentinels() -> None:
    """k8s/README.md's assignment and sed, run as written (without kubectl): every
    ROLLSTREAM_REDIS__URL of the processes and the trainer Job is the Sentinels' after."""
    readme = (DEPLOY / "k8s" / "README.md").read_text()
    block = readme[readme.index("## Redis with failover") :]
    lines = block[block.index("```sh\n") + 6 :].split("```")[0].splitlines()
    (assign,) = [line for line in lines if line.startswith("ROLLSTREAM_REDIS__URL=")]
    (sed,) = [line.strip() for line in lines if line.strip().startswith("sed ")]
    sed = sed.split(" | kubectl")[0]
    wanted = assign.split("=", 1)[1].strip("'")
    for name in ("processes.yaml", "trainer-job.yaml"):
        script = f"{assign}\nf={name}\n{sed}"
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=DEPLOY.parent)
        assert done.returncode == 0, done.stderr
        urls = [
            e["value"]
            for d in yaml.safe_load_all(done.stdout)
            if d
            for e in _env_entries(d)
            if e["name"] == "ROLLSTREAM_REDIS__URL"
        ]
        assert urls, name
        for url in urls:  # each process keeps its own ACL user (deploy/redis/acl.sh)
            user = url.split("://", 1)[1].split(":", 1)[0]
            assert user in PROCESS_USERS and url == wanted.replace("\\1", user), (name, url)


def _env_entries(obj: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(obj, dict):
        if isinstance(obj.get("env"), list):
            out += obj["env"]
        for value in obj.values():
            out += _env_entries(value)
    elif isinstance(obj, list):
        for value in obj:
            out += _env_entries(value)
    return out


def test_the_readme_says_what_is_guaranteed_and_how_to_fail_over() -> None:
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("## Redis high availability") :]
    for needed in ("wait_replicas", "SENTINEL FAILOVER", "compose.ha.yaml", "k8s/ha/", "redis+cluster://"):
        assert needed in section, needed
