"""rollstream's RolloutWorkerProtocol and WeightTransferProtocol for TRL's AsyncGRPOTrainer
(consumer/integrations/trl_async.py), contract-tested on the CPU: AsyncGRPOTrainer loads its
model with a flash-attention-3 kernel and runs only on a CUDA GPU, so a stand-in calls the
two protocols in the order and from the threads TRL 1.16 does (its train-begin callback,
``_sync_weight_merged``, a weight sync every step) and reads the samples through TRL's own
``RolloutQueueDataset``, which drops what is staler than ``max_staleness``. The producers
choose the prompts (async mode, hf engines in Ray actors); the worker commits what the
steps consumed, the engines hold the trainer's weights after every sync, nothing is lost
and a restarted worker trains first what the stopped one had not committed. Heavy."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.helpers import require, wait_for

pytestmark = [pytest.mark.heavy, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]

torch = require("torch", "hf")
with warnings.catch_warnings():  # TRL warns about the vLLM version beside it at import
    warnings.simplefilter("ignore")
    grpo = require("trl.experimental.async_grpo.async_grpo_trainer", "trl")

from rollstream.cli.status import run_status
from rollstream.consumer import create_async_grpo
from rollstream.consumer.integrations.trl_async import RolloutWorker, WeightTransfer
from rollstream.consumer.weights import model_tensors
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import TRAINER, Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.transports import tensor_digests
from tests.hf_fixtures import load_model, save_model
from tests.trl_fixtures import TASK, Pipeline, pipeline_settings, word_prompts

N = 4
GROUPS_PER_STEP = 2
MAX_STALENESS = 1


class AsyncGRPOStandIn:
    """What trl 1.16's AsyncGRPOTrainer does with a rollout worker and a weight transfer, its
    model and optimizer a plain policy-gradient step on the samples' advantages."""

    def __init__(self, model: Any, worker: RolloutWorker, transfer: WeightTransfer, on_sync: Any) -> None:
        self.model, self.worker, self.transfer, self.on_sync = model, worker, transfer, on_sync
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.version = 0
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.samples: list[dict[str, Any]] = []

    def sync(self) -> None:  # _sync_weight_merged, on the main process
        self.transfer.pause()
        self.transfer.send_weights(grpo._iter_vllm_named_params(self.model))
        self.transfer.resume()
        self.version += 1
        self.worker.update_model_version(self.version)
        self.on_sync(self)

    def train(self, steps: int) -> None:
        self.transfer.init_weight_transfer()  # _TrainBeginCallback: transfer, cold sync, worker
        self.sync()
        self.worker.start()
        dataset = grpo.RolloutQueueDataset(
            rollout_queue=self.worker.rollout_buffer, model_version_fn=lambda: self.version,
            check_health_fn=self.worker.check_health, stale_after_s=300, metrics=self.metrics,
            max_staleness=MAX_STALENESS, poll_interval_s=0.5,
        )  # fmt: skip
        rows = iter(dataset)
        try:
            for _ in range(steps):
                batch = [next(rows) for _ in range(GROUPS_PER_STEP * N)]
                self.samples += batch
                self.step(batch)
                while not self.worker.metrics_queue.empty():  # what log() drains
                    for key, value in self.worker.metrics_queue.get_nowait().items():
                        self.metrics[key].append(value)
                self.sync()  # weight_sync_steps 1
        finally:
            self.worker.stop()
            self.transfer.destroy()

    def step(self, batch: list[dict[str, Any]]) -> None:
        loss = torch.zeros(())
        for row in batch:
            ids = torch.as_tensor(row["input_ids"])[None]
            mask = torch.as_tensor(row["completion_mask"][1:], dtype=torch.float32)
            logits = self.model(input_ids=ids).logits[0, :-1]
            logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            ratio = torch.exp(logp - torch.as_tensor(row["old_log_probs"][1:]))
            loss = loss - row["advantage"] * (ratio * mask).sum() / mask.sum().clamp(min=1)
        self.optimizer.zero_grad()
        (loss / len(batch)).backward()
        self.optimizer.step()


@pytest.fixture
def pipeline(
    redis_server: EmbeddedRedis, ray_local: None, run_name: str, tmp_path: Path
) -> Iterator[Pipeline]:
    model_dir = save_model(tmp_path / "model", seed=3)
    settings = pipeline_settings(
        redis_server.url, run_name, model_dir, tmp_path / "weights", n=N, batch=GROUPS_PER_STEP, mode="async"
    )
    client = redis.Redis.from_url(redis_server.url)
    open_buffer(client, settings, "feeder").feed(word_prompts(40))  # the producers choose from these
    pipe = Pipeline(settings).start()
    yield pipe
    pipe.stop()


def test_the_protocols_as_async_grpo_calls_them(pipeline: Pipeline, tmp_path: Path) -> None:
    settings = pipeline.settings
    client = redis.Redis.from_url(settings.redis.url)
    keys = Keys(settings.run)
    control = RunControl(client, keys)
    model = load_model(Path(settings.engines.hf.model)).train()
    held: list[bool] = []

    def engines_hold_the_trainers_weights(trainer: AsyncGRPOStandIn) -> None:
        step = control.model_step()
        engine = wait_for(lambda: (d := pipeline.digests()[0])["model_step"] == step and d, timeout=120)
        mine = tensor_digests(model_tensors(trainer.model))
        held.append(all(engine["tensors"][k] == v for k, v in mine.items()))

    # Given producers running ahead in async mode, when the stand-in trains 3 steps
    worker, transfer = create_async_grpo(settings, client=client, max_staleness=MAX_STALENESS)
    trainer = AsyncGRPOStandIn(model, worker, transfer, engines_hold_the_trainers_weights)
    trainer.train(3)

    # then it trained on samples no staler than it allows, none dropped by TRL's own check
    assert len(trainer.samples) == 3 * GROUPS_PER_STEP * N
    assert max(trainer.metrics["sample/staleness_max"]) <= MAX_STALENESS
    assert not trainer.metrics["sample/dropped_stale_total"]
    assert trainer.metrics["rollstream/groups_read"]  # the worker's own metrics reached the trainer
    # each sync published a model step and the engines loaded exactly the trainer's weights
    assert transfer.published == [1, 2, 3, 4] and held == [True] * 4
    # the groups of the first steps are committed; those of the last two syncs stay for a restart
    assert worker.committed >= GROUPS_PER_STEP and control.train_step() >= 3
    uncommitted = {
        p["message_id"].decode()
        for p in client.xpending_range(keys.groups(TASK), TRAINER, "-", "+", 100, TRAINER)
    }
    # and nothing is lost: every fed prompt is trained, waiting (read or not), in a pool or dropped
    got = run_status(client, keys).accounts[TASK]
    assert got.lost == 0 and got.dead == 0 and got.trained == worker.committed
    assert got.fed == got.trained + got.waiting + got.in_pools + got.dropped

    # When a worker under the same consumer name starts again, it reads first what the
    # stopped one had read and not committed: each is handed over again, or expired as too
    # stale by now (gone from the stream, its prompt produced again), never left behind
    worker2, transfer2 = create_async_grpo(settings, client=client, max_staleness=MAX_STALENESS)
    again = AsyncGRPOStandIn(model, worker2, transfer2, lambda _: None)
    again.version = trainer.version
    again.train(1)
    handed_again = set(worker2.handed)
    assert uncommitted and all(
        entry in handed_again or not client.xrange(keys.groups(TASK), entry, entry) for entry in uncommitted
    )
    assert run_status(client, keys).accounts[TASK].lost == 0
    pipeline.check()
