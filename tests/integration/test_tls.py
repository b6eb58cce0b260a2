"""rollstream over TLS (rediss://): a redis-server with a TLS port only, a certificate
made by the test, and check, feed and status through it."""

from __future__ import annotations

import os
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


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[str]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [find_redis_server(), "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
         "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    client = redis.Redis.from_url(url)

    def up() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    try:
        wait_for(up, timeout=20)
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            pytest.skip(f"this redis-server has no TLS: {out.strip()[-200:]}")
        yield url
    finally:
        client.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_check_feed_and_status_over_tls(tls_server: str, run_name: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(ROLLSTREAM_REDIS__URL=tls_server, ROLLSTREAM_RUN=run_name)
    path = tmp_path / "p.jsonl"
    path.write_text('{"uid": "a", "prompt": "What is 1 + 1?", "answer": "2"}\n')

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rollstream.cli.main", *args], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    checked = cli("check")
    assert checked.returncode == 0 and "answers at rediss://" in checked.stdout, checked.stderr
    fed = cli("feed", str(path), "--task", "default")
    assert fed.returncode == 0 and "1 prompts added" in fed.stdout, fed.stderr
    status = cli("status")
    assert status.returncode == 0 and "fed 1 = " in status.stdout, status.stderr
