"""deploy/redis-ha.sh with the run's ACL users (ACL_SH): each data node loads the file that
deploy/redis/acl.sh prints, the replica replicates as user `replica`, the Sentinels reach
the nodes as user `sentinel` and fail a killed primary over; a producer's user writes
through the Sentinels before and after, and nothing of the set is refused."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollstream.shared.connection import connect
from rollstream.shared.embedded import find_redis_server
from rollstream.shared.settings import RedisSettings
from tests.helpers import unshared_port, wait_for

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVICE = "rollstream"
RUN = "hacl"
ROLES = ("admin", "producer", "trainer", "feeder", "engines", "judge", "archive", "metrics", "monitor",
         "replica", "sentinel")  # fmt: skip


class Node:
    """A node that redis-ha.sh started: its process (the exec'd redis-server) and port."""

    def __init__(self, root: Path, name: str, role: str, env: dict[str, str], port: int) -> None:
        self.role, self.port, self.folder = role, port, root / name
        self.folder.mkdir()
        self.env = {
            **env,
            "DATA": str(self.folder),
            "REDIS_PORT" if role == "data" else "SENTINEL_PORT": str(port),
        }
        if role == "data":  # its own copy: the Sentinels rewrite it
            (self.folder / "redis.conf").write_text((DEPLOY / "redis.conf").read_text())
            self.env["CONF"] = str(self.folder / "redis.conf")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Node:
        with (self.folder / "log").open("ab") as log:
            self.proc = subprocess.Popen(["sh", str(DEPLOY / "redis-ha.sh"), self.role], env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        wait_for(self._answers, timeout=20)
        return self

    def client(self) -> redis.Redis:
        if self.role == "data":
            auth = {"username": "admin", "password": self.env["REDIS_PASSWORD_ADMIN"]}
        else:
            auth = {"password": self.env["SENTINEL_PASSWORD"]}
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2, **auth)

    def _answers(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, (self.folder / "log").read_text()[-2000:]
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def replication(self) -> dict[str, object]:
        try:
            return dict(self.client().info("replication"))
        except redis.RedisError:
            return {}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def acl_set(tmp_path: Path) -> Iterator[tuple[list[Node], list[Node], dict[str, str]]]:
    binary = Path(find_redis_server())
    path = f"{binary.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if shutil.which("redis-cli", path=path) is None or shutil.which("timeout", path=path) is None:
        pytest.skip("redis-cli and timeout are needed beside redis-server")
    ports: set[int] = set()
    while len(ports) < 5:
        ports.add(unshared_port())
    data_ports, sentinel_ports = sorted(ports)[:2], sorted(ports)[2:]
    passwords = {role: f"{role}-{os.urandom(6).hex()}" for role in ROLES}
    env = {
        "PATH": path, "SELF": "127.0.0.1", "BIND": "127.0.0.1", "FIRST": f"127.0.0.1:{data_ports[0]}",
        "SENTINELS": " ".join(f"127.0.0.1:{p}" for p in sentinel_ports), "SERVICE": SERVICE,
        "DOWN_AFTER_MS": "3000", "ACL_SH": str(DEPLOY / "redis" / "acl.sh"), "RUN": RUN,
        "SENTINEL_PASSWORD": f"sentinels-{os.urandom(6).hex()}",
        **{f"REDIS_PASSWORD_{role.upper()}": pw for role, pw in passwords.items()},
    }  # fmt: skip
    data = [Node(tmp_path, f"data{i}", "data", env, p) for i, p in enumerate(data_ports)]
    sentinels = [Node(tmp_path, f"sentinel{i}", "sentinel", env, p) for i, p in enumerate(sentinel_ports)]
    try:
        yield data, sentinels, env
    finally:
        for node in [*sentinels, *data]:
            node.kill()


def _primary_port(sentinels: list[Node]) -> int | None:
    seen = set()
    for sentinel in sentinels:
        try:
            seen.add(int(sentinel.client().sentinel_get_master_addr_by_name(SERVICE)[1]))
        except (redis.RedisError, TypeError):
            return None
    return seen.pop() if len(seen) == 1 else None


def test_replicas_and_sentinels_authenticate_with_their_users_and_fail_over(
    acl_set: tuple[list[Node], list[Node], dict[str, str]],
) -> None:
    (first, second), sentinels, env = acl_set
    first.start()
    second.start()
    for sentinel in sentinels:
        sentinel.start()
    # the replica's link is up: it authenticated as `replica`, the only user with PSYNC
    wait_for(lambda: second.replication().get("master_link_status") == "up", timeout=30)
    wait_for(lambda: _primary_port(sentinels) == first.port, timeout=30)
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
    url = (
        f"redis+sentinel://producer:{env['REDIS_PASSWORD_PRODUCER']}@{hosts}/{SERVICE}/0"
        f"?sentinel_password={env['SENTINEL_PASSWORD']}"
    )
    producer = connect(RedisSettings(url=url, outage_limit_s=120))
    key = f"rs:{{{RUN}}}:progress"
    producer.hset(key, "math:fed", 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        producer.hset("rs:{other}:progress", "math:fed", 1)
    # promotable once in sync (the script's CONFIG SET, as `admin`), and seen so by the Sentinels
    wait_for(lambda: second.client().config_get("replica-priority")["replica-priority"] == "100", timeout=30)
    wait_for(
        lambda: all(
            int(r["slave-priority"]) == 100 for s in sentinels for r in s.client().sentinel_slaves(SERVICE)
        ),
        timeout=30,
    )
    first.kill()
    # the Sentinels, as user `sentinel`, promote the replica (REPLICAOF NO ONE, CONFIG REWRITE)
    wait_for(lambda: _primary_port(sentinels) == second.port, timeout=60)
    wait_for(lambda: second.replication().get("role") == "master", timeout=60)
    first.start()  # back as a replica of the new primary, again as `replica`
    wait_for(lambda: first.replication().get("master_link_status") == "up", timeout=60)
    producer.hset(key, "math:fed", 2)  # followed through the Sentinels
    assert first.client().hget(key, "math:fed") in (b"1", b"2")
    wait_for(lambda: first.client().hget(key, "math:fed") == b"2", timeout=30)
    for node in (first, second):  # nothing the replication or the Sentinels asked was refused
        log = node.client().acl_log(count=100)
        assert not [e for e in log if e["username"] in ("replica", "sentinel")], log
    producer.close()
