"""deploy/redis-ha.sh, the start script of the Compose and Kubernetes Redis sets with
failover, run as they run it with the real redis-server (on 127.0.0.1, free ports, no
containers): two data nodes and three Sentinels come up on deploy/redis.conf; a
rollstream client on the redis+sentinel:// URL the deploy files give writes through them
with redis.wait_replicas 1; a kill -9 of the primary is failed over, and the old primary
started again by the same script comes back as a replica of the new one."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollstream.consumer.replication import wait_for_replicas
from rollstream.shared import telemetry
from rollstream.shared.connection import NoReplicasError, connect
from rollstream.shared.embedded import find_redis_server
from rollstream.shared.errors import ReplicasBehind
from rollstream.shared.keys import Keys
from rollstream.shared.settings import RedisSettings
from tests.helpers import unshared_port, wait_for

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCRIPT = DEPLOY / "redis-ha.sh"
SERVICE = "rollstream"
PASSWORD = "ha-secret"


class Node:
    def __init__(self, root: Path, name: str, role: str, env: dict[str, str], port: int) -> None:
        self.name, self.role, self.port = name, role, port
        self.folder = root / name
        self.folder.mkdir()
        self.env = {**env, "DATA": str(self.folder)}
        if role == "data":  # its own copy: a Sentinel's reconfiguration rewrites it (CONFIG REWRITE)
            conf = self.folder / "redis.conf"
            conf.write_text((DEPLOY / "redis.conf").read_text())
            self.env["CONF"] = str(conf)
        self.env["REDIS_PORT" if role == "data" else "SENTINEL_PORT"] = str(port)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Node:
        with (self.folder / "log").open("ab") as log:
            self.proc = subprocess.Popen(["sh", str(SCRIPT), self.role], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        wait_for(self._answers, timeout=20)
        return self

    def _answers(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, (self.folder / "log").read_text()[-2000:]
        client = self.client()
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=PASSWORD, socket_timeout=2, socket_connect_timeout=2)

    def role_now(self) -> str:
        client = self.client()
        try:
            return str(client.info("replication")["role"])
        except redis.RedisError:
            return "?"
        finally:
            client.close()

    def priority(self) -> str:
        client = self.client()
        try:
            return str(client.config_get("replica-priority")["replica-priority"])
        except redis.RedisError:
            return "?"
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # the script exec'd redis-server: this is its pid
            self.proc.wait()


@pytest.fixture
def redis_set(tmp_path: Path) -> Iterator[tuple[list[Node], list[Node], str]]:
    binary = Path(find_redis_server())
    # chosen before any node starts (the script's FIRST and SENTINELS name them), so from
    # outside the range an outgoing connection may be given meanwhile
    ports = set()
    while len(ports) < 5:
        ports.add(unshared_port())
    data_ports, sentinel_ports = sorted(ports)[:2], sorted(ports)[2:]
    path = f"{binary.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if shutil.which("redis-cli", path=path) is None or shutil.which("timeout", path=path) is None:
        pytest.skip("redis-cli and timeout are needed beside redis-server")
    env = {
        "PATH": path, "SELF": "127.0.0.1", "BIND": "127.0.0.1", "FIRST": f"127.0.0.1:{data_ports[0]}",
        "SENTINELS": " ".join(f"127.0.0.1:{p}" for p in sentinel_ports), "SERVICE": SERVICE,
        "REDIS_PASSWORD": PASSWORD, "DOWN_AFTER_MS": "3000",
    }  # fmt: skip
    # DOWN_AFTER_MS 3 s: at 1 s, a make test on 4 workers once stalled the new primary long
    # enough for a second failover, back to the restarted node whose sync had not finished
    data = [Node(tmp_path, f"data{i}", "data", env, p) for i, p in enumerate(data_ports)]
    sentinels = [Node(tmp_path, f"sentinel{i}", "sentinel", env, p) for i, p in enumerate(sentinel_ports)]
    url = (
        f"redis+sentinel://:{PASSWORD}@{','.join(f'127.0.0.1:{p}' for p in sentinel_ports)}/{SERVICE}/0"
        f"?sentinel_password={PASSWORD}"
    )
    try:
        yield data, sentinels, url
    finally:
        for node in [*sentinels, *data]:
            node.kill()


def _link_up(node: Node) -> bool:
    client = node.client()
    try:
        return client.info("replication").get("master_link_status") == "up"
    except redis.RedisError:
        return False
    finally:
        client.close()


def _writes(node: Node, key: str, value: str) -> bool:
    """``node`` took the write (a primary with min-replicas-to-write refuses it while its
    replica is not yet counted in sync)."""
    client = node.client()
    try:
        return bool(client.set(key, value))
    except NoReplicasError:
        return False
    finally:
        client.close()


def _priority_seen(sentinel: Node, port: int) -> int | None:
    """The replica-priority that ``sentinel`` last read from the replica on ``port``."""
    client = sentinel.client()
    try:
        for replica in client.sentinel_slaves(SERVICE):
            if int(replica["port"]) == port:
                return int(replica["slave-priority"])
    except redis.RedisError:
        pass
    finally:
        client.close()
    return None


def _primary_port(sentinels: list[Node]) -> int | None:
    seen = []
    for sentinel in sentinels:
        with contextlib.suppress(redis.RedisError, TypeError):
            seen.append(int(sentinel.client().sentinel_get_master_addr_by_name(SERVICE)[1]))
    return seen[0] if len(seen) >= 2 and len(set(seen)) == 1 else None


def test_the_deploy_script_brings_up_a_set_that_fails_over(
    redis_set: tuple[list[Node], list[Node], str],
) -> None:
    data, sentinels, url = redis_set
    first, second = data
    first.start()
    second.start()  # no Sentinel answers yet: a replica of FIRST
    for sentinel in sentinels:
        sentinel.start()
    assert (first.role_now(), second.role_now()) == ("master", "slave")
    wait_for(lambda: _primary_port(sentinels) == first.port, timeout=20)
    config = first.client().config_get("appendonly", "appendfsync", "maxmemory-policy")
    assert config == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
    settings = RedisSettings(url=url, wait_replicas=1, outage_limit_s=60)
    client = connect(settings)
    keys = Keys("ha")
    figures = _Figures()
    client.hset(keys.state, "train_step", 1)
    assert wait_for_replicas(client, keys, settings, "a write", committed_step=1) == 1
    assert second.client().hget(keys.state, "train_step") == b"1"

    # in sync, so promotable, and the Sentinels have seen it (INFO, every 10 s): a Sentinel
    # that still sees priority 0 gives the failover up (for 2 x failover-timeout)
    wait_for(lambda: second.priority() == "100", timeout=30)
    wait_for(lambda: all(_priority_seen(s, second.port) == 100 for s in sentinels), timeout=30)
    first.kill()
    wait_for(lambda: _primary_port(sentinels) == second.port and second.role_now() == "master", timeout=30)
    # the new primary has no replica in sync while the old one is down: it takes no writes
    # (min-replicas-to-write 1), so that none can be lost with it
    with pytest.raises(NoReplicasError):
        second.client().hset(keys.state, "train_step", 2)
    first.start()  # the same script: the Sentinels name the new primary, so a replica of it
    assert first.role_now() == "slave"
    client.hset(keys.state, "train_step", 2)  # the client follows the Sentinels
    wait_for(lambda: first.priority() == "100", timeout=30)  # promotable again once in sync
    assert wait_for_replicas(client, keys, settings, "a write", committed_step=2) == 1
    assert first.client().hget(keys.state, "train_step") == b"2"
    # a commit that the primary does not hold is a failure of its own kind, not a wait
    with pytest.raises(ReplicasBehind, match="holds train_step 2, not 3"):
        wait_for_replicas(client, keys, settings, "a write", committed_step=3)
    # what an SRE's dashboard sees of it: one failover followed, two waits, one lost commit
    assert figures.changed() == {"primary changes": 1.0, "waits": 2.0, "lost commits": 1.0, "behind": 0.0}


def test_a_joining_replica_is_not_promotable_until_it_holds_the_data(
    redis_set: tuple[list[Node], list[Node], str],
) -> None:
    """A Sentinel promotes a replica whatever it holds: one that restarted and had not
    finished its first sync would, in a failover then, empty the set. The script starts a
    joining replica at replica-priority 0 and gives it the configured priority once in sync."""
    data, _, _ = redis_set
    first, second = data
    # Given a replica that cannot sync (its primary, FIRST, is not up yet; no Sentinel)
    second.start()
    assert second.role_now() == "slave"
    # Then no Sentinel may promote it
    assert second.priority() == "0"
    # and once its primary is up and it holds the data, it may be
    first.start()
    # a primary takes writes only with a replica in sync (the script's min-replicas-to-write 1)
    with pytest.raises(NoReplicasError):
        first.client().set("early", "v")
    wait_for(lambda: _link_up(second), timeout=30)
    wait_for(lambda: _writes(first, "k", "v"), timeout=30)
    wait_for(lambda: second.priority() == "100", timeout=30)
    assert second.client().get("k") == b"v"
    assert first.priority() == "100"  # the primary started as one: never held back


class _Figures:
    """This process's replication figures, counted from the test's start."""

    def __init__(self) -> None:
        self.start = self._now()

    @staticmethod
    def _now() -> dict[str, float]:
        value = telemetry.REGISTRY.get_sample_value
        return {
            "primary changes": value("rollstream_redis_primary_changes_total", telemetry.labels()) or 0.0,
            "waits": value("rollstream_redis_replica_wait_seconds_count", telemetry.labels()) or 0.0,
            "lost commits": value(
                "rollstream_redis_replica_wait_failures_total", telemetry.labels(reason="lost_commit")
            ) or 0.0,
            "behind": value(
                "rollstream_redis_replica_wait_failures_total", telemetry.labels(reason="behind")
            ) or 0.0,
        }  # fmt: skip

    def changed(self) -> dict[str, float]:
        return {name: value - self.start[name] for name, value in self._now().items()}
