"""rollstream's rollout worker for TRL's AsyncGRPOTrainer (consumer/integrations/trl_async.py)
on fakeredis, driven as the trainer drives it: a sync, start, samples taken from the queue,
a sync after each step. Groups become RolloutSamples, are committed once the steps that
took them are done, and a group too stale for the trainer is expired, never handed to it."""

from __future__ import annotations

import queue
import warnings
from typing import Any

import fakeredis
import numpy as np
import pytest

from tests.helpers import group_for, prompts, require, wait_for

with warnings.catch_warnings():  # TRL warns about the vLLM version beside it at import
    warnings.simplefilter("ignore")
    require("trl.experimental.async_grpo.async_rollout_worker", "trl")

from rollstream.consumer.assembly import create_async_grpo
from rollstream.consumer.integrations.trl_async import RolloutWorker, rollout_samples
from rollstream.shared.errors import IntegrationError
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.records import Prompt
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings
from tests.conftest import SettingsFactory

TASK = "math"


@pytest.fixture
def settings(make_settings: SettingsFactory, tmp_path: Any) -> Settings:
    return make_settings(
        tasks=[{"name": TASK, "n": 2}],
        rollout={"batch_size": 2, "max_staleness": 1, "mode": "async"},
        weights={"kind": "file", "dir": str(tmp_path / "weights")},
    )


def produce(client: Any, settings: Settings, count: int, step: int = 0) -> None:
    producer = open_buffer(client, settings, "producer-1")
    producer.feed(prompts(TASK, count))
    for claim in producer.claim(TASK, count):
        assert producer.complete(claim, group_for(claim.prompt, n=2, tokens=3, step=step)) is not None


def worker_of(client: Any, settings: Settings, max_staleness: int = 1) -> RolloutWorker:
    worker, _ = create_async_grpo(settings, client=client, max_staleness=max_staleness)
    object.__setattr__(worker.plan, "poll_s", 0.05)
    return worker


def take(worker: RolloutWorker, count: int) -> list[Any]:
    return [worker.rollout_buffer.get(timeout=60) for _ in range(count)]


def test_a_group_becomes_trls_rollout_samples() -> None:
    group = group_for(Prompt("u1", TASK, "What is 1 + 1?"), n=3, tokens=4, step=5)
    for i, sample in enumerate(group.samples):
        sample.reward = {"score": float(i)}

    samples = rollout_samples(group, number=7, version=2)

    assert len(samples) == 3
    first = samples[0]
    assert first.input_ids.tolist() == [1, 2, 3, 0, 1, 2, 3]
    assert first.completion_mask.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert first.old_log_probs.tolist() == pytest.approx([0, 0, 0, -0.5, -0.5, -0.5, -0.5])
    advantages = [s.advantage for s in samples]
    assert advantages == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-4)  # (r - mean) / (std + 1e-8)
    assert {s.model_version for s in samples} == {2} and {s.group_id for s in samples} == {7}
    assert first.prompt == [{"role": "user", "content": "What is 1 + 1?"}]


def test_a_sample_without_logprobs_is_refused() -> None:
    group = group_for(Prompt("u1", TASK, "q"), n=1, tokens=2)
    group.samples[0].logprobs = np.array([np.nan, -1.0], dtype=np.float32)
    with pytest.raises(IntegrationError, match="logprob of every response token"):
        rollout_samples(group, 1, 0)


def test_groups_are_committed_once_the_steps_that_took_them_are_done(settings: Settings) -> None:
    client = fakeredis.FakeRedis()
    control = RunControl(client, Keys(settings.run))
    produce(client, settings, 2)
    worker = worker_of(client, settings)
    control.publish("weight_sync", 1, "")  # the trainer's first sync, as the transfer publishes it
    worker.update_model_version(1)
    worker.start()
    try:
        taken = take(worker, 4)  # two groups of two: what one step trains
        assert {s.model_version for s in taken} == {0}  # made on model step 0: TRL's version 0
        worker.update_model_version(2)  # the sync after the step: a loader may hold a sample ahead
        assert worker.committed == 0
        worker.update_model_version(3)
        assert worker.committed == 2
    finally:
        worker.stop()
    keys = Keys(settings.run)
    assert int(client.hget(keys.progress, f"{TASK}:consumed")) == 2
    assert client.xlen(keys.groups(TASK)) == 0 and control.train_step() == 1
    worker.check_health(60)  # nothing failed


def test_a_group_too_stale_for_the_trainer_is_expired_not_handed_over(settings: Settings) -> None:
    client = fakeredis.FakeRedis()
    produce(client, settings, 1, step=0)
    worker = worker_of(client, settings, max_staleness=1)
    worker.update_model_version(1)  # model_step 0, TRL's 1: offset -1, the group is version 1
    worker.start()
    try:
        wait_for(lambda: worker.rollout_buffer.qsize() == 2)
        worker.version = 3  # the trainer moved on two syncs while the samples waited
        with pytest.raises(queue.Empty):
            worker.rollout_buffer.get(timeout=0.2)
    finally:
        worker.stop()
    keys = Keys(settings.run)
    assert worker.expired == 1 and worker.committed == 0
    assert client.xlen(keys.expired(TASK)) == 1  # its prompt is produced again
    assert int(client.hget(keys.progress, f"{TASK}:expired")) == 1


def test_a_worker_that_failed_says_so_to_the_trainer(settings: Settings) -> None:
    client = fakeredis.FakeRedis()
    worker = worker_of(client, settings)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the stream is gone")

    worker.reader.get_batch = broken  # type: ignore[method-assign]
    worker.start()
    try:
        wait_for(lambda: worker._error is not None)
        with pytest.raises(IntegrationError, match="the stream is gone"):
            worker.check_health(60)
    finally:
        worker.stop()
