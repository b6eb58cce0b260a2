"""Real replicated Redis set-ups for the high-availability tests, on free ports, stopped
by their pids: a primary, replicas and three Sentinels; a 3-master Redis Cluster, with a
replica per master or none."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import redis

from rollstream.shared.embedded import find_redis_server, free_port
from tests.helpers import wait_for

SERVICE = "mymaster"


class Node:
    """One redis-server (or Sentinel) process on 127.0.0.1 with a folder of its own."""

    def __init__(
        self, binary: str, folder: Path, args: list[str], port: int | None = None, password: str | None = None
    ) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.folder = folder
        self.args = args
        self.password = password  # the default user's
        self.tls: tuple[Path, Path] | None = None  # (certificate, key): serves TLS only
        self.proc: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    def start(self, config: str | None = None) -> Node:
        """Start it and wait until it answers. At its first start a port that another
        process took meanwhile (free_port only found it free) is swapped for a new one;
        a restart keeps its port, which others know."""
        first = self.proc is None and not (self.folder / "server.log").exists()
        for _ in range(5):
            self._spawn(config)
            if self._came_up():
                return self
            assert first, f"port {self.port} taken by another process at a restart:\n{self.log_tail()}"
            self.port = free_port()
        raise AssertionError(f"no free port found for {self.folder}")

    def _spawn(self, config: str | None) -> None:
        log = (self.folder / "server.log").open("ab")
        argv = [self.binary]
        if config is not None:
            path = self.folder / "node.conf"
            if not path.exists():  # a Sentinel rewrites its file: keep what it learnt
                path.write_text(config)
            argv.append(str(path))
        if self.tls is None:
            argv += ["--port", str(self.port)]
        else:
            cert, key = (str(p) for p in self.tls)
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert,
                     "--tls-key-file", key, "--tls-ca-cert-file", cert, "--tls-auth-clients", "no",
                     "--tls-replication", "yes"]  # fmt: skip
        argv += ["--bind", "127.0.0.1", "--dir", str(self.folder), *self.args]
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _came_up(self) -> bool:
        """True once this process answers on its port; False when it exited because the
        port was taken (what answered there, if anything, was another process)."""
        client = self.client(timeout=0.5)
        try:
            return bool(wait_for(lambda: self._answers(client), timeout=20) == "up")
        finally:
            client.close()

    def _answers(self, client: redis.Redis) -> str | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            assert "Address already in use" in self.log_tail(), self.log_tail()
            return "port taken"
        try:
            pid = client.info("server").get("process_id")
        except redis.RedisError:
            return None
        return "up" if pid == self.proc.pid else None  # else another process's, until ours exits

    def client(self, timeout: float = 5.0) -> redis.Redis:
        tls: dict[str, object] = {} if self.tls is None else {"ssl": True, "ssl_ca_certs": str(self.tls[0])}
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            **tls,
        )

    def kill(self) -> None:
        """kill -9: the machine is gone, with whatever the replicas had not got yet."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self) -> str:
        path = self.folder / "server.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""


# Replicas sign in to their primary as the user "repl", which every data node has, so that
# a test can cut one replica off (hold_replication) while both stay up.
REPL_USER, REPL_PASSWORD = "repl", "repl-secret"
DATA_ARGS = [
    "--save", "", "--appendonly", "no", "--repl-diskless-sync", "yes",
    "--repl-diskless-sync-delay", "0", "--loglevel", "notice",
    "--user", REPL_USER, "on", f">{REPL_PASSWORD}", "+psync", "+replconf", "+ping",
    "--masteruser", REPL_USER, "--masterauth", REPL_PASSWORD,
]  # fmt: skip


def _without_option_values(args: list[str], options: dict[str, int]) -> list[str]:
    """``args`` less each of ``options`` and the number of values it takes."""
    out: list[str] = []
    skip = 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg in options:
            skip = options[arg]
        else:
            out.append(arg)
    return out


class SentinelSet:
    """A primary, ``replicas`` replicas and three Sentinels (quorum 2) watching them."""

    def __init__(
        self,
        replicas: int = 1,
        down_after_ms: int = 1000,
        password: str | None = None,
        sentinel_password: str | None = None,
        tls: tuple[Path, Path] | None = None,
        failover_timeout_ms: int = 5000,
    ) -> None:
        """``password``: the data nodes' (requirepass); ``sentinel_password``: the Sentinels'."""
        self.binary = find_redis_server()
        self._dir = tempfile.mkdtemp(prefix="rollstream-sentinel-")
        root = Path(self._dir)
        args = [*DATA_ARGS, "--requirepass", password] if password else DATA_ARGS
        self.data_args = args
        self.data = [
            Node(self.binary, root / f"data{i}", args, password=password) for i in range(1 + replicas)
        ]
        sentinel_args = ["--sentinel"]
        if sentinel_password:
            sentinel_args += ["--requirepass", sentinel_password]
        self.sentinels = [
            Node(self.binary, root / f"sentinel{i}", sentinel_args, password=sentinel_password)
            for i in range(3)
        ]
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        for node in [*self.data, *self.sentinels]:
            node.tls = tls
        self.password = password
        self.sentinel_password = sentinel_password

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        auth = f":{self.password}@" if self.password else ""
        query = f"?sentinel_password={self.sentinel_password}" if self.sentinel_password else ""
        scheme = "redis+sentinel"
        tls = self.data[0].tls
        if tls is not None:
            scheme = "rediss+sentinel"
            query += ("&" if query else "?") + f"ssl_ca_certs={tls[0]}"
        return f"{scheme}://{auth}{hosts}/{SERVICE}/0{query}"

    def start(self) -> SentinelSet:
        try:
            return self._start()
        except BaseException:
            self.stop()  # what did start is stopped by its pid
            raise

    def _start(self) -> SentinelSet:
        primary = self.data[0].start()
        for replica in self.data[1:]:
            replica.args = [*self.data_args, "--replicaof", "127.0.0.1", str(primary.port)]
            replica.start()
        config = (
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        if self.password:
            config += f"sentinel auth-pass {SERVICE} {self.password}\n"
        if self.sentinel_password:
            config += f"sentinel sentinel-pass {self.sentinel_password}\n"
        for sentinel in self.sentinels:
            sentinel.start(config)
        wait_for(lambda: self.replicas_in_sync(len(self.data) - 1), timeout=30)
        # every Sentinel knows the others and the replicas before anything is failed over
        # (Sentinels learn the replicas from the primary's INFO every 10 s and each other from
        # hello messages every 2 s: on a loaded machine that took over 30 s once)
        try:
            wait_for(lambda: all(self._sees_all(s) for s in self.sentinels), timeout=90)
        except AssertionError as exc:
            views = self._views()
            raise AssertionError(f"the Sentinels do not see each other and the replicas: {views}") from exc
        return self

    def _views(self) -> list[str]:
        """What each Sentinel knows of the set: for the message of a start that failed."""
        views = []
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                info = client.execute_command("SENTINEL", "MASTER", SERVICE)
                fields = dict(zip(info[::2], info[1::2], strict=False)) if isinstance(info, list) else info
                keys = (b"port", b"flags", b"num-other-sentinels", b"num-slaves")
                views.append(f"{sentinel.port}: " + " ".join(f"{k.decode()}={fields.get(k)!r}" for k in keys))
            except redis.RedisError as exc:
                views.append(f"{sentinel.port}: {exc}")
            finally:
                client.close()
        return views

    def views(self) -> str:
        """What every Sentinel names and every data node says it is: for a failure's message."""
        lines = self._views()
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                named = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                lines.append(f"{sentinel.port} names {named}")
            except redis.RedisError as exc:
                lines.append(f"{sentinel.port}: {exc}")
            finally:
                client.close()
        for node in self.data:
            client = node.client()
            try:
                info = client.info("replication")
                keys = client.dbsize()
                lines.append(
                    f"data {node.port}: {info.get('role')} of {info.get('master_port')}, {keys} keys"
                )
            except redis.RedisError as exc:
                lines.append(f"data {node.port}: {exc}")
            finally:
                client.close()
        return "\n".join(lines)

    def _sees_all(self, sentinel: Node) -> bool:
        client = sentinel.client()
        try:
            info = client.execute_command("SENTINEL", "MASTER", SERVICE)
            fields = dict(zip(info[::2], info[1::2], strict=False)) if isinstance(info, list) else info
            return (
                int(fields[b"num-other-sentinels"]) >= 2 and int(fields[b"num-slaves"]) >= len(self.data) - 1
            )
        except redis.RedisError:
            return False
        finally:
            client.close()

    def primary_port(self) -> int | None:
        """The primary's port as a majority of the Sentinels name it."""
        seen: dict[int, int] = {}
        for sentinel in self.sentinels:
            if sentinel.proc is None:
                continue
            client = sentinel.client()
            try:
                addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                port = int(addr[1])
                seen[port] = seen.get(port, 0) + 1
            except (redis.RedisError, TypeError):
                pass
            finally:
                client.close()
        best = max(seen.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= 2 else None

    def node(self, port: int) -> Node:
        return next(n for n in self.data if n.port == port)

    def primary(self) -> Node:
        port = self.primary_port()
        assert port is not None, "the Sentinels do not agree on a primary"
        return self.node(port)

    def replicas_in_sync(self, count: int) -> bool:
        """Whether ``count`` replicas are connected to the primary and streaming."""
        try:
            client = self.primary().client()
        except AssertionError:
            return False
        try:
            info = client.info("replication")
            return int(info.get("connected_slaves", 0)) >= count and all(
                info[f"slave{i}"]["state"] == "online" for i in range(int(info["connected_slaves"]))
            )
        except redis.RedisError:
            return False
        finally:
            client.close()

    def fail_over_by_kill(self, timeout: float = 30.0) -> tuple[Node, Node]:
        """kill -9 the primary; return (the dead one, the promoted one) once the Sentinels
        agree on the new primary and it answers as one."""
        old = self.primary()
        old.kill()

        def promoted() -> int | None:
            port = self.primary_port()
            if port is None or port == old.port:
                return None
            client = self.node(port).client()
            try:
                return port if client.info("replication")["role"] == "master" else None
            except redis.RedisError:
                return None
            finally:
                client.close()

        new_port = wait_for(promoted, timeout=timeout)
        return old, self.node(new_port)

    def bring_back(self, node: Node) -> Node:
        """Restart a data node that was failed over, empty (nothing persisted here), as
        deploy/redis-ha.sh brings a node back: a replica of the primary the Sentinels name,
        unpromotable (replica-priority 0) until its first sync has ended (this harness
        leaves it so). Restarted with its old arguments instead, it would be an empty
        primary until the Sentinels turn it into a replica; in CI, processes of the run
        were seen reading such an empty node (open: see the failover process test)."""
        primary = self.primary_port()
        assert primary is not None and primary != node.port, "no new primary to follow"
        base = _without_option_values(node.args, {"--replica-priority": 1, "--replicaof": 2})
        node.args = [*base, "--replicaof", "127.0.0.1", str(primary), "--replica-priority", "0"]
        return node.start()

    def hold_replication(self) -> None:
        """Cut the replicas off the primary while all stay up (a slow or partitioned link):
        the primary refuses their user and drops their links, so they fall behind it."""
        client = self.primary().client()
        try:
            client.execute_command("ACL", "SETUSER", REPL_USER, "off")
            client.execute_command("CLIENT", "KILL", "USER", REPL_USER)
        finally:
            client.close()

    def stop(self) -> None:
        for node in [*self.sentinels, *self.data]:
            node.stop()
        if not os.environ.get("KEEP_HA_LOGS"):
            shutil.rmtree(self._dir, ignore_errors=True)


class Cluster:
    """A Redis Cluster of ``masters`` masters, each with ``replicas`` replicas, on free ports.

    With replicas, :meth:`fail_over_by_kill` kill -9s the master of a key's slot and waits
    for the cluster to promote its replica (cluster-node-timeout 2 s)."""

    def __init__(self, masters: int = 3, replicas: int = 0) -> None:
        self.binary = find_redis_server()
        self._dir = tempfile.mkdtemp(prefix="rollstream-cluster-")
        self.replicas = replicas
        args = [
            "--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
            # a replica is promoted however long ago it last heard from its master (a few
            # nodes on a loaded machine: the default factor can leave a slot without one)
            "--cluster-replica-validity-factor", "0",
            "--save", "", "--appendonly", "no",
            "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        self.nodes = [
            Node(self.binary, Path(self._dir) / f"node{i}", args) for i in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def start(self) -> Cluster:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Cluster:
        for node in self.nodes:
            node.args = [*node.args, "--cluster-config-file", str(node.folder / "nodes.conf"),
                         "--cluster-port", str(free_port())]  # fmt: skip
            node.start()
        cli = shutil.which("redis-cli", path=str(Path(self.binary).parent)) or shutil.which("redis-cli")
        assert cli, "redis-cli is needed to create a cluster"
        # redis-cli makes the first len(nodes) / (1 + replicas) nodes the masters
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        # every node knows every master's replicas (gossip) before anything is failed over
        wait_for(lambda: self._ok() and self._replicas_online() and self._slots_replicated(), timeout=60)
        return self

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    @staticmethod
    def _all(nodes: list[Node], check: Callable[[redis.Redis], bool]) -> bool:
        """Whether ``check`` holds on every node (False for one that does not answer)."""
        for node in nodes:
            client = node.client()
            try:
                if not check(client):
                    return False
            except redis.RedisError:
                return False
            finally:
                client.close()
        return True

    def _ok(self) -> bool:
        """Every live node says cluster_state:ok."""
        return self._all(self.live(), lambda c: b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO"))

    def _replicas_online(self) -> bool:
        """Every master has its replicas connected and streaming."""

        def online(client: redis.Redis) -> bool:
            info = client.info("replication")
            count = int(info.get("connected_slaves", 0))
            return count >= self.replicas and all(
                info[f"slave{i}"]["state"] == "online" for i in range(count)
            )

        return self._all([n for n in self.live() if self.role(n) == "master"], online)

    def _slots_replicated(self) -> bool:
        """Every live node's CLUSTER SLOTS names ``replicas`` replicas for every range."""
        return self._all(
            self.live(),
            lambda c: all(len(entry) - 3 >= self.replicas for entry in c.execute_command("CLUSTER", "SLOTS")),
        )

    def role(self, node: Node) -> str | None:
        """INFO's role of ``node``: master or slave (None when it does not answer)."""
        client = node.client()
        try:
            return str(client.info("replication")["role"])
        except redis.RedisError:
            return None
        finally:
            client.close()

    def in_sync(self, master: Node) -> bool:
        """Whether ``master``'s replicas are connected and hold everything it wrote."""
        client = master.client()
        try:
            info = client.info("replication")
            count = int(info.get("connected_slaves", 0))
            return count >= self.replicas and all(
                info[f"slave{i}"]["state"] == "online"
                and info[f"slave{i}"]["offset"] == info["master_repl_offset"]
                for i in range(count)
            )
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _port_node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def slot_nodes(self, key: str, asked: Node | None = None) -> tuple[Node, list[Node]]:
        """The master of ``key``'s slot and its replicas, as ``asked`` (a live node by
        default) sees them in CLUSTER SLOTS."""
        client = (asked or self.live()[0]).client()
        try:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *replicas in client.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return self._port_node(int(master[1])), [self._port_node(int(r[1])) for r in replicas]
        finally:
            client.close()
        raise AssertionError(f"no master serves {key}")

    def node_of(self, key: str) -> Node:
        """The master that serves ``key``'s slot."""
        return self.slot_nodes(key)[0]

    def fail_over_by_kill(self, key: str, timeout: float = 60.0) -> tuple[Node, Node]:
        """kill -9 the master of ``key``'s slot; return (the dead one, the promoted replica)
        once every live node names the replica the slot's master, it answers as a master
        and the cluster is ok."""
        old, replicas = self.slot_nodes(key)
        assert replicas, f"the master of {key}'s slot has no replica to promote"
        old.kill()

        def promoted() -> Node | None:
            try:
                named = {self.slot_nodes(key, asked)[0].port for asked in self.live()}
            except (redis.RedisError, StopIteration):
                return None
            if len(named) != 1 or (port := named.pop()) == old.port:
                return None
            new = self._port_node(port)
            return new if self.role(new) == "master" and self._ok() else None

        new = wait_for(promoted, timeout=timeout, interval=0.1)
        return old, new

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
