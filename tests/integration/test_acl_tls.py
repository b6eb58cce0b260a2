"""The TLS variant that deploy/ documents, run as written: deploy/redis.conf's commented
TLS lines uncommented (a certificate made here in place of /etc/redis/tls/...), the run's
ACL users loaded, and rollstream reaching it with systemd/redis.env's commented rediss://
URL, each process as its own user."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollstream.shared.embedded import find_redis_server, free_port
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RUN = "tlsrun"
ROLES = ("admin", "producer", "trainer", "feeder", "engines", "judge", "archive", "metrics", "monitor")


def tls_conf(cert: Path, key: Path, port: int) -> str:
    """deploy/redis.conf with its TLS lines uncommented, the paths and port this test's."""
    text = (DEPLOY / "redis.conf").read_text()
    text = re.sub(r"^# ((?:tls-\S+|port) .*)$", r"\1", text, flags=re.M)
    text = text.replace("/etc/redis/tls/redis.crt", str(cert)).replace("/etc/redis/tls/redis.key", str(key))
    text = text.replace("/etc/redis/tls/ca.crt", str(cert))  # self-signed: its own CA
    assert "tls-port 6380" in text and "\nport 0" in text, "redis.conf's TLS lines changed"
    return text.replace("tls-port 6380", f"tls-port {port}")


def documented_url(role: str, password: str, port: int, ca: Path) -> str:
    """systemd/redis.env's commented rediss:// URL, for ``role`` on this test's server."""
    (line,) = [
        x
        for x in (DEPLOY / "systemd" / "redis.env").read_text().splitlines()
        if "ROLLSTREAM_REDIS__URL=rediss://" in x
    ]
    url = line.split("ROLLSTREAM_REDIS__URL=", 1)[1]
    assert url == "rediss://producer:change-me@10.0.0.1:6380/0?ssl_ca_certs=/etc/rollstream/redis-ca.pem"
    return (
        url.replace("producer:change-me", f"{role}:{password}")
        .replace("10.0.0.1:6380", f"127.0.0.1:{port}")
        .replace("/etc/rollstream/redis-ca.pem", str(ca))
    )


@pytest.fixture
def tls_acl_server(tmp_path: Path) -> Iterator[tuple[int, dict[str, str], Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    passwords = {role: f"{role}-{os.urandom(6).hex()}" for role in ROLES}
    env = {
        "PATH": os.environ["PATH"],
        "RUN": RUN,
        **{f"REDIS_PASSWORD_{r.upper()}": p for r, p in passwords.items()},
    }
    acl = subprocess.run(
        ["sh", str(DEPLOY / "redis" / "acl.sh")], env=env, capture_output=True, text=True, check=True
    )
    (tmp_path / "users.acl").write_text(acl.stdout)
    port = free_port()
    (tmp_path / "redis.conf").write_text(tls_conf(cert, key, port))
    admin = redis.Redis.from_url(documented_url("admin", passwords["admin"], port, cert))
    proc = subprocess.Popen(
        [find_redis_server(), str(tmp_path / "redis.conf"), "--dir", str(tmp_path), "--appendonly", "no",
         "--aclfile", str(tmp_path / "users.acl")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip

    def up() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return bool(admin.ping())
        except redis.RedisError:
            return False

    try:
        wait_for(up, timeout=30)
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            pytest.skip(f"this redis-server has no TLS: {out.strip()[-300:]}")
        yield port, passwords, cert
    finally:
        admin.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_documented_tls_variant_serves_each_role_as_its_user(
    tls_acl_server: tuple[int, dict[str, str], Path], tmp_path: Path
) -> None:
    port, passwords, ca = tls_acl_server
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"uid": "a", "prompt": "What is 1 + 1?", "answer": "2"}\n')
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}

    def cli(role: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {
            **base,
            "ROLLSTREAM_RUN": RUN,
            "ROLLSTREAM_REDIS__URL": documented_url(role, passwords[role], port, ca),
        }
        return subprocess.run([sys.executable, "-m", "rollstream.cli.main", *args], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    checked = cli("producer", "check")
    assert checked.returncode == 0 and "answers at rediss://producer:***@" in checked.stdout, checked.stderr
    fed = cli("feeder", "feed", str(prompts), "--task", "default")
    assert fed.returncode == 0 and "1 prompts added" in fed.stdout, fed.stderr
    status = cli("metrics", "status")
    assert status.returncode == 0 and "fed 1 = " in status.stdout, status.stderr
    # a client without TLS is not answered on the TLS port (and `port 0` leaves no other)
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, username="admin", password=passwords["admin"], socket_timeout=5).ping()
    assert all(p not in checked.stdout + fed.stdout + status.stdout for p in passwords.values())
