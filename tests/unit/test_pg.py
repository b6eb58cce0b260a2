"""The reference trainer's real policy-optimisation step on a tiny local model, with the
algorithms of consumer.losses put to work on the logprobs the engines record."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import require

torch = require("torch", "hf")
require("transformers", "hf")

from rollstream.consumer.batches import TrainBatch
from rollstream.consumer.losses import AlgorithmConfig
from rollstream.consumer.pg import PolicyGradient
from rollstream.consumer.tensors import to_padded
from rollstream.producer.engines.base import SamplingParams
from rollstream.producer.engines.hf import HFEngine
from rollstream.shared.buffer_types import Batch, BatchItem
from rollstream.shared.engine_settings import HFEngineSettings
from rollstream.shared.records import Group, Prompt, Sample
from tests.hf_fixtures import save_model

PROMPT = [4, 5, 6]
GOOD, BAD = [7, 8, 9, 10], [11, 12, 13, 14]


def batch_of(samples: list[tuple[list[int], float]], logprobs: list[list[float]] | None = None) -> TrainBatch:
    group = Group.for_prompt(
        Prompt(uid="u", task="math", prompt="q"),
        samples=[
            Sample(
                PROMPT,
                ids,
                [0.0] * len(ids) if logprobs is None else lp,
                [0] * len(ids),
                "stop",
                {"score": s},
            )
            for (ids, s), lp in zip(samples, logprobs or [None] * len(samples), strict=True)
        ],
    )
    return TrainBatch(1, {"math": Batch("math", [BatchItem(None, group)])})  # type: ignore[arg-type]


def model_logprobs(pg: PolicyGradient, responses: list[list[int]]) -> list[list[float]]:
    """What an engine on the trainer's current weights records for each response."""
    batch = batch_of([(ids, 0.0) for ids in responses])
    tokens = to_padded(batch, pad_id=pg.pad_id)
    with torch.no_grad():
        lp = pg.logprobs(tokens)
    return [lp[i][tokens.loss_mask[i]].tolist() for i in range(len(responses))]


def test_a_step_makes_rewarded_responses_likelier_and_saves_loadable_weights(tmp_path: Path) -> None:
    model_dir = save_model(tmp_path / "model", seed=0)
    pg = PolicyGradient(str(model_dir), str(tmp_path / "out"), lr=1e-2)
    good, bad = GOOD, BAD
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


def test_ppo_clips_against_the_recorded_behaviour_logprobs(tmp_path: Path) -> None:
    model_dir = save_model(tmp_path / "model", seed=0)
    pg = PolicyGradient(str(model_dir), str(tmp_path / "out"), lr=1e-2, algorithm=AlgorithmConfig(loss="ppo"))
    recorded = model_logprobs(pg, [GOOD, BAD])
    # recorded by the trainer's own weights: on-policy, every ratio 1, nothing clipped
    pg(batch_of([(GOOD, 1.0), (BAD, 0.0)], recorded))
    assert pg.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert pg.metrics["clip_fraction"] == 0.0
    assert pg.metrics["tokens"] == 8.0

    # a behaviour policy half as likely on every token: ratios about 2, so the clip takes
    # over on the positive advantage's 4 tokens (r > 1.2) and not on the negative one's
    stale = [[v - math.log(2.0) for v in lp] for lp in model_logprobs(pg, [GOOD, BAD])]
    pg(batch_of([(GOOD, 1.0), (BAD, 0.0)], stale))
    assert pg.metrics["ratio_mean"] == pytest.approx(2.0, rel=1e-3)
    assert pg.metrics["clip_fraction"] == 0.5


def test_decoupled_ppo_weights_by_behaviour_and_improves(tmp_path: Path) -> None:
    model_dir = save_model(tmp_path / "model", seed=0)
    cfg = AlgorithmConfig(loss="decoupled_ppo", advantage="rloo")
    pg = PolicyGradient(str(model_dir), str(tmp_path / "out"), lr=1e-2, algorithm=cfg)

    def margin() -> float:
        good, bad = model_logprobs(pg, [GOOD, BAD])
        return sum(good) - sum(bad)

    before = margin()
    for _ in range(3):
        # behaviour logprobs log 2 below the current ones: π_prox / μ = 2 on every token
        behaviour = [[v - math.log(2.0) for v in lp] for lp in model_logprobs(pg, [GOOD, BAD])]
        pg(batch_of([(GOOD, 1.0), (BAD, 0.0)], behaviour))
        # the proximal policy is the one of just before the step: ratio 1, weight 2
        assert pg.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert pg.metrics["is_weight_mean"] == pytest.approx(2.0, rel=1e-3)
    assert margin() > before


def test_a_correction_without_recorded_logprobs_names_the_group(tmp_path: Path) -> None:
    model_dir = save_model(tmp_path / "model", seed=0)
    pg = PolicyGradient(str(model_dir), str(tmp_path / "out"), algorithm=AlgorithmConfig(importance="tis"))
    batch = batch_of([(GOOD, 1.0), (BAD, 0.0)], [[], []])
    with pytest.raises(ValueError, match="sample 0 of group math:u has 0 for 4 tokens"):
        pg(batch)
    # plain policy gradient needs none
    pg.algorithm = AlgorithmConfig()
    assert np.isfinite(pg(batch))


@pytest.mark.parametrize("lora", [False, True])
def test_logprobs_leave_the_prompts_logits_out_and_agree_with_the_whole_pass(
    tmp_path: Path, lora: bool
) -> None:
    """The output projection runs from the first trained position on (logits_to_keep):
    the logprobs of every trained token are the whole pass's, and fewer positions'
    logits are made."""
    from rollstream.consumer.tensors import token_logprobs

    if lora:
        require("peft", "lora", load=False)
    algorithm = AlgorithmConfig(lora_rank=2, lora_targets=["q_proj"]) if lora else None
    pg = PolicyGradient(
        str(save_model(tmp_path / "model", seed=0)), str(tmp_path / "out"), algorithm=algorithm
    )
    group = Group.for_prompt(
        Prompt(uid="u", task="math", prompt="q"),
        samples=[  # prompts of 6 and 3 tokens: the kept span starts at the shorter one's end
            Sample([4, 5, 6, 4, 5, 6], GOOD, [0.0] * 4, [0] * 4, "stop", {"score": 1.0}),
            Sample(PROMPT, [*BAD, 9, 9], [0.0] * 6, [0] * 6, "stop", {"score": 0.0}),
        ],
    )
    tokens = to_padded(TrainBatch(1, {"math": Batch("math", [BatchItem(None, group)])}), pad_id=pg.pad_id)  # type: ignore[arg-type]
    widths: list[int] = []
    hook = pg.model.get_output_embeddings().register_forward_hook(lambda m, i, o: widths.append(o.shape[1]))
    with torch.no_grad():
        kept = pg.logprobs(tokens)
        hook.remove()
        whole = token_logprobs(
            pg.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                     position_ids=tokens.position_ids).logits, tokens.targets,
        )  # fmt: skip
    mask = tokens.loss_mask
    assert kept.shape == whole.shape == mask.shape
    assert torch.allclose(kept[mask], whole[mask], atol=1e-6)
    assert widths == [tokens.input_ids.shape[1] - len(PROMPT) + 1]  # from position p - 1 = 2 on
