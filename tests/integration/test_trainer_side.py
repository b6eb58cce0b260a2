"""The trainer's side on a real redis-server: staleness expiry at its boundary, tail
batch modes, commit after the step across a SIGKILL, progress checkpoints, weight
syncs and batch timeouts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import redis

from rollstream.consumer.assembly import create_reader
from rollstream.consumer.progress import ProduceProgress
from rollstream.consumer.weights import SyncTimeout, publish_weights, wait_for_producers
from rollstream.producer.assembly import build_producer
from rollstream.producer.fleet.pool import LocalPool
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import BatchTimeout
from rollstream.shared.events import RunControl
from rollstream.shared.keys import TRAINER, Keys
from rollstream.shared.runconfig import open_buffer, task_quota
from rollstream.shared.settings import Settings, load_settings
from tests.helpers import group_for, prompts, still_running, wait_for, wait_for_async

pytestmark = pytest.mark.integration


def settings_for(server: EmbeddedRedis, run: str, **rollout: Any) -> Settings:
    return load_settings(
        run=run,
        redis={"url": server.url},
        tasks=[{"name": "math", "n": 2}],
        rollout={"batch_size": 2, **rollout},
    )


def produce_at(buffer: ReplayBuffer, steps: list[int]) -> list[str]:
    """Complete one group per step given, each generated entirely at that model step."""
    buffer.feed(prompts("math", len(steps), start=int(buffer.client.scard(buffer.keys.fed("math")))))
    ids = []
    for claim, step in zip(buffer.claim("math", len(steps)), steps, strict=True):
        buffer.complete(claim, group_for(claim.prompt, step=step))
        ids.append(claim.prompt.group_id)
    return ids


@pytest.mark.parametrize(("interval", "train_step", "kept", "expired"), [(1, 5, 3, 2), (2, 6, 2, 1)])
def test_expiry_at_the_exact_boundary(
    redis_server: EmbeddedRedis, run_name: str, interval: int, train_step: int, kept: int, expired: int
) -> None:
    # max_staleness 1: threshold = 2 x interval; staleness = train_step - model_step - 1
    settings = settings_for(redis_server, run_name, max_staleness=1, sync_weights_interval=interval)
    client = redis.Redis.from_url(redis_server.url)
    producer = open_buffer(client, settings, "p")
    produce_at(producer, [expired, kept, kept])
    reader = create_reader(settings, client=client)
    batch = reader.get_batch(train_step)
    threshold = 2 * interval
    assert [train_step - g.model_step - 1 for g in batch.groups] == [threshold - 1, threshold - 1]
    assert batch.expired == 1
    assert client.xlen(producer.keys.expired("math")) == 1
    assert batch.staleness == {threshold - 1: 2}


def test_tail_batch_minus_one_drops_expired_groups(redis_server: EmbeddedRedis, run_name: str) -> None:
    settings = settings_for(redis_server, run_name, max_staleness=0, tail_batch_trigger_size=-1)
    client = redis.Redis.from_url(redis_server.url)
    produce_at(open_buffer(client, settings, "p"), [0, 3, 3])
    batch = create_reader(settings, client=client).get_batch(4)
    assert batch.expired == 1 and len(batch) == 2
    keys = open_buffer(client, settings).keys
    assert client.xlen(keys.expired("math")) == 0
    assert client.hget(keys.progress, "math:expired_dropped") == b"1"


@pytest.mark.parametrize(("trigger", "waiting", "first"), [(0, 1, True), (3, 2, False), (3, 3, True)])
def test_tail_batch_modes_decide_when_producers_take_the_expired_pool_first(
    redis_server: EmbeddedRedis, run_name: str, trigger: int, waiting: int, first: bool
) -> None:
    settings = settings_for(redis_server, run_name, max_staleness=0, tail_batch_trigger_size=trigger)
    client = redis.Redis.from_url(redis_server.url)
    produce_at(open_buffer(client, settings, "p"), [0] * waiting + [9, 9])
    reader = create_reader(settings, client=client)
    assert reader.get_batch(10).expired == waiting
    producer = build_producer(client, settings, pool=LocalPool([]), name="probe")
    assert producer._expired_first("math") is first
    assert producer.limit("math") == (0 + 1) * 2 + 0  # no over-sampling budget configured


def test_a_trainer_killed_before_commit_gets_the_same_groups_again(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = settings_for(redis_server, run_name)
    client = redis.Redis.from_url(redis_server.url)
    ids = produce_at(open_buffer(client, settings, "p"), [0, 0, 0, 0])
    env = {
        **os.environ,
        "ROLLSTREAM_REDIS__URL": redis_server.url,
        "ROLLSTREAM_RUN": run_name,
        "ROLLSTREAM_TASKS": '[{"name": "math", "n": 2}]',
        "ROLLSTREAM_ROLLOUT__BATCH_SIZE": "2",
    }
    keys = open_buffer(client, settings).keys
    with subprocess.Popen(
        [sys.executable, "-m", "rollstream.cli.main", "train", "--steps", "1", "--step-time", "60"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ) as trainer:  # fmt: skip
        wait_for(lambda: client.xpending(keys.groups("math"), "trainer")["pending"] == 2, timeout=60)
        trainer.send_signal(signal.SIGKILL)  # in the middle of its train step
        trainer.wait()
    restarted = create_reader(settings, client=client)
    again = restarted.get_batch(1)
    assert [g.group_id for g in again.groups] == ids[:2]
    assert again.commit() == []
    rest = restarted.get_batch(2)
    assert [g.group_id for g in rest.groups] == ids[2:]
    rest.commit()
    assert client.hget(keys.progress, "math:consumed") == b"4"  # each trained exactly once
    assert client.xlen(keys.groups("math")) == 0


def test_progress_checkpoint_round_trip_never_goes_backwards(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = settings_for(redis_server, run_name)
    client = redis.Redis.from_url(redis_server.url)
    produce_at(open_buffer(client, settings, "p"), [0, 0, 0])
    reader = create_reader(settings, client=client)
    reader.get_batch(1).commit()
    progress = ProduceProgress(client, Keys(settings.run), task_quota(settings))
    saved = progress.state_dict()
    assert saved["next_consumer_step"] == 2
    assert saved["tasks"]["math"]["completed"] == 3 and saved["tasks"]["math"]["consumed"] == 2
    assert saved["tasks"]["math"]["produced_samples"] == 12  # 3 groups of 4 samples
    # more happens after the checkpoint; loading the older checkpoint keeps the newer counts
    produce_at(open_buffer(client, settings, "p"), [1])
    progress.load_state_dict(saved)
    assert progress.counts("math")["completed"] == 4
    # Redis lost everything: the checkpoint brings the counts back
    for key in client.scan_iter(match=f"rs:{{{run_name}}}:*"):
        client.delete(key)
    progress.load_state_dict(saved)
    assert progress.state_dict() == saved


def test_publish_weights_and_wait_for_producers_names_the_laggards(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = settings_for(redis_server, run_name)
    control = RunControl(redis.Redis.from_url(redis_server.url), open_buffer(
        redis.Redis.from_url(redis_server.url), settings).keys)  # fmt: skip
    control.publish_status("fast", 3, 0)
    control.publish_status("slow", 2, 4)
    publish_weights(control, 3, "/ckpt/3")
    assert control.model_step() == 3
    with pytest.raises(SyncTimeout, match=r"slow \(step 2\)"):
        wait_for_producers(control, 3, timeout_s=0.2)
    control.publish_status("slow", 3, 0)
    assert wait_for_producers(control, 3, timeout_s=1) == ["fast", "slow"]


def test_a_batch_timeout_returns_partial_only_above_min_wait_num(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = settings_for(redis_server, run_name, batch_size=4)
    client = redis.Redis.from_url(redis_server.url)
    produce_at(open_buffer(client, settings, "p"), [0, 0])
    reader = create_reader(settings, client=client)
    with pytest.raises(BatchTimeout, match=r"2 groups after 0.3 s, fewer than min_wait_num 3 \(math 2/4"):
        reader.get_batch(1, timeout_s=0.3, min_wait_num=3)
    partial = create_reader(settings, client=client).get_batch(1, timeout_s=0.3, min_wait_num=2)
    assert len(partial) == 2


def test_producers_and_the_trainer_settle_on_one_model_step(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = load_settings(
        run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}],
        engines={"sim": {"time_compression": 50.0, "median_tokens": 50}},
        rollout={"batch_size": 2}, producer={"is_valid": "keep_all", "heartbeat_s": 0.05},
    )  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    producer = build_producer(client, settings, name="p1")
    producer.buffer.feed(prompts("math", 20))

    async def main() -> list[str]:
        stop = asyncio.Event()
        task = asyncio.create_task(producer.run(stop))
        # live before the sync: the trainer then has a producer to wait for
        await wait_for_async(lambda: still_running(task) and producer.control.producers(10))
        publish_weights(producer.control, 1)
        live = await asyncio.to_thread(wait_for_producers, producer.control, 1, 10.0)
        stop.set()
        await task
        return live

    assert asyncio.run(main()) == ["p1"]


def test_groups_read_before_a_batch_timeout_are_not_stranded(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    settings = settings_for(redis_server, run_name, batch_size=4)
    client = redis.Redis.from_url(redis_server.url)
    producer = open_buffer(client, settings, "p")
    first = produce_at(producer, [0, 0])
    reader = create_reader(settings, client=client)
    with pytest.raises(BatchTimeout):
        reader.get_batch(1, timeout_s=0.2)
    second = produce_at(producer, [0, 0])
    batch = reader.get_batch(1, timeout_s=5)
    assert sorted(g.group_id for g in batch.groups) == sorted(first + second)
    assert batch.commit() == []
    assert client.xlen(producer.keys.groups("math")) == 0


def test_the_reference_trainer_stops_while_it_waits_for_data(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    import threading

    from rollstream.consumer.assembly import create_trainer

    settings = settings_for(redis_server, run_name)
    client = redis.Redis.from_url(redis_server.url)
    trainer = create_trainer(settings, client=client, step_time_s=0)
    stop = threading.Event()
    logs: list[Any] = []
    thread = threading.Thread(target=lambda: logs.append(trainer.run(5, stop=stop)))
    thread.start()  # no producer: nothing ever arrives
    groups = open_buffer(client, settings).keys.groups("math")

    def reading() -> bool:
        try:
            return any(c["name"] in (b"trainer", "trainer") for c in client.xinfo_consumers(groups, TRAINER))
        except redis.ResponseError:  # no stream or group yet
            return False

    wait_for(reading)  # it waits for data
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the trainer did not stop"
    (log,) = logs
    assert log.steps == []
