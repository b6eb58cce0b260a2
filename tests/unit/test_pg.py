"""The reference trainer's real policy-gradient step on a tiny local model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from consumer.batches import TrainBatch
from consumer.pg import PolicyGradient
from producer.engines.base import SamplingParams
from producer.engines.hf import HFEngine
from shared.buffer import Batch, BatchItem
from shared.records import Group, Prompt, Sample
from shared.settings import HFEngineSettings
from tests.hf_fixtures import save_model


def batch_of(samples: list[tuple[list[int], float]]) -> TrainBatch:
    group = Group.for_prompt(
        Prompt(uid="u", task="math", prompt="q"),
        samples=[
            Sample([4, 5, 6], ids, [0.0] * len(ids), [0] * len(ids), "stop", {"score": s})
            for ids, s in samples
        ],
    )
    return TrainBatch(1, {"math": Batch("math", [BatchItem(None, group)])})  # type: ignore[arg-type]


def test_a_step_makes_rewarded_responses_likelier_and_saves_loadable_weights(tmp_path: Path) -> None:
    model_dir = save_model(tmp_path / "model", seed=0)
    pg = PolicyGradient(str(model_dir), str(tmp_path / "out"), lr=1e-2)
    good, bad = [7, 8, 9, 10], [11, 12, 13, 14]
    batch = batch_of([(good, 1.0), (bad, 0.0)])

    def logprob(ids: list[int]) -> float:
        import torch

        with torch.no_grad():
            full = torch.tensor([[4, 5, 6, *ids]])
            lp = torch.log_softmax(pg.model(full).logits[0, :-1], -1).gather(1, full[0, 1:, None])[:, 0]
            return float(lp[2:].sum())

    before = logprob(good) - logprob(bad)
    losses = [pg(batch) for _ in range(5)]
    after = logprob(good) - logprob(bad)
    assert all(np.isfinite(losses))
    assert after > before  # the rewarded response gained on the unrewarded one
    assert pg(batch_of([(good, 1.0), (bad, 1.0)])) == 0.0  # equal rewards: no signal

    path = pg.save(3)

    async def versions() -> list[int]:
        engine = HFEngine(HFEngineSettings(model=str(model_dir)))
        await engine.update_weights(3, path)
        (gen,) = await engine.generate(
            [4, 5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        )
        return gen.versions.tolist()

    assert asyncio.run(versions()) == [3, 3, 3]
