"""Conformance of docs/stream-format.md in a second language: tests/conformance/node/trainer.mjs,
a Node.js trainer written from the page with nothing but Node's standard library (RESP
over a raw socket), reads and commits a step's batch of groups that a real
`rollstream produce` made. Heavy tier: it needs `node` and a producer process."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import orjson
import pytest
import redis

from tests.conformance.test_foreign_trainer import env_for
from tests.helpers import rollstream

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

NODE_TRAINER = Path(__file__).resolve().parent / "node" / "trainer.mjs"


@pytest.mark.parametrize("keep", [0, 50], ids=["plain", "archive"])
def test_a_node_trainer_from_the_page_commits_a_batch_of_real_groups(
    redis_server: Any, run_name: str, tmp_path: Path, keep: int
) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    env = {**env_for(redis_server.url, run_name), "ROLLSTREAM_ARCHIVE__KEEP": str(keep)}
    base = f"rs:{{{run_name}}}"
    client = redis.Redis.from_url(redis_server.url)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(
        b"".join(
            orjson.dumps({"uid": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + b"\n"
            for i in range(12)
        )
    )
    # Given groups made by a real producer (burst: it stops at the admission bound)
    fed = subprocess.run(
        rollstream("feed", str(prompts), "--task", "math"), env=env, capture_output=True, timeout=60
    )
    assert fed.returncode == 0, fed.stderr
    made = subprocess.run(
        rollstream("produce", "--local-engines", "--burst"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    stream = f"{base}:groups:math"
    before = {i.decode() for i, _ in client.xrange(stream)}
    batch = int(
        orjson.loads(client.hget(f"{base}:state", "settings") or b"{}")["settings"]["rollout.batch_size"]
    )
    assert len(before) >= batch

    # When the Node.js trainer runs one step
    url = urlparse(redis_server.url)
    done = subprocess.run(
        [node, str(NODE_TRAINER), url.hostname or "127.0.0.1", str(url.port), run_name, "trainer-node"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = orjson.loads(done.stdout)

    # Then it read the step's quota of completed groups, decoded their samples, and
    # committed them as the page says: acked, counted, deleted (or logged, with an archive)
    ids = out["tasks"]["math"]["ids"]
    assert (out["step"], out["keep"], len(ids), out["tasks"]["math"]["foreign"]) == (1, keep, batch, [])
    assert set(ids) <= before
    assert all(n == 4 for n in out["tasks"]["math"]["samples"])  # env_for's n
    assert all(s in (0.0, 1.0) for s in out["tasks"]["math"]["scores"])
    assert client.xpending(stream, "trainer")["pending"] == 0
    assert int(client.hget(f"{base}:progress", "math:consumed") or 0) == batch
    assert client.hget(f"{base}:state", "train_step") == b"1"
    left = {i.decode() for i, _ in client.xrange(stream)}
    if keep:
        assert left == before
        logged = [f[b"source_id"].decode() for _, f in client.xrange(f"{base}:trained:math")]
        assert sorted(logged) == sorted(ids)
    else:
        assert left == before - set(ids)
    client.close()
