"""rollstream's rollout function for TRL's GRPOTrainer (consumer/integrations/trl.py) driven as
GRPOTrainer drives it — train begin, a generation, the optimizer step's end — by a stand-in
for the trainer, on a real redis-server, with groups completed by a hand producer in a
thread: the batch is committed only after its step; a restart takes the batch it left
again when TRL asks for the same prompts and drops it (counted) when TRL asks for others;
the weights are published again only when the engines may hold others than the trainer's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from rollstream.cli.status import run_status
from rollstream.consumer.assembly import create_trl_rollout
from rollstream.consumer.integrations.trl import TrlRollout
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import TRAINER, Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings
from tests.helpers import group_for, require

pytestmark = pytest.mark.integration

torch = require("torch", "hf")
require("trl", "trl", load=False)

TASK = "words"
N = 2


@pytest.fixture
def settings(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> Settings:
    return load_settings(
        run=run_name,
        redis={"url": redis_server.url},
        tasks=[{"name": TASK, "n": N}],
        rollout={"batch_size": 2},
        buffer={"claim_idle_ms": 500},
        weights={"kind": "file", "dir": str(tmp_path / "weights")},
    )


@pytest.fixture
def producing(settings: Settings) -> Iterator[set[str]]:
    """Completes every prompt fed, as a producer would, until the test ends: on the weights
    of the run's model step, but on those of step 0 the first time for a prompt whose text
    the test adds to the set it yields (a producer that had not followed the syncs)."""
    stop = threading.Event()
    errors: list[BaseException] = []
    behind: set[str] = set()

    def serve() -> None:
        try:
            client = redis.Redis.from_url(settings.redis.url)
            producer = open_buffer(client, settings, "hand")
            control = RunControl(client, producer.keys)
            while not stop.is_set():
                for claim in producer.claim(TASK, 8, include_expired=True):
                    late = claim.prompt.prompt in behind
                    behind.discard(claim.prompt.prompt)
                    step = 0 if late else control.model_step()
                    producer.complete(claim, group_for(claim.prompt, n=N, tokens=3, step=step))
                stop.wait(0.02)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve, name="hand-producer")
    thread.start()
    yield behind
    stop.set()
    thread.join(timeout=30)
    assert not errors, errors


def trainer(step: int = 0) -> Any:
    """What the rollout function reads of GRPOTrainer."""
    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(num_processes=1),
        num_generations=N,
        num_iterations=1,
        args=SimpleNamespace(steps_per_generation=1, gradient_accumulation_steps=1),
        state=SimpleNamespace(global_step=step),
    )


def rollout(settings: Settings, tmp_path: Path) -> TrlRollout:
    return create_trl_rollout(settings, client=redis.Redis.from_url(settings.redis.url), timeout_s=60)


def progress(settings: Settings) -> dict[str, int]:
    client = redis.Redis.from_url(settings.redis.url)
    return {k.decode(): int(float(v)) for k, v in client.hgetall(Keys(settings.run).progress).items()}


def pending(settings: Settings) -> int:
    client = redis.Redis.from_url(settings.redis.url)
    return int(client.xpending(Keys(settings.run).groups(TASK), TRAINER)["pending"])


ENTRIES = ["one two"] * N + ["red green"] * N
OTHERS = ["sun moon"] * N + ["a quick"] * N


def test_a_generation_is_committed_after_its_step(
    settings: Settings, producing: set[str], tmp_path: Path
) -> None:
    model = torch.nn.Linear(3, 2)
    control = RunControl(redis.Redis.from_url(settings.redis.url), Keys(settings.run))
    rs = rollout(settings, tmp_path)

    rs.begin(model, 0)  # the engines get the trainer's weights: model step 1
    out = rs(ENTRIES, trainer(0))

    assert len(out["completion_ids"]) == 4 and control.model_step() == 1
    assert out["rollstream_staleness"] == [0] * 4  # made on the weights of step 1 for step 2
    assert pending(settings) == 2 and progress(settings).get(f"{TASK}:consumed", 0) == 0
    with pytest.raises(Exception, match="is not committed"):
        rs(ENTRIES, trainer(0))  # a second generation before the step: the callback is missing

    rs.step_end(model, 1)

    assert pending(settings) == 0 and progress(settings)[f"{TASK}:consumed"] == 2
    assert control.train_step() == 2 and control.model_step() == 2
    assert (tmp_path / "weights" / "step-2").is_dir()


def test_a_restart_on_the_same_prompts_trains_the_batch_it_left(
    settings: Settings, producing: set[str], tmp_path: Path
) -> None:
    model = torch.nn.Linear(3, 2)
    control = RunControl(redis.Redis.from_url(settings.redis.url), Keys(settings.run))
    first = rollout(settings, tmp_path)
    first.begin(model, 0)
    taken = first(ENTRIES, trainer(0))
    # killed in its step: nothing committed; TRL resumes from its checkpoint of step 0

    again = rollout(settings, tmp_path)
    again.begin(model, 0)  # the engines hold step 0's weights already: no second publish
    assert control.model_step() == 1
    out = again(ENTRIES, trainer(0))
    again.step_end(model, 1)

    assert out["completion_ids"] == taken["completion_ids"]
    counts = progress(settings)
    assert counts[f"{TASK}:fed"] == 2 and counts[f"{TASK}:consumed"] == 2
    assert pending(settings) == 0


def test_a_restart_on_other_prompts_drops_the_batch_it_left(
    settings: Settings, producing: set[str], tmp_path: Path
) -> None:
    model = torch.nn.Linear(3, 2)
    control = RunControl(redis.Redis.from_url(settings.redis.url), Keys(settings.run))
    first = rollout(settings, tmp_path)
    first.begin(model, 0)
    first(ENTRIES, trainer(0))
    first.step_end(model, 1)  # step 1 committed and published...
    first(OTHERS, trainer(1))  # ...killed in step 2, resumed from a checkpoint of step 0

    again = rollout(settings, tmp_path)
    again.begin(model, 0)  # the engines hold step 1's weights: the trainer's go again
    assert control.model_step() == 3
    again(ENTRIES, trainer(0))
    again.step_end(model, 1)

    counts = progress(settings)
    assert counts[f"{TASK}:fed"] == 6
    assert counts[f"{TASK}:consumed"] == 4  # the first step 1, and its redo on fresh groups
    assert counts[f"{TASK}:aborted_dropped"] == 2  # the batch of step 2, left by the dead one
    assert pending(settings) == 0 and control.model_step() == 4


def test_a_group_past_the_staleness_bound_is_made_again_before_trl_gets_it(
    settings: Settings, producing: set[str], tmp_path: Path
) -> None:
    model = torch.nn.Linear(3, 2)
    rs = rollout(settings, tmp_path)
    rs.begin(model, 0)
    rs(ENTRIES, trainer(0))
    rs.step_end(model, 1)  # model step 2: a group of step 0 is 2 syncs stale for step 3
    producing.add("sun moon")  # made the first time by a producer still on step 0

    out = rs(OTHERS, trainer(1))

    assert out["rollstream_staleness"] == [0] * 4  # made again on the current weights
    rs.step_end(model, 2)
    counts = progress(settings)
    assert counts[f"{TASK}:expired"] == 1 and counts[f"{TASK}:consumed"] == 4
    assert run_status(redis.Redis.from_url(settings.redis.url), Keys(settings.run)).accounts[TASK].lost == 0
