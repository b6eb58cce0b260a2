"""What happens to claims through no fault of their prompts, on a real redis-server: a
producer that died with no producer left to reclaim its claims (they go back to their
pools), and a progress counter that is not a number (no prompt is claimed for it, and a
settle it refuses charges no delivery). docs/stream-format.md §11.9 and §11.10."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import CorruptValueError
from rollstream.shared.keys import PRODUCERS, Role
from rollstream.shared.runconfig import open_buffer
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts, wait_idle

pytestmark = pytest.mark.integration

IDLE_MS = 400
ROOT = Path(__file__).resolve().parents[2]
CLAIMER = """
import sys, time
from rollstream.shared.connection import connect
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings

settings = load_settings(run=sys.argv[2], redis={"url": sys.argv[1]}, tasks=[{"name": "math"}])
buffer = open_buffer(connect(settings.redis), settings, "producer-gone-1")
claims = buffer.claim("math", 3)
print(" ".join(c.prompt.uid for c in claims), flush=True)
time.sleep(600)  # holds the claims until the test kills it
"""


@pytest.fixture
def make(redis_server: EmbeddedRedis, make_settings: SettingsFactory) -> Iterator:  # type: ignore[type-arg]
    clients: list[redis.Redis] = []

    def buffer(consumer: str, **overrides: object) -> ReplayBuffer:
        settings = make_settings(
            redis_server.url, buffer={"claim_idle_ms": IDLE_MS, "max_attempts": 3, **overrides}
        )
        client = connect(settings.redis)
        clients.append(client)
        return open_buffer(client, settings, consumer)

    yield buffer
    for client in clients:
        client.close()


def test_a_dead_producers_claims_go_back_to_the_pool_when_no_producer_is_left(
    make,
    redis_server: EmbeddedRedis,  # type: ignore[no-untyped-def]
) -> None:
    # Given a producer process that claimed three prompts and was killed, and no producer after it
    trainer = make("trainer")
    trainer.feed(prompts("math", 4))
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, redis_server.url, trainer.keys.run],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
        cwd=ROOT,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().decode().split() == ["u0", "u1", "u2"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    stream = trainer.keys.prompts("math")
    assert trainer.running("math") == 3  # counted as running by admission
    # and a live producer's claim, idle as long, which is left alone
    live = make("producer-live")
    (held,) = live.claim("math", 1)
    trainer.client.set(trainer.keys.alive(Role.PRODUCER, "producer-live"), "{}", px=60_000)
    wait_idle(trainer.client, stream, PRODUCERS, IDLE_MS)

    # When the trainer, waiting for groups, hands back what is stranded
    assert trainer.hand_back_stranded("math", force=True) == (3, 0)

    # Then the dead producer's prompts wait in the pool, unclaimed, and the live one's is still held
    assert trainer.running("math") == 1
    assert trainer.unclaimed("math") == 3
    pending = trainer.client.xpending_range(stream, PRODUCERS, "-", "+", 10)
    assert [(p["consumer"], p["message_id"].decode()) for p in pending] == [(b"producer-live", held.entry.id)]
    assert live.complete(held, group_for(held.prompt)) is not None
    # and a producer that starts later claims them afresh, their first delivery counted
    later = make("producer-later")
    claims = later.claim("math", 5, limit=100)
    assert sorted(c.prompt.uid for c in claims) == ["u0", "u1", "u2"]
    assert [c.entry.deliveries for c in claims] == [2, 2, 2]
    for claim in claims:
        assert later.complete(claim, group_for(claim.prompt)) is not None
    assert trainer.client.xlen(trainer.keys.groups("math")) == 4
    assert trainer.client.xlen(stream) == 0
    assert trainer.client.xlen(trainer.keys.dead) == 0


def test_a_claim_handed_back_keeps_counting_towards_max_attempts(make) -> None:  # type: ignore[no-untyped-def]
    trainer = make("trainer", max_attempts=2)
    trainer.feed(prompts("math", 1))
    for round_, name in enumerate(("producer-a", "producer-b")):
        # a producer claims u0 and dies (no liveness key), no producer after it
        (claim,) = make(name, max_attempts=2).claim("math", 1)
        assert (claim.prompt.uid, claim.entry.deliveries) == ("u0", round_ + 1)
        wait_idle(trainer.client, trainer.keys.prompts("math"), PRODUCERS, IDLE_MS)
        back = trainer.hand_back_stranded("math", force=True)
        # the second time it has had max_attempts deliveries: a dead letter, counted
        assert back == ((1, 0) if round_ == 0 else (0, 1))
    ((_, dead),) = trainer.client.xrange(trainer.keys.dead)
    assert (dead[b"uid"], dead[b"attempts"]) == (b"u0", b"2")
    assert dead[b"reason"].startswith(b"delivered 2 times to producers that died")
    assert trainer.client.hget(trainer.keys.progress, "math:dead") == b"1"
    assert trainer.client.xlen(trainer.keys.prompts("math")) == 0


def test_a_corrupt_counter_stops_claiming_and_charges_no_delivery(make) -> None:  # type: ignore[no-untyped-def]
    producer = make("producer-1", max_attempts=1)
    producer.feed(prompts("math", 2))
    (claim,) = producer.claim("math", 1)
    producer.client.hset(producer.keys.progress, "math:completed", "abc")
    key = producer.keys.progress

    # the check before claiming names the field, the value and the repair
    with pytest.raises(CorruptValueError) as checked:
        producer.check_settle_counters("math")
    assert f"{key} field math:completed is 'abc'" in str(checked.value)
    assert f"redis-cli HSET {key} math:completed" in str(checked.value)

    # a settle refused for it writes nothing and gives the claim its delivery back
    with pytest.raises(CorruptValueError, match="redis-cli HSET"):
        producer.complete(claim, group_for(claim.prompt))
    (row,) = producer.client.xpending_range(key.replace("progress", "prompts:math"), PRODUCERS, "-", "+", 10)
    assert int(row["times_delivered"]) == 0
    assert producer.client.xlen(producer.keys.groups("math")) == 0

    # once repaired, the next producer reclaims it at its first delivery: with max_attempts 1
    # it is produced, not dead-lettered
    producer.client.hset(key, "math:completed", "0")
    wait_idle(producer.client, producer.keys.prompts("math"), PRODUCERS, IDLE_MS)
    (again,) = make("producer-2", max_attempts=1).claim("math", 1)
    assert (again.prompt.uid, again.entry.deliveries) == (claim.prompt.uid, 1)
    assert producer.client.xlen(producer.keys.dead) == 0


def test_a_producer_started_on_a_corrupt_counter_stops_before_it_claims(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    from tests.conformance.test_foreign_trainer import env_for
    from tests.helpers import rollstream

    env = env_for(redis_server.url, run_name)
    client = redis.Redis.from_url(redis_server.url)
    feed = tmp_path / "prompts.jsonl"
    feed.write_text("".join(f'{{"uid": "q{i}", "prompt": "What is {i} + 1?"}}\n' for i in range(8)))
    fed = subprocess.run(
        rollstream("feed", str(feed), "--task", "math"), env=env, capture_output=True, timeout=60
    )
    assert fed.returncode == 0, fed.stderr
    progress = f"rs:{{{run_name}}}:progress"
    client.hset(progress, "math:completed", "abc")

    done = subprocess.run(
        rollstream("produce", "--local-engines", "--burst"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 1, done.stderr[-2000:]
    assert f"{progress} field math:completed is 'abc'" in done.stderr
    assert "redis-cli HSET" in done.stderr
    # nothing claimed: every valid prompt waits, none charged a delivery or dead-lettered
    assert client.xpending(f"rs:{{{run_name}}}:prompts:math", PRODUCERS)["pending"] == 0
    assert client.xlen(f"rs:{{{run_name}}}:prompts:math") == 8
    assert client.xlen(f"rs:{{{run_name}}}:dead") == 0
    client.close()
