"""Real replicated Redis set-ups for the high-availability tests, on free ports, stopped
by their pids: a primary, replicas and three Sentinels; a 3-master Redis Cluster."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
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
        client = self.client(timeout=0.5)
        try:
            wait_for(lambda: self._answers(client), timeout=20)
        finally:
            client.close()
        return self

    def _answers(self, client: redis.Redis) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log_tail()
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

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


class SentinelSet:
    """A primary, ``replicas`` replicas and three Sentinels (quorum 2) watching them."""

    def __init__(
        self,
        replicas: int = 1,
        down_after_ms: int = 1000,
        password: str | None = None,
        sentinel_password: str | None = None,
        tls: tuple[Path, Path] | None = None,
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
            f"sentinel failover-timeout {SERVICE} 5000\n"
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
        wait_for(lambda: all(self._sees_all(s) for s in self.sentinels), timeout=30)
        return self

    def _sees_all(self, sentinel: Node) -> bool:
        client = sentinel.client()
        try:
            info = client.execute_command("SENTINEL", "MASTER", SERVICE)
            fields = dict(zip(info[::2], info[1::2], strict=False)) if isinstance(info, list) else info
            return (
                int(fields[b"num-other-sentinels"]) == 2 and int(fields[b"num-slaves"]) >= len(self.data) - 1
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
        shutil.rmtree(self._dir, ignore_errors=True)


class Cluster:
    """A Redis Cluster of ``masters`` masters (no replicas) on free ports."""

    def __init__(self, masters: int = 3) -> None:
        self.binary = find_redis_server()
        self._dir = tempfile.mkdtemp(prefix="rollstream-cluster-")
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "2000",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.nodes = [Node(self.binary, Path(self._dir) / f"node{i}", args) for i in range(masters)]

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
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        wait_for(self._ok, timeout=30)
        return self

    def _ok(self) -> bool:
        for node in self.nodes:
            client = node.client()
            try:
                if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
            except redis.RedisError:
                return False
            finally:
                client.close()
        return True

    def node_of(self, key: str) -> Node:
        """The master that serves ``key``'s slot."""
        client = self.nodes[0].client()
        try:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return next(n for n in self.nodes if n.port == int(master[1]))
        finally:
            client.close()
        raise AssertionError(f"no master serves {key}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
