"""Every layout gives each rollstream process its own Redis ACL user (deploy/redis/acl.sh,
the one source of the users' rules): the user its URL names is its role's, that user
exists in acl.sh, and no password is written in the repository (read from the files, no
cluster; the Slurm job run against stub commands)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.unit.test_deploy import expand
from tests.unit.test_deploy_hardening import STUBS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ACL_SH = DEPLOY / "redis" / "acl.sh"
# the user of each rollstream command that runs as a process of a run
ROLE_OF = {"engines": "engines", "produce": "producer", "judge": "judge", "feed": "feeder",
           "train": "trainer", "metrics": "metrics", "archive": "archive"}  # fmt: skip


def acl_roles() -> dict[str, str]:
    """Each user acl.sh knows, with its rules (for run `exp1`)."""
    text = ACL_SH.read_text()
    (names,) = re.findall(r'^ROLES="([^"]+)"', text, flags=re.M)
    env = {"PATH": os.environ["PATH"], "RUN": "exp1", "ACL_ROLES": names}
    done = subprocess.run(["sh", str(ACL_SH)], env=env, capture_output=True, text=True, check=True)
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def user_of(url: str) -> str:
    expanded = expand(url)
    return urlsplit(expanded.replace("redis+sentinel://", "redis://")).username or ""


def services(*files: str) -> dict[str, dict[str, Any]]:
    """Compose's services of these files, each later file's on top (environment merged)."""
    merged: dict[str, dict[str, Any]] = {}
    for name in files:
        for service, spec in yaml.safe_load((DEPLOY / "compose" / name).read_text())["services"].items():
            base = merged.setdefault(service, {})
            env = {**base.get("environment", {}), **(spec.get("environment") or {})}
            base.update(spec)
            base["environment"] = env
    return merged


def test_acl_sh_knows_every_role_and_each_reaches_only_its_run() -> None:
    roles = acl_roles()
    assert set(ROLE_OF.values()) | {"admin", "monitor", "exporter", "replica", "sentinel"} == set(roles)
    for role, rules in roles.items():
        keys = re.findall(r"(?:%R|%W|%RW)?~(\S+)", rules)
        if role == "admin":
            assert keys == ["*"]
            continue
        assert all(k.startswith("rs:{exp1}:") for k in keys), (role, keys)  # never another run's
        assert "+@all" not in rules and "+@admin" not in rules, role
    # the read-only ones write nothing but the metrics process's own heartbeat key
    assert re.findall(r"(?<![%R])~(\S+)", roles["metrics"]) == ["rs:{exp1}:alive:metrics:*"]
    assert not re.findall(r"(?<![%R])~(\S+)", roles["monitor"])
    assert "+xlen" in roles["monitor"] and "+@write" not in roles["monitor"]
    # the Redis exporter: INFO and its like, no key at all
    assert not re.findall(r"~(\S+)", roles["exporter"]) and "+info" in roles["exporter"]
    # the feeder cannot commit (no write on a groups stream), the producer cannot publish events
    assert "groups" not in " ".join(re.findall(r"(?<![%R])~(\S+)", roles["feeder"]))
    assert "events" not in " ".join(re.findall(r"(?<![%R])~(\S+)", roles["producer"]))


def test_acl_sh_refuses_a_run_name_that_would_widen_its_key_patterns() -> None:
    for bad in ("exp*", "a b", "x]y", "-exp"):
        done = subprocess.run(["sh", str(ACL_SH)], env={"PATH": os.environ["PATH"], "RUN": bad},
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 2 and "invalid run name" in done.stderr, bad


def test_acl_sh_writes_hashes_and_leaves_out_a_user_without_a_password() -> None:
    env = {
        "PATH": os.environ["PATH"],
        "RUN": "exp1",
        "REDIS_PASSWORD_PRODUCER": "pw-1",
        "REDIS_PASSWORD_ADMIN": "pw-2",
    }
    out = subprocess.run(["sh", str(ACL_SH)], env=env, capture_output=True, text=True, check=True).stdout
    assert "pw-1" not in out and "pw-2" not in out
    users = [line.split()[1] for line in out.splitlines()]
    assert users == ["default", "admin", "producer"]
    # default is the admin (the append-only file's replay runs as default: acl.sh says why)
    default, admin = out.splitlines()[:2]
    assert default.split()[2:] == admin.split()[2:] and default.split()[2] == "on"


def test_acl_sh_refuses_to_run_without_the_admins_password() -> None:
    env = {"PATH": os.environ["PATH"], "RUN": "exp1", "REDIS_PASSWORD_PRODUCER": "pw-1"}
    done = subprocess.run(["sh", str(ACL_SH)], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "REDIS_PASSWORD_ADMIN" in done.stderr


def test_compose_gives_each_process_its_roles_user_and_ray_nodes_none() -> None:
    for files in (("compose.yaml",), ("compose.yaml", "compose.ha.yaml")):
        seen = set()
        for name, spec in services(*files).items():
            command = spec.get("command") or []
            env = spec.get("environment", {})
            if command[:1] == ["rollstream"]:
                role = ROLE_OF[command[1]]
                assert user_of(env["ROLLSTREAM_REDIS__URL"]) == role, (files, name)
                assert f"REDIS_PASSWORD_{role.upper()}" in env["ROLLSTREAM_REDIS__URL"], (files, name)
                seen.add(role)
            elif name.startswith("ray-"):
                assert "ROLLSTREAM_REDIS__URL" not in env, (files, name)
        assert seen == set(ROLE_OF.values()), files
    redis = services("compose.yaml")["redis"]
    assert "--aclfile" in " ".join(redis["command"]) and "acl.sh" in " ".join(redis["command"])
    ha = services("compose.yaml", "compose.ha.yaml")
    assert ha["redis-replica"]["environment"]["ACL_SH"] and ha["sentinel-1"]["environment"]["ACL_SH"]


def test_kubernetes_gives_each_process_its_roles_user_and_password_alone() -> None:
    seen = set()
    for path in (DEPLOY / "k8s" / "processes.yaml", DEPLOY / "k8s" / "trainer-job.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") not in ("Job", "Deployment"):
                continue
            for container in doc["spec"]["template"]["spec"]["containers"]:
                if container.get("command", [""])[0] != "rollstream":
                    continue
                role = ROLE_OF[container["command"][1]]
                env = {e["name"]: e for e in container["env"]}
                assert user_of(env["ROLLSTREAM_REDIS__URL"]["value"]) == role, (path.name, role)
                refs = [e["valueFrom"].get("secretKeyRef", {}) for e in container["env"] if "valueFrom" in e]
                keys = [r["key"] for r in refs if "PASSWORD" in r.get("key", "")]
                assert sorted(keys) == sorted([f"REDIS_PASSWORD_{role.upper()}", "SENTINEL_PASSWORD"]), (
                    role,
                    keys,
                )
                seen.add(role)
    assert seen == set(ROLE_OF.values())
    docs = yaml.safe_load_all((DEPLOY / "k8s" / "config.yaml").read_text())
    (config,) = [
        d for d in docs if d and d["kind"] == "Secret" and d["metadata"]["name"] == "rollstream-redis-users"
    ]
    roles = acl_roles()
    assert {
        k.removeprefix("REDIS_PASSWORD_").lower() for k in config["stringData"] if "PASSWORD_" in k
    } == set(roles)
    assert all(v == "change-me" for k, v in config["stringData"].items() if "PASSWORD" in k)
    # KEDA reads the producers the run wants from `rollstream metrics` over HTTP: it is
    # given no Redis user at all (the read-only `monitor` serves probes and dashboards)
    for keda in ("keda.yaml", "ha/keda-ha.yaml"):
        text = (DEPLOY / "k8s" / keda).read_text()
        assert [d["kind"] for d in yaml.safe_load_all(text) if d] == ["ScaledObject"], keda
        assert "PASSWORD" not in text and "rollstream-redis-users" not in text, keda


def test_the_kubernetes_configmap_holds_acl_sh_as_it_is() -> None:
    (doc,) = yaml.safe_load_all((DEPLOY / "k8s" / "redis-acl.yaml").read_text())
    assert doc["data"]["acl.sh"] == ACL_SH.read_text(), (
        "k8s/redis-acl.yaml holds a stale copy of redis/acl.sh"
    )
    plain = (DEPLOY / "k8s" / "redis.yaml").read_text()
    assert "rollstream-redis-acl" in plain and "--aclfile" in plain and "--requirepass" not in plain
    ha = (DEPLOY / "k8s" / "ha" / "redis-ha.yaml").read_text()
    assert "rollstream-redis-acl" in ha and "name: ACL_SH" in ha  # redis-ha.sh's ACL mode


def test_systemd_gives_each_unit_its_roles_user() -> None:
    seen = set()
    for unit in sorted((DEPLOY / "systemd").glob("rollstream-*.service")):
        text = unit.read_text()
        (start,) = re.findall(r"^ExecStart=(.*)$", text, flags=re.M)
        files = re.findall(r"^EnvironmentFile=/etc/rollstream/redis/(\w+)\.env$", text, flags=re.M)
        match = re.search(r"/bin/rollstream (\w+)", start)
        if match is None:  # a Ray node: no Redis user
            assert not files, unit.name
            continue
        assert files == [ROLE_OF[match.group(1)]], unit.name
        seen.add(files[0])
    assert seen == set(ROLE_OF.values())
    assert "ROLLSTREAM_REDIS__URL" not in (DEPLOY / "systemd" / "rollstream.env").read_text()
    users = (DEPLOY / "systemd" / "redis-users.env").read_text()
    named = {m.lower() for m in re.findall(r"^#? ?REDIS_PASSWORD_(\w+)=", users, flags=re.M)}
    assert named == set(acl_roles())
    drop_in = (DEPLOY / "systemd" / "redis-server.service.d" / "rollstream-acl.conf").read_text()
    assert "deploy/redis/acl.sh > /etc/redis/users.acl" in drop_in
    assert "# aclfile /etc/redis/users.acl" in (DEPLOY / "redis.conf").read_text()


def test_the_slurm_job_starts_each_process_as_its_roles_user(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = '#!/bin/sh\necho "$1 $ROLLSTREAM_REDIS__URL $REDIS_PASSWORD_ADMIN" >> "$URLS"\n'
    stubs = {**STUBS, "rollstream": record + '[ "$1" = train ] && exit 0\nsleep 1\n'}
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-3]",
           "SLURM_JOB_NUM_NODES": "3", "SLURM_SUBMIT_DIR": str(tmp_path),
           "URLS": str(tmp_path / "urls")}  # fmt: skip
    job = subprocess.Popen(["bash", str(DEPLOY / "slurm" / "rollstream.sbatch")], env=env, cwd=ROOT,
                           start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out, _ = job.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # its own session: only what this test started
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert job.returncode == 0, out.decode(errors="replace")[-2000:]
    started = [line.split() for line in (tmp_path / "urls").read_text().splitlines()]
    # each process its own role's user, and no other password in its environment
    assert {command: user_of(url) for command, url, *_ in started} == {c: ROLE_OF[c] for c, *_ in started}
    assert {command for command, *_ in started} == set(ROLE_OF)
    assert all(len(line) == 2 for line in started), "a process was given the admin password"
    users = (tmp_path / "rollstream-exp1" / "redis" / "users.acl").read_text()
    made = {line.split()[1] for line in users.splitlines()}
    assert made == {"default", "admin", "exporter", *ROLE_OF.values()}
    assert all(urlsplit(url).password not in users for _, url, *_ in started)  # only their hashes


def test_no_layout_writes_a_redis_password() -> None:
    for path in [
        *DEPLOY.rglob("*.yaml"),
        *DEPLOY.rglob("*.env"),
        *DEPLOY.rglob("*.sbatch"),
        *DEPLOY.rglob("*.md"),
    ]:
        if "schemas" in path.parts:
            continue
        for url in re.findall(r"rediss?(?:\+sentinel)?://[^\s'\"\\]+", path.read_text()):
            password = (urlsplit(url.replace("+sentinel", "")).password or "") if "@" in url else ""
            assert password in ("", "change-me", "PASSWORD") or password.startswith(("$", "***")), (path, url)
