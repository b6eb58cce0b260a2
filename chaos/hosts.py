"""Emulated hosts on one machine: each host a network namespace with an address of its own
on one bridge, and a PID (and UTS, mount) namespace of its own, so that a run can be laid
out as on a cluster and its hosts crashed and partitioned.

    with Hosts(["redis1", "redis2", "trainer"]).start() as hosts:
        proc = hosts.popen("redis1", ["redis-server", "--bind", hosts.address("redis1")])
        hosts.partition("redis1")         # its link down: no one reaches it, it reaches no one
        hosts.heal()
        hosts.isolate(["redis1"], ["redis2"])  # these two pairs only, the rest still connected
        hosts.crash("trainer")            # every process of the host at once (SIGKILL)
        hosts.boot("trainer")             # the host again, empty

The layout (needs root and ``ip`` from iproute2, ``unshare`` and ``nsenter`` from util-linux):

- a *switch* namespace ``<prefix>-sw`` holds the bridge. Its own namespace, not the
  machine's: a Docker engine sets the machine's iptables FORWARD policy to DROP with bridge
  netfilter on, which silently drops bridged traffic between namespaces; in a namespace of
  its own the bridge's netfilter is off (``bridge-nf-call-*`` are per namespace) and no
  iptables rule applies. ``start`` turns them off there and checks that every host reaches
  every other before it returns.
- each host is a namespace ``<prefix>-<host>`` whose ``eth0`` (a veth into the bridge) has
  the address ``<subnet>.<i>``; no default route, so nothing leaves the subnet.
- the machine itself reaches the hosts through a veth ``<prefix>gw`` with the subnet's
  ``.254``: the subnet's route is on that link (checked: never the default route). The
  subnet is ``10.231.<k>.0/24`` for the first ``k`` that overlaps no address or route of
  the machine and whose prefix ``rsh<k>`` no live harness holds.
- each host runs one init process, PID 1 of its own PID namespace
  (``ip netns exec NS unshare --pid --fork --mount-proc --uts``): it reaps orphans and
  answers TCP on port 9 of the host's address (the reachability check). Every command is
  started inside that host's namespaces (``nsenter`` into the init), so a Ray driver on a
  host sees only that host's processes. A crash kills the init: the kernel kills every
  process of its PID namespace at once.

Faults: ``partition`` (the host's link down at the bridge), ``isolate`` (blackhole routes
between two sets of hosts, both ways: a partition between some hosts only), ``heal``;
``crash`` / ``boot``.

Clean-up removes only what a harness made, by its prefix: its namespaces (and the
processes in them, found by ``ip netns pids`` of those namespaces, never by name) and its
gateway link. A harness holds a lock file for its prefix while it lives; one that crashed
leaves the lock free, and the next harness to start removes what that prefix left.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

BASE_PREFIX = "rsh"
LOCK_DIR = Path(tempfile.gettempdir()) / "rollstream-hosts"
CHECK_PORT = 9  # the init's TCP port: the reachability check
MAX_INSTANCES = 64
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789")

# PID 1 of a host: reaps whatever is reparented to it, and answers on CHECK_PORT of the
# host's address, so that a connect tells whether the host is reachable.
INIT = r"""
import os, socket, sys
socket.sethostname(sys.argv[2])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[3])))
srv.listen(64)
srv.settimeout(0.5)
print("up", flush=True)
while True:
    try:
        conn, _ = srv.accept()
        conn.close()
    except OSError:
        pass
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
"""

# From one host, which of the given addresses answer on CHECK_PORT: a JSON map
PROBE = r"""
import json, socket, sys
port, timeout, found = int(sys.argv[1]), float(sys.argv[2]), {}
for addr in sys.argv[3:]:
    try:
        socket.create_connection((addr, port), timeout=timeout).close()
        found[addr] = True
    except OSError:
        found[addr] = False
print(json.dumps(found))
"""


class HostsUnavailable(RuntimeError):
    """This machine cannot emulate hosts (not root, a tool missing): the reason."""


def unavailable() -> str | None:
    """Why hosts cannot be emulated here, or None when they can."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth links, a bridge)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` (iproute2 / util-linux), which is not on PATH"
    if not Path("/proc/self/ns/pid").exists():
        return "this kernel has no PID namespaces"
    return None


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def _netns_list() -> list[str]:
    out = _ip("-j", "netns", "list", check=False)
    try:
        return [entry["name"] for entry in json.loads(out or "[]")]
    except ValueError:
        return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _instance(name: str) -> str | None:
    """The prefix (``rsh<k>``) of one of this harness's namespaces or links, else None."""
    if not name.startswith(BASE_PREFIX):
        return None
    digits = ""
    for ch in name[len(BASE_PREFIX) :]:
        if not ch.isdigit():
            break
        digits += ch
    return f"{BASE_PREFIX}{digits}" if digits else None


def _remove(prefix: str) -> list[str]:
    """Everything of ``prefix``: the processes inside its namespaces (by ``ip netns
    pids`` of those namespaces), the namespaces, its links in this namespace. What it
    removed, by name."""
    removed: list[str] = []
    spaces = [ns for ns in _netns_list() if ns.startswith(f"{prefix}-")]
    for ns in spaces:
        _kill(_netns_pids(ns))
    for ns in spaces:
        deadline = time.monotonic() + 10
        while _netns_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        _ip("netns", "del", ns, check=False)
        removed.append(ns)
    for link in json.loads(_ip("-j", "link", "show", check=False) or "[]"):
        name = link.get("ifname", "")
        if _instance(name) == prefix:
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _used_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The machine's IPv4 networks: its addresses' and its routes' (not the default)."""
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for entry in json.loads(_ip("-j", "-4", "addr", "show", check=False) or "[]"):
        if _instance(entry.get("ifname", "")):
            continue
        for addr in entry.get("addr_info", []):
            nets.append(ipaddress.ip_network(f"{addr['local']}/{addr['prefixlen']}", strict=False))
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all", check=False) or "[]"):
        dst = route.get("dst", "default")
        if dst == "default" or _instance(route.get("dev", "")):
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return nets


@dataclass
class Host:
    name: str
    index: int
    netns: str
    address: str
    link: str  # its veth's end at the bridge (in the switch namespace)
    init: subprocess.Popen[bytes] | None = None
    init_pid: int | None = None  # PID 1 of its PID namespace, as the machine numbers it
    started: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return self.init is not None and self.init.poll() is None


class Hosts:
    """A set of emulated hosts; ``start()`` makes them, ``close()`` (or the end of a
    ``with`` block) removes them and everything they ran."""

    def __init__(self, names: Sequence[str], lock_dir: Path = LOCK_DIR) -> None:
        bad = [n for n in names if not n or len(n) > 10 or not set(n) <= NAME_CHARS]
        if bad or len(set(names)) != len(names) or not names or len(names) > 200:
            raise ValueError(f"host names must be unique, 1-10 characters of [a-z0-9]: {list(names)}")
        self.names = list(names)
        self.lock_dir = lock_dir
        self.prefix = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: dict[str, Host] = {}
        self._lock: IO[bytes] | None = None
        self._isolated: set[tuple[str, str]] = set()

    # --- the layout ------------------------------------------------------------------

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def gateway(self) -> str:
        """The machine's own address on the hosts' subnet."""
        assert self.subnet is not None, "not started"
        return str(self.subnet.network_address + 254)

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def start(self) -> Hosts:
        reason = unavailable()
        if reason:
            raise HostsUnavailable(reason)
        try:
            self._claim()
            self._build()
            self.check()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _claim(self) -> None:
        """A free prefix (its lock taken) and a subnet that overlaps nothing of the
        machine's; leftovers of every prefix that no live harness holds are removed."""
        remove_leftovers(self.lock_dir)
        used = _used_networks()
        for k in range(MAX_INSTANCES):
            subnet = ipaddress.IPv4Network(f"10.231.{k}.0/24")
            if any(subnet.overlaps(n) for n in used):
                continue
            lock = self._try_lock(f"{BASE_PREFIX}{k}")
            if lock is None:
                continue
            self._lock, self.prefix, self.subnet = lock, f"{BASE_PREFIX}{k}", subnet
            _remove(self.prefix)
            return
        raise HostsUnavailable("no free subnet 10.231.<k>.0/24 for emulated hosts")

    def _try_lock(self, prefix: str) -> IO[bytes] | None:
        return _try_lock(self.lock_dir, prefix)

    def _build(self) -> None:
        assert self.subnet is not None
        sw = self.switch
        _ip("netns", "add", sw)
        # the bridge's traffic passes: no bridge netfilter in its namespace (and no rules)
        for what in ("iptables", "ip6tables", "arptables"):
            path = f"/proc/sys/net/bridge/bridge-nf-call-{what}"
            subprocess.run(["ip", "netns", "exec", sw, "sh", "-c", f"[ ! -e {path} ] || echo 0 > {path}"],
                           check=True, timeout=30)  # fmt: skip
        _ip("link", "add", "br0", "type", "bridge", netns=sw)
        _ip("link", "set", "br0", "up", netns=sw)
        _ip("link", "set", "lo", "up", netns=sw)
        # the machine's link to the bridge
        gw, gwb = f"{self.prefix}gw", f"{self.prefix}gwb"
        _ip("link", "add", gw, "type", "veth", "peer", "name", gwb)
        _ip("link", "set", gwb, "netns", sw)
        _ip("link", "set", gwb, "master", "br0", "up", netns=sw)
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", gw)
        _ip("link", "set", gw, "up")
        route = json.loads(_ip("-j", "route", "get", str(self.subnet.network_address + 1)))
        if not route or route[0].get("dev") != gw:
            raise HostsUnavailable(f"the hosts' subnet {self.subnet} is not routed over {gw}: {route}")
        for i, name in enumerate(self.names, start=1):
            host = Host(name, i, f"{self.prefix}-{name}", str(self.subnet.network_address + i), f"h{i}")
            self.hosts[name] = host
            _ip("netns", "add", host.netns)
            out, peer = f"{self.prefix}h{i}", f"{self.prefix}h{i}p"
            _ip("link", "add", out, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.netns)
            _ip("link", "set", peer, "name", "eth0", netns=host.netns)
            _ip("link", "set", out, "netns", sw)
            _ip("link", "set", out, "name", host.link, netns=sw)
            _ip("link", "set", host.link, "master", "br0", "up", netns=sw)
            _ip("addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0", netns=host.netns)
            _ip("link", "set", "eth0", "up", netns=host.netns)
            _ip("link", "set", "lo", "up", netns=host.netns)
            self.boot(name)

    # --- processes -------------------------------------------------------------------

    def boot(self, host: str) -> None:
        """The host's init (a fresh PID namespace), once it answers on its address."""
        h = self.hosts[host]
        if h.up:
            return
        argv = ["ip", "netns", "exec", h.netns, "unshare", "--pid", "--fork", "--mount-proc", "--uts",
                "--kill-child", sys.executable, "-I", "-S", "-c", INIT, h.address, host,
                str(CHECK_PORT)]  # fmt: skip
        pipe, devnull = subprocess.PIPE, subprocess.DEVNULL
        h.init = subprocess.Popen(argv, stdout=pipe, stderr=subprocess.STDOUT, stdin=devnull)
        assert h.init.stdout is not None
        line = h.init.stdout.readline()
        if line.strip() != b"up":
            rest = h.init.stdout.read() if h.init.poll() is not None else b""
            raise RuntimeError(f"host {host}'s init did not start: {(line + rest).decode(errors='replace')}")
        h.init_pid = self._child_of(h.init.pid)
        h.started = []

    @staticmethod
    def _child_of(pid: int) -> int:
        """The one child of ``unshare`` (PID 1 of the new PID namespace)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                if children:
                    return int(children[0])
            time.sleep(0.01)
        raise RuntimeError(f"unshare (pid {pid}) has no child")

    def command(self, host: str, argv: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """``argv`` as run on ``host``: inside its network, PID, mount and UTS namespaces."""
        h = self.hosts[host]
        if not h.up or h.init_pid is None:
            raise RuntimeError(f"host {host} is down")
        wd = os.fspath(cwd) if cwd is not None else os.getcwd()
        return ["nsenter", "--target", str(h.init_pid), "--net", "--pid", "--mount", "--uts",
                f"--wd={wd}", "--", *argv]  # fmt: skip

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host`` (``subprocess.Popen``'s keywords: env, stdout, ...)."""
        proc = subprocess.Popen(self.command(host, argv, kwargs.pop("cwd", None)), **kwargs)
        self.hosts[host].started.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], timeout: float = 60, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to its end, its output as text."""
        command = self.command(host, argv, kwargs.pop("cwd", None))
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)

    def pids(self, host: str) -> list[int]:
        """Every process inside the host's network namespace, as the machine numbers them."""
        return _netns_pids(self.hosts[host].netns)

    # --- faults ----------------------------------------------------------------------

    def crash(self, host: str) -> None:
        """Every process of the host dies at once: its PID namespace's init is killed
        (SIGKILL), and the kernel kills every other process of that namespace with it.
        The host stays down (its address answers nothing) until ``boot``."""
        h = self.hosts[host]
        if h.init_pid is not None:
            _kill([h.init_pid])
        if h.init is not None:
            h.init.wait(timeout=30)
            if h.init.stdout is not None:
                h.init.stdout.close()
        for proc in h.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        h.init, h.init_pid = None, None

    def partition(self, *hosts: str) -> None:
        """Each host's link down at the bridge: it reaches no one, no one reaches it."""
        for host in hosts:
            _ip("link", "set", self.hosts[host].link, "down", netns=self.switch)

    def isolate(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        """No traffic between any host of ``side_a`` and any of ``side_b``, both ways
        (blackhole routes on both sides); every other pair still connected."""
        for a in side_a:
            for b in side_b:
                for src, dst in ((a, b), (b, a)):
                    if (src, dst) not in self._isolated:
                        route = f"{self.address(dst)}/32"
                        _ip("route", "add", "blackhole", route, netns=self.hosts[src].netns)
                        self._isolated.add((src, dst))

    def heal(self) -> None:
        """Every link up, every isolation lifted."""
        for h in self.hosts.values():
            _ip("link", "set", h.link, "up", netns=self.switch)
        for src, dst in sorted(self._isolated):
            route = f"{self.address(dst)}/32"
            _ip("route", "del", "blackhole", route, netns=self.hosts[src].netns, check=False)
        self._isolated.clear()

    # --- checks ----------------------------------------------------------------------

    def reaches(self, src: str | None, dst: Sequence[str], timeout: float = 1.0) -> dict[str, bool]:
        """Which hosts of ``dst`` answer from ``src`` (None: from the machine itself)."""
        addrs = [self.address(d) for d in dst]
        argv = [sys.executable, "-I", "-S", "-c", PROBE, str(CHECK_PORT), str(timeout), *addrs]
        if src is None:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
        else:
            out = self.run(src, argv, timeout=60, check=True).stdout
        found = json.loads(out)
        return {d: bool(found[self.address(d)]) for d in dst}

    def check(self) -> None:
        """Every host reaches every other, and the machine reaches each: else the bridge
        drops traffic (netfilter) or a link is wrong, and a run would measure that."""
        missing = [f"machine -> {h}" for h, ok in self.reaches(None, self.names).items() if not ok]
        for src in self.names:
            others = [h for h in self.names if h != src]
            if others:
                missing += [f"{src} -> {h}" for h, ok in self.reaches(src, others).items() if not ok]
        if missing:
            raise HostsUnavailable(f"emulated hosts do not reach each other: {', '.join(missing)}")

    # --- the end ---------------------------------------------------------------------

    def close(self) -> None:
        """Every process of every host killed, the namespaces and links removed."""
        for h in self.hosts.values():
            with contextlib.suppress(Exception):
                self.crash(h.name)
        if self.prefix:
            _remove(self.prefix)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        self.hosts.clear()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)


def _try_lock(lock_dir: Path, prefix: str) -> IO[bytes] | None:
    """The lock of ``prefix`` (held while its harness lives), or None when another holds it."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    handle = (lock_dir / f"{prefix}.lock").open("ab")  # not inherited by children
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def remove_leftovers(lock_dir: Path = LOCK_DIR) -> list[str]:
    """What harnesses that are gone left (their prefix's lock free): removed; by name."""
    prefixes = {p for p in (_instance(name) for name in leftovers()) if p}
    removed: list[str] = []
    for prefix in sorted(prefixes):
        lock = _try_lock(lock_dir, prefix)
        if lock is not None:  # its harness is gone
            removed += _remove(prefix)
            lock.close()
    return removed


def leftovers() -> list[str]:
    """Namespaces and links of any harness prefix on this machine (live or not)."""
    found = [ns for ns in _netns_list() if _instance(ns)]
    found += [link["ifname"] for link in json.loads(_ip("-j", "link", "show", check=False) or "[]")
              if _instance(link.get("ifname", ""))]  # fmt: skip
    return found
