"""The cluster that chaos/hosts_run.py runs on emulated hosts (chaos/hosts.py): which
process runs on which host, with deploy/'s commands and environment, supervised as the
systemd units would (chaos/supervisor.py's supervisor, over hosts), the scenario's fault,
and Redis as the Sentinels' majority names it. The layout and the scenarios are told in
chaos/hosts_run.py."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from chaos.constants import CLAIM_IDLE_MS, ROOT, TASK
from chaos.hosts import Hosts
from chaos.report import _group_id
from chaos.supervisor import Chaos, Child
from rollstream.shared.embedded import find_redis_server
from rollstream.shared.events import STOP, RunControl
from rollstream.shared.keys import POOLS, PRODUCERS

HOSTS = ["r1", "r2", "r3", "head", "gpu", "prod", "train"]
REDIS_HOSTS = ["r1", "r2", "r3"]
SERVICE = "rollstream-redis"
REDIS_PORT, SENTINEL_PORT, RAY_PORT = 6379, 26379, 6380
DOWN_AFTER_MS = 5000  # redis-ha.sh's default
FAULT_STEP = 5
HOST_DOWN_S = 10.0
PARTITION_S = 20.0
SCENARIOS = (
    "crash_producer_host", "partition_primary", "crash_trainer_host", "crash_engine_host",
    "partition_producer_host",
)  # fmt: skip
CRASHES = {"crash_producer_host": "prod", "crash_trainer_host": "train", "crash_engine_host": "gpu"}
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


@dataclass
class HostChild(Child):
    """A supervised process on an emulated host: while its host is down there is nothing
    to restart (``alive`` says so), and it is restarted once the host is back."""

    host: str = ""
    hosts: Hosts | None = None

    @property
    def alive(self) -> bool:
        assert self.hosts is not None
        if not self.hosts.hosts[self.host].up:
            return True  # the machine is down: its process manager with it
        return self.proc is not None and self.proc.poll() is None

    def start(self, env: dict[str, str]) -> None:
        assert self.hosts is not None
        with self.log.open("ab") as out:
            self.proc = self.hosts.popen(
                self.host, self.argv(), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )
        self.exited_at = None


@dataclass
class HostsChaos(Chaos):
    """The chaos supervisor (chaos/supervisor.py) over emulated hosts."""

    scenario: str = SCENARIOS[0]
    safe: bool = True
    step_time: float = 0.5
    hosts: Hosts = field(default_factory=lambda: Hosts(HOSTS))
    password: str = field(default_factory=lambda: secrets.token_hex(8))
    ray_token: str = field(default_factory=lambda: secrets.token_hex(16))
    fault_at: float | None = None
    fault_step: int | None = None
    recovered_at: float | None = None
    healed_at: float | None = None
    primary_before: str | None = None
    primary_after: str | None = None
    held_at_crash: list[str] = field(default_factory=list)
    crashed_host: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._timers: list[threading.Timer] = []
        self.ray_dir = Path(tempfile.mkdtemp(prefix="rsray-"))
        self._primary: tuple[str, int] | None = None
        self._direct: redis.Redis | None = None

    # --- the layout ------------------------------------------------------------------

    def sentinels(self) -> list[str]:
        return [f"{self.hosts.address(h)}:{SENTINEL_PORT}" for h in REDIS_HOSTS]

    def _env(self) -> dict[str, str]:
        env = super()._env()
        # no judge worker and no archiver here: fewer processes on 2 cores
        env.update(ROLLSTREAM_PRODUCER__JUDGE_ON_QUEUE="false", ROLLSTREAM_ARCHIVE__KEEP="0")
        env.pop("ROLLSTREAM_ARCHIVE__DIR", None)
        env.pop("ROLLSTREAM_ARCHIVE__FLUSH_S", None)
        env["ROLLSTREAM_ENGINES__RESOURCES"] = '{"rollout": 1}'  # rollstream.env
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.ray_token,
            # a node that dies is declared dead within seconds, not Ray's default half minute
            RAY_health_check_period_ms="1000",
            RAY_health_check_failure_threshold="3",
            RAY_health_check_timeout_ms="1000",
        )
        env["ROLLSTREAM_METRICS__PORT"] = "0"
        if not self.safe:  # with the Sentinels' URL the default is 1
            env["ROLLSTREAM_REDIS__WAIT_REPLICAS"] = "0"
        return env

    def start_hosts(self) -> None:
        self.hosts.start()
        self.url = (
            f"redis+sentinel://:{self.password}@{','.join(self.sentinels())}/{SERVICE}/0"
            f"?sentinel_password={self.password}"
        )
        self.env = self._env()
        self.env["ROLLSTREAM_REDIS__URL"] = self.url
        self.env["ROLLSTREAM_RAY__ADDRESS"] = f"{self.hosts.address('head')}:{RAY_PORT}"

    def _redis_env(self, host: str) -> dict[str, str]:
        folder = self.out / host
        folder.mkdir(exist_ok=True)
        conf = folder / "redis.conf"
        if not conf.exists():  # each node its own copy (a Sentinel rewrites it)
            conf.write_text((ROOT / "deploy" / "redis.conf").read_text())
        env = dict(self.env)
        env.update(
            SELF=self.hosts.address(host),
            FIRST=f"{self.hosts.address('r1')}:{REDIS_PORT}",
            SENTINELS=" ".join(self.sentinels()),
            SERVICE=SERVICE,
            REDIS_PASSWORD=self.password,
            DATA=str(folder),
            CONF=str(conf),
            BIND=self.hosts.address(host),
            DOWN_AFTER_MS=str(DOWN_AFTER_MS),
            PATH=f"{Path(find_redis_server()).parent}{os.pathsep}{self.env['PATH']}",
        )
        if not self.safe:  # redis-ha.sh's default is 1
            env["MIN_REPLICAS_TO_WRITE"] = "0"
        return env

    def children_spec(self) -> list[Child]:
        rs = [sys.executable, "-m", "rollstream.cli.main"]
        prompts = str(self.prompt_file())
        head = self.hosts.address("head")
        script = str(ROOT / "deploy" / "redis-ha.sh")

        def ray_node(host: str, *args: str) -> Callable[[], list[str]]:
            # each host its own Ray folder (one file system here), short: Ray's sockets are in it
            temp = self.ray_dir / host
            return lambda: [
                *RAY,
                "start",
                "--block",
                *args,
                "--node-ip-address",
                self.hosts.address(host),
                "--temp-dir",
                str(temp),
                "--object-store-memory",
                str(80 * 1024 * 1024),
                "--disable-usage-stats",
            ]

        specs: list[tuple[str, str, Callable[[], list[str]]]] = []
        for host in REDIS_HOSTS:
            specs.append((f"redis-{host}", host, lambda: ["sh", script, "data"]))
            specs.append((f"sentinel-{host}", host, lambda: ["sh", script, "sentinel"]))
        specs += [
            # rollstream-ray-head.service; rollstream-ray-worker.service on the engines' host
            (
                "ray-head",
                "head",
                ray_node("head", "--head", f"--port={RAY_PORT}", "--num-cpus=0", "--include-dashboard=false"),
            ),
            (
                "ray-gpu",
                "gpu",
                ray_node(
                    "gpu", f"--address={head}:{RAY_PORT}", "--num-cpus=1", "--resources", '{"rollout": 4}'
                ),
            ),
            ("ray-prod", "prod", ray_node("prod", f"--address={head}:{RAY_PORT}", "--num-cpus=0")),
            ("engines", "head", lambda: [*rs, "engines", "--foreground"]),
            (
                "feeder",
                "head",
                lambda: [
                    *rs,
                    "feed",
                    prompts,
                    "--task",
                    TASK,
                    "--epochs",
                    "1",
                    "--keep-ahead",
                    "48",
                    "--until-stopped",
                ],
            ),
            ("producer-a", "prod", lambda: [*rs, "produce"]),
            ("producer-b", "head", lambda: [*rs, "produce"]),
            ("trainer", "train", self._trainer_argv),
        ]
        children: list[Child] = []
        for name, host, argv in specs:
            child = HostChild(name, argv, self.out / f"{name}.log", host=host, hosts=self.hosts)
            children.append(child)
        return children

    def _trainer_argv(self) -> list[str]:
        left = max(1, self.steps - self._train_step())
        return [
            sys.executable,
            "-m",
            "rollstream.cli.main",
            "train",
            "--steps",
            str(left),
            "--step-time",
            str(self.step_time),
            "--record",
            str(self.record),
            "--state-file",
            str(self.out / "trainer.json"),
        ]

    def _env_for(self, child: Child) -> dict[str, str]:
        assert isinstance(child, HostChild)
        return self._redis_env(child.host) if child.name.startswith(("redis-", "sentinel-")) else self.env

    # --- Redis, as the Sentinels' majority names it ----------------------------------

    def primary(self) -> tuple[str, int] | None:
        """The primary that at least two of the three Sentinels name (from the machine,
        which reaches every host), or None."""
        votes: dict[tuple[str, int], int] = {}
        for sentinel in self.sentinels():
            host, port = sentinel.rsplit(":", 1)
            client = redis.Redis(
                host=host, port=int(port), password=self.password, socket_timeout=1, socket_connect_timeout=1
            )
            try:
                answer: Any = client.sentinel_get_master_addr_by_name(SERVICE)
                if answer:
                    key = (answer[0].decode(), int(answer[1]))
                    votes[key] = votes.get(key, 0) + 1
            except redis.RedisError:
                pass
            finally:
                client.close()
        best = max(votes.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= 2 else None

    def client(self) -> redis.Redis:
        """A client of the primary the Sentinels' majority names (followed at each call)."""
        primary = self.primary() or self._primary
        if primary is None:
            raise redis.ConnectionError("no primary named by a majority of the Sentinels")
        if primary != self._primary or self._direct is None:
            if self._direct is not None:
                self._direct.close()
            self._direct = redis.Redis(
                host=primary[0],
                port=primary[1],
                password=self.password,
                socket_timeout=5,
                socket_connect_timeout=2,
            )
            self._primary = primary
        return self._direct

    def host_of(self, address: str) -> str:
        return next(h for h in self.hosts if self.hosts.address(h) == address)

    # --- running ---------------------------------------------------------------------

    def supervise(self, deadline_s: float) -> bool:
        """Every process started (Redis first), restarted 0.5 s after it exits; the
        scenario's fault once FAULT_STEP steps are trained; True when the trainer has
        trained every step on the majority's primary, with no fault still going on."""
        for child in self.children_spec():
            self.children[child.name] = child
        for name in [n for n in self.children if n.startswith(("redis-", "sentinel-"))]:
            self.children[name].start(self._env_for(self.children[name]))
        deadline = time.monotonic() + 120
        while self.primary() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        for child in self.children.values():
            if child.proc is None:
                child.start(self._env_for(child))
        self.note("started", f"{len(self.children)} processes on {len(HOSTS)} hosts")
        next_sample = time.monotonic()
        while time.monotonic() - self.started < deadline_s:
            now = time.monotonic()
            with self.lock:
                for child in self.children.values():
                    if child.alive:
                        continue
                    if child.exited_at is None:
                        child.exited_at = now
                        if child.proc is not None:
                            child.exits.append(child.proc.returncode)
                            self.note("exit", f"{child.name} ({child.proc.returncode})")
                    if not self._restarts(child):
                        continue
                    elif now - child.exited_at >= 0.5:  # RestartSec
                        child.restarts += 1
                        child.start(self._env_for(child))
                        self.note("restart", child.name)
            if now >= next_sample:
                self._sample()
                next_sample = now + 1.0
            step = self._train_step()
            if self.fault_at is None and step >= FAULT_STEP:
                self.fault_step, self.fault_at = step, now
                self.inject(self.scenario)
            elif self.fault_at is not None and self.recovered_at is None and step > (self.fault_step or 0):
                # a step on the majority's primary; not one on a primary the majority has
                # not yet failed over (cut off, its step may be lost)
                cut_off = self.primary_before is not None and self.healed_at is None
                if not (cut_off and self._primary and self.host_of(self._primary[0]) == self.primary_before):
                    self.recovered_at = now
                    self.note("recovered", f"train step {step} on the majority's primary")
            faulted = self._fault_over()
            if step >= self.steps and faulted:
                self.note("done", f"train step {self.steps}")
                return True
            trainer = self.children["trainer"]
            if faulted and not trainer.alive and trainer.exits and not self._restarts(trainer):
                # the trainer stopped for good: exit 0 (it trained its steps, on a primary
                # that may not have kept them), 5 (its record is ahead of Redis) or 2
                self.note(
                    "stopped",
                    f"trainer (exit {trainer.exits[-1]}) at train step {step}: the run needs a manual step",
                )
                return False
            time.sleep(0.2)
        return False

    def _fault_over(self) -> bool:
        """The partition healed; the crashed host back, with its processes running again."""
        if self.healed_at is None:
            return False
        return all(
            c.proc is not None and c.proc.poll() is None
            for c in self.children.values()
            if isinstance(c, HostChild) and c.host == self.crashed_host
        )

    @staticmethod
    def _restarts(child: Child) -> bool:
        """deploy/systemd's Restart=on-failure and RestartPreventExitStatus=2 5 (Redis's
        own units: Restart=always)."""
        if child.name.startswith(("redis-", "sentinel-")) or not child.exits:
            return True
        return child.exits[-1] not in (0, 2, 5)

    def inject(self, fault: str) -> None:
        if fault in CRASHES:
            host = CRASHES[fault]
            if host == "prod":
                self.held_at_crash = self._held_by("-prod-")
            self.crashed_host = host
            on_it = [c.name for c in self.children.values() if isinstance(c, HostChild) and c.host == host]
            self.hosts.crash(host)
            self.note("host crash", f"{host} ({', '.join(on_it)})")
            self._later(HOST_DOWN_S, lambda: self._boot(host))
        elif fault == "partition_producer_host":
            # producer a loses Redis (not Ray) for 5 x claim_idle_ms: its claims are taken
            # back by producer b meanwhile, and what it settles after the heal is fenced off
            self.held_at_crash = self._held_by("-prod-")
            self.hosts.isolate(["prod"], REDIS_HOSTS)
            self.note("partition", "prod (producer a) from the Redis hosts; it still reaches Ray")
            self._later(5 * CLAIM_IDLE_MS / 1000, self._heal)
        elif fault == "partition_primary":
            primary = self.primary()
            assert primary is not None
            host = self.host_of(primary[0])
            self.primary_before = host
            others = [h for h in REDIS_HOSTS if h != host]
            self.hosts.isolate([host], others)
            self.note("partition", f"{host} (the primary) from {', '.join(others)}; clients still reach it")
            self._later(PARTITION_S, self._heal)
        else:
            raise ValueError(f"no such scenario: {fault}")

    def _held_by(self, marker: str) -> list[str]:
        """The groups (task:uid@epoch) that producers whose name holds ``marker`` (their
        host's name) have claimed and not settled."""
        held: list[str] = []
        client: Any = self.client()
        for kind in POOLS:
            stream = self.keys.stream(kind, TASK)
            with contextlib.suppress(redis.ResponseError):  # no such stream or group yet
                for entry in client.xpending_range(stream, PRODUCERS, "-", "+", 10_000):
                    if marker in entry["consumer"].decode():
                        for _, fields in client.xrange(stream, entry["message_id"], entry["message_id"]):
                            if gid := _group_id(fields):
                                held.append(gid)
        return held

    def _later(self, seconds: float, what: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, what)
        self._timers.append(timer)
        timer.start()

    def _boot(self, host: str) -> None:
        with self.lock:
            self.hosts.boot(host)
            self.healed_at = time.monotonic()
            self.note("host up", host)

    def _heal(self) -> None:
        self.hosts.heal()
        self.healed_at = time.monotonic()
        self.note("heal", "every host reaches every other")

    def _train_step(self) -> int:
        try:
            return RunControl(self.client(), self.keys).train_step()
        except redis.RedisError:
            return 0

    # --- the end ---------------------------------------------------------------------

    def settle(self, timeout_s: float = 60.0) -> bool:
        """After the run: the Sentinels agree on one primary and every data node follows it
        (the old primary a replica again), so that the account reads what survived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            primary = self.primary()
            if primary is not None:
                roles = []
                for host in REDIS_HOSTS:
                    node = redis.Redis(
                        host=self.hosts.address(host),
                        port=REDIS_PORT,
                        password=self.password,
                        socket_timeout=2,
                        socket_connect_timeout=2,
                    )
                    try:
                        roles.append(node.info("replication").get("role"))
                    except redis.RedisError:
                        roles.append(None)
                    finally:
                        node.close()
                if roles.count("master") == 1:
                    self.primary_after = self.host_of(primary[0])
                    return True
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        """The run's stop event; the rollstream processes get 30 s to stop, the rest is
        killed with its host at close."""
        with contextlib.suppress(redis.RedisError):
            RunControl(self.client(), self.keys).publish(STOP)
        deadline = time.monotonic() + 30
        for child in self.children.values():
            if child.proc is None or child.name.startswith(("redis-", "sentinel-", "ray-")):
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))

    def shutdown_redis(self) -> None:
        for timer in self._timers:
            timer.cancel()
            if timer is not threading.current_thread():
                timer.join()
        self.hosts.close()
        shutil.rmtree(self.ray_dir, ignore_errors=True)
