"""The emulated-hosts harness (chaos/hosts.py): hosts reach each other over their bridge,
a partition cuts a host off and a heal brings it back, an isolation cuts only the pairs
named, a host crash kills every process of the host at once, each host sees only its own
processes, and nothing is left behind: after close, nor after the harness itself died.

Needs root and iproute2 / util-linux: skipped elsewhere, a failure in CI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from chaos.hosts import Hosts, HostsUnavailable, leftovers, remove_leftovers, unavailable
from rollstream.shared.embedded import find_redis_server
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
CI = bool(os.environ.get("CI"))
REDIS_PORT = 7379


def _require_hosts() -> None:
    reason = unavailable()
    if reason:
        if CI:
            pytest.fail(f"CI runs the emulated-hosts tests: {reason}")
        pytest.skip(reason)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    _require_hosts()
    made = Hosts(["a", "b", "c"])
    try:
        yield made.start()
    finally:
        made.close()


def _redis_on(hosts: Hosts, host: str, folder: Path) -> subprocess.Popen[bytes]:
    """A real redis-server bound to ``host``'s address, answering once it does."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [find_redis_server(), "--bind", hosts.address(host), "--port", str(REDIS_PORT),
            "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(folder)]  # fmt: skip
    proc = hosts.popen(host, argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_for(lambda: _ping(hosts, host, "c") or proc.poll() is not None, timeout=60)
    assert proc.poll() is None, "redis-server exited"
    return proc


def _gone(pid: int | str) -> bool:
    """No such process any more (or only its exit status, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _ping(hosts: Hosts, server_host: str, from_host: str) -> bool:
    """redis-cli on ``from_host`` gets PONG from the server on ``server_host``."""
    done = hosts.run(from_host, ["timeout", "5", "redis-cli", "-h", hosts.address(server_host),
                                 "-p", str(REDIS_PORT), "PING"], timeout=30)  # fmt: skip
    return done.stdout.strip() == "PONG"


def test_hosts_have_their_own_addresses_and_reach_each_other(hosts: Hosts, tmp_path: Path) -> None:
    addresses = {h: hosts.address(h) for h in hosts}
    assert len(set(addresses.values())) == 3
    # each host has its address on its eth0 and no route out of the subnet
    shown = hosts.run("a", ["ip", "-o", "-4", "addr", "show", "dev", "eth0"]).stdout
    assert f"{addresses['a']}/24" in shown
    assert "default" not in hosts.run("a", ["ip", "route"]).stdout
    # the machine reaches them over its own link, not the default route
    route = subprocess.run(["ip", "route", "get", addresses["b"]], capture_output=True, text=True).stdout
    assert f"dev {hosts.prefix}gw" in route, route
    _redis_on(hosts, "a", tmp_path / "a")
    assert _ping(hosts, "a", "b")
    # redis-py from another host, and from the machine (the gateway's address)
    probe = (f"import redis; print(redis.Redis(host='{addresses['a']}', port={REDIS_PORT}, "
             "socket_timeout=5).client_list()[-1]['addr'])")  # fmt: skip
    seen = hosts.run("c", [sys.executable, "-c", probe], cwd=ROOT, timeout=60)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.startswith(f"{addresses['c']}:"), seen.stdout  # the server saw host c's address
    client = redis.Redis(host=addresses["a"], port=REDIS_PORT, socket_timeout=5)
    try:
        assert client.ping()
        assert client.client_list()[-1]["addr"].startswith(f"{hosts.gateway}:")
    finally:
        client.close()


def test_a_partitioned_host_is_unreachable_until_healed(hosts: Hosts, tmp_path: Path) -> None:
    _redis_on(hosts, "a", tmp_path / "a")
    hosts.partition("a")
    assert not _ping(hosts, "a", "b")
    assert hosts.reaches("b", ["a", "c"]) == {"a": False, "c": True}
    assert hosts.reaches(None, ["a", "b"]) == {"a": False, "b": True}
    hosts.heal()
    assert wait_for(lambda: _ping(hosts, "a", "b"), timeout=60)
    assert hosts.reaches("b", ["a", "c"]) == {"a": True, "c": True}


def test_isolation_cuts_only_the_pairs_named(hosts: Hosts, tmp_path: Path) -> None:
    _redis_on(hosts, "a", tmp_path / "a")
    hosts.isolate(["a"], ["b"])
    assert not _ping(hosts, "a", "b")  # b does not reach a's server
    assert _ping(hosts, "a", "c")  # c still does
    assert hosts.reaches("a", ["b", "c"]) == {"b": False, "c": True}
    assert hosts.reaches("b", ["a", "c"]) == {"a": False, "c": True}
    hosts.heal()
    assert wait_for(lambda: _ping(hosts, "a", "b"), timeout=60)


def test_each_host_sees_only_its_own_processes(hosts: Hosts) -> None:
    sleeper = hosts.popen("b", ["sleep", "300"])
    try:
        seen_on_a = hosts.run("a", ["ps", "-e", "-o", "pid=,args="]).stdout
        assert "sleep 300" not in seen_on_a
        assert hosts.run("b", ["ps", "-e", "-o", "args="]).stdout.count("sleep 300") == 1
        # PID 1 of each host is its own init; the host has its own name
        assert hosts.run("a", ["hostname"]).stdout.strip() == "a"
        assert "-c" in hosts.run("a", ["cat", "/proc/1/cmdline"]).stdout
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_host_crash_kills_every_process_of_the_host_at_once(hosts: Hosts, tmp_path: Path) -> None:
    server = _redis_on(hosts, "a", tmp_path / "a")
    # a process whose child daemonizes away from it: still the host's
    tree = hosts.popen("a", ["sh", "-c", "(setsid sleep 300 &) ; sleep 300"])
    other = hosts.popen("b", ["sleep", "300"])
    wait_for(lambda: len(hosts.pids("a")) >= 6, timeout=60)  # init, redis, sh, 2 sleeps, nsenters
    before = hosts.pids("a")
    hosts.crash("a")
    assert server.poll() is not None and tree.poll() is not None
    assert hosts.pids("a") == []
    assert wait_for(lambda: all(_gone(pid) for pid in before), timeout=30)
    assert other.poll() is None  # another host is untouched
    assert hosts.reaches("b", ["a", "c"]) == {"a": False, "c": True}
    with pytest.raises(RuntimeError, match="down"):
        hosts.popen("a", ["true"])
    hosts.boot("a")  # the machine again, empty: a fresh PID namespace, the same address
    assert hosts.reaches("b", ["a"]) == {"a": True}
    assert "sleep" not in hosts.run("a", ["ps", "-e", "-o", "args="]).stdout
    other.kill()
    other.wait()


def test_close_removes_everything_it_made() -> None:
    _require_hosts()
    made = Hosts(["x", "y"])
    try:
        made.start()
        prefix = made.prefix
        sleeper = made.popen("x", ["sleep", "300"])
        assert any(name.startswith(f"{prefix}-") for name in leftovers())
    finally:
        made.close()
    assert sleeper.poll() is not None
    assert not [name for name in leftovers() if name.startswith((f"{prefix}-", f"{prefix}gw"))]


CRASHING_HARNESS = textwrap.dedent("""
    import os, signal, subprocess, sys
    from chaos.hosts import Hosts
    hosts = Hosts(["p", "q"]).start()
    proc = hosts.popen("p", ["sleep", "300"])
    print(hosts.prefix, proc.pid, hosts.hosts["p"].init_pid, flush=True)
    sys.stdin.readline()
    os.kill(os.getpid(), signal.SIGKILL)  # the harness dies without cleaning up
""")


def test_a_crashed_harness_leaves_nothing_after_the_next_start() -> None:
    _require_hosts()
    harness = subprocess.Popen([sys.executable, "-c", CRASHING_HARNESS], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert harness.stdout is not None and harness.stdin is not None
    try:
        prefix, sleeper, init = harness.stdout.readline().split()
        harness.stdin.write("\n")
        harness.stdin.flush()
        assert harness.wait(timeout=60) == -signal.SIGKILL
        left = [name for name in leftovers() if name.startswith((f"{prefix}-", f"{prefix}gw"))]
        assert f"{prefix}-p" in left and f"{prefix}gw" in left
        assert not _gone(sleeper) and not _gone(init)  # the crashed harness's host lives on
        nxt = Hosts(["r"])
        try:
            nxt.start()
            left = [name for name in leftovers() if name.startswith((f"{prefix}-", f"{prefix}gw"))]
            # its prefix may be taken again by the new harness: then only the new host is there
            assert left == [] or (nxt.prefix == prefix and f"{prefix}-p" not in left), left
        finally:
            nxt.close()
        assert wait_for(lambda: _gone(sleeper) and _gone(init), timeout=30)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
        harness.stdin.close()
        harness.stdout.close()
        remove_leftovers()  # what this test's crashed harness left, even when it failed


def test_unavailable_names_the_reason_it_cannot_run() -> None:
    reason = unavailable()
    if os.geteuid() != 0:
        assert reason is not None and "root" in reason
        with pytest.raises(HostsUnavailable, match="root"):
            Hosts(["a"]).start()
    else:
        assert reason is None or "`" in reason
