"""An entry no reader of this version can read stops the trainer, named, with the way on;
`rollstream dead-letter` moves it (or any one entry) to the dead letters with a reason,
counted like every dead letter, and the run goes on."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest
import redis

from rollstream.shared import codec
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import PRODUCERS, TRAINER, Count, Keys, progress_field
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import group_for, prompts, rollstream

pytestmark = pytest.mark.integration

BATCH = 2


def _env(server: EmbeddedRedis, run: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=server.url, ROLLSTREAM_RUN=run,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]', ROLLSTREAM_ROLLOUT__BATCH_SIZE=str(BATCH),
    )  # fmt: skip
    return env


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(rollstream(*args), env=env, capture_output=True, text=True, timeout=120)


def _count(client: redis.Redis, keys: Keys, count: Count) -> int:
    return int(client.hget(keys.progress, progress_field("math", count)) or 0)


def test_an_entry_of_an_unknown_major_stops_the_trainer_until_moved_by_hand(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    env = _env(redis_server, run_name)
    settings = load_settings(
        run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}],
        rollout={"batch_size": BATCH},
    )  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    producer = open_buffer(client, settings, "p")
    producer.ensure("math")
    # Given a group of format 2.0 (a newer producer's) ahead of two good ones
    future: dict[str, Any] = dict(codec.encode_group(group_for(prompts("math", 1, start=9)[0], n=2)))
    future["format"] = "2.0"
    bad = client.xadd(keys.groups("math"), future).decode()  # type: ignore[arg-type]
    producer.feed(prompts("math", BATCH))
    for claim in producer.claim("math", BATCH):
        producer.complete(claim, group_for(claim.prompt, n=2))
    # When the trainer reads it, Then it stops, exit 1, naming the entry and the command
    stopped = _run(env, "train", "--steps", "1", "--step-time", "0")
    assert stopped.returncode == 1, stopped.stderr[-2000:]
    assert f"entry {bad}" in stopped.stderr and "'2.0'" in stopped.stderr
    assert f"rollstream dead-letter groups:math {bad} --reason" in stopped.stderr
    assert client.xlen(keys.dead) == 0  # not dead-lettered: the reader is the wrong one
    # and a restart stops on it again, charging no one
    again = _run(env, "train", "--steps", "1", "--step-time", "0")
    assert again.returncode == 1 and f"entry {bad}" in again.stderr
    # When the operator moves it with a reason
    moved = _run(env, "dead-letter", "groups:math", bad, "--reason", "format 2.0, not read here")
    assert moved.returncode == 0, moved.stderr[-2000:]
    assert f"pending for {TRAINER}" in moved.stdout
    [(_, dead)] = client.xrange(keys.dead)
    assert dead[b"reason"] == b"by hand: format 2.0, not read here"
    assert dead[b"source"] == keys.groups("math").encode() and dead[b"source_id"] == bad.encode()
    assert dead[b"format"] == b"2.0" and dead[b"attempts"] == b"1"  # restarts are not deliveries
    assert (_count(client, keys, Count.DEAD), _count(client, keys, Count.GROUPS_DEAD)) == (1, 1)
    # Then the trainer trains the step on the two good groups, none dead-lettered
    done = _run(env, "train", "--steps", "1", "--step-time", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert RunControl(client, keys).train_step() == 1
    assert client.xlen(keys.dead) == 1 and client.xlen(keys.groups("math")) == 0
    assert _count(client, keys, Count.CONSUMED) == BATCH
    client.close()


def test_dead_letter_moves_a_pending_prompt_and_refuses_what_is_not_there(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    env = _env(redis_server, run_name)
    settings = load_settings(run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}])
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    producer = open_buffer(client, settings, "p")
    producer.feed(prompts("math", 1))
    [claim] = producer.claim("math", limit=100)
    moved = _run(env, "dead-letter", keys.prompts("math"), claim.entry.id, "--reason", "crashes the judge")
    assert moved.returncode == 0, moved.stderr[-2000:]
    assert client.xpending(keys.prompts("math"), PRODUCERS)["pending"] == 0
    assert client.xlen(keys.prompts("math")) == 0
    assert (_count(client, keys, Count.DEAD), _count(client, keys, Count.GROUPS_DEAD)) == (1, 0)
    # its holder's settle, later, writes nothing: the entry is not its own any more
    assert producer.complete(claim, group_for(claim.prompt)) is None
    assert client.xlen(keys.groups("math")) == 0
    # the same move again (typed twice, or sent again after a lost reply) does nothing
    again = _run(env, "dead-letter", "prompts:math", claim.entry.id, "--reason", "again")
    assert again.returncode == 0 and "already" in again.stdout, again.stderr[-2000:]
    assert (_count(client, keys, Count.DEAD), client.xlen(keys.dead)) == (1, 1)
    # an entry that is not there, a stream that is not the run's, an id that is not one
    gone = _run(env, "dead-letter", "prompts:math", "1-0", "--reason", "again")
    assert gone.returncode == 1 and "no entry 1-0" in gone.stderr
    assert _run(env, "dead-letter", "nothing:math", "1-0", "--reason", "x").returncode == 2
    assert _run(env, "dead-letter", "groups:math", "latest", "--reason", "x").returncode == 2
    assert client.xlen(keys.dead) == 1
    client.close()
