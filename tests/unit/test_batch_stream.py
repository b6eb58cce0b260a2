"""BatchStream (consumer/integrations/loop.py), rollstream for any PyTorch loop, on fakeredis:
one batch a step, committed explicitly after the optimizer step, never handed out again
once committed, handed out again to a restart when not; the weights published as a step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fakeredis
import pytest

from rollstream.consumer.assembly import create_batch_stream
from rollstream.consumer.integrations.loop import BatchStream
from rollstream.shared.errors import IntegrationError
from rollstream.shared.events import RunControl
from rollstream.shared.keys import TRAINER, Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts, require

TASK = "math"


@pytest.fixture
def settings(make_settings: SettingsFactory, tmp_path: Path) -> Settings:
    return make_settings(
        tasks=[{"name": TASK, "n": 4}],
        rollout={"batch_size": 2, "max_staleness": 1},
        weights={"kind": "file", "dir": str(tmp_path / "weights")},
    )


def produce(client: Any, settings: Settings, count: int, start: int = 0) -> None:
    producer = open_buffer(client, settings, "producer-1")
    producer.feed(prompts(TASK, count, start))
    for claim in producer.claim(TASK, count):
        assert producer.complete(claim, group_for(claim.prompt, n=4)) is not None


def stream(client: Any, settings: Settings, steps: int | None = None) -> BatchStream:
    made = create_batch_stream(settings, client=client, steps=steps)
    made.poll_s = 0.05
    return made


def test_each_batch_is_committed_by_the_loop_once(settings: Settings) -> None:
    client = fakeredis.FakeRedis()
    produce(client, settings, 4)
    batches = stream(client, settings, steps=2)

    seen = []
    for batch in batches:
        assert batch.train_step == len(seen) // 2 + 1 and len(batch) == 2
        seen += [g.group_id for g in batch.groups]
        with pytest.raises(IntegrationError, match=f"the batch of step {batch.train_step} is not committed"):
            batches.next_batch()
        assert batches.commit() == batch.train_step
        with pytest.raises(IntegrationError, match="nothing to commit"):
            batches.commit()

    keys = Keys(settings.run)
    assert len(set(seen)) == 4  # four groups, none twice
    assert RunControl(client, keys).train_step() == 2
    assert client.xlen(keys.groups(TASK)) == 0 and client.xpending(keys.groups(TASK), TRAINER)["pending"] == 0
    assert int(client.hget(keys.progress, f"{TASK}:consumed")) == 4
    batches.close()


def test_a_batch_not_committed_goes_to_the_restart(settings: Settings) -> None:
    client = fakeredis.FakeRedis()
    produce(client, settings, 4)
    first = stream(client, settings, steps=1)
    (taken,) = list(first)  # the loop dies in its step: no commit
    first.close()

    again = stream(client, settings, steps=1)
    (batch,) = list(again)

    assert batch.train_step == 1  # the step redone, not skipped
    assert [g.group_id for g in batch.groups] == [g.group_id for g in taken.groups]
    again.commit()
    again.close()


def test_the_weights_are_published_as_the_committed_step(settings: Settings, tmp_path: Path) -> None:
    torch = require("torch", "hf")
    client = fakeredis.FakeRedis()
    produce(client, settings, 2)
    batches = stream(client, settings, steps=1)
    model = torch.nn.Linear(3, 2)
    control = RunControl(client, Keys(settings.run))

    for _ in batches:
        batches.commit()
        assert batches.publish_weights(model) == 1
    assert control.model_step() == 1
    assert batches.publish_weights(model) == 2  # again: a step above the run's, never the same
    written = sorted(p.name for p in (tmp_path / "weights" / "step-2").iterdir())
    assert "model.safetensors.index.json" in written
    batches.close()


def test_the_stream_is_a_torch_iterable_dataset(settings: Settings) -> None:
    torch = require("torch", "hf")
    client = fakeredis.FakeRedis()
    produce(client, settings, 2)
    batches = stream(client, settings, steps=1)
    dataset = batches.dataset()

    assert isinstance(dataset, torch.utils.data.IterableDataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, collate_fn=lambda b: b)
    got = list(loader)  # the loop's commit comes between two batches: one step here
    assert [len(b) for b in got] == [2]
    batches.commit()
    batches.close()
