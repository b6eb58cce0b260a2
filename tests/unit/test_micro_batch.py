"""Gradient accumulation in the reference trainer's step (``algorithm.micro_batch_size``):
the gradient, the update and the metrics of a batch run through the model a few samples
at a time are those of the whole batch in one pass, for every objective, correction and
aggregation.

The model runs in float64 throughout (its RMSNorms too, which transformers' Llama
computes in float32 whatever the model's dtype): in float32 the gradients of the two
ways agree within ~1e-7 of their size, and AdamW's first step, which divides each entry
by its own magnitude, turns that into up to ~5e-4 on the parameters whose gradient is
nearly zero. In float64 they agree to 1e-9. The parameters are compared after the step,
and the gradients and the loss too: AdamW's first step moves each parameter by about lr
whatever its gradient's scale, so a wrong divisor shows in those.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from tests.helpers import require

torch = require("torch", "hf")
require("transformers", "hf")

from rollstream.consumer.advantages import batch_advantages
from rollstream.consumer.batches import TrainBatch
from rollstream.consumer.losses import AGGREGATIONS, AlgorithmConfig, LossSums, policy_loss, policy_loss_part
from rollstream.consumer.pg import PolicyGradient
from rollstream.consumer.tensors import padded_chunks, to_padded
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import Group, Prompt, Sample
from rollstream.shared.settings import load_settings
from tests.hf_fixtures import save_model

SHORT, LONG = [4, 5, 6], [5, 6, 7, 8, 9, 10]
# (prompt, response, reward, stored loss mask): two groups of uneven size, prompts and
# responses of different lengths, an agent-style sample with tokens left out of the loss
# and one with none trained (it counts in no denominator)
SAMPLES = [
    [
        (SHORT, [7, 8, 9, 10], 1.0, None),
        (SHORT, [11, 12], 0.0, None),
        (SHORT, [7, 8, 9, 10, 11, 12, 13], 0.5, [1, 1, 0, 0, 1, 1, 1]),
        (SHORT, [9], 1.0, None),
    ],
    [
        (LONG, [11, 12, 13], 0.0, None),
        (LONG, [4, 4, 4, 4, 4], 1.0, [0, 0, 0, 0, 0]),
        (LONG, [13, 12, 11, 10, 9, 8], 0.3, None),
    ],
]
WHOLE = sum(len(g) for g in SAMPLES)  # 7
ATOL = 1e-9  # gradients and parameters, in float64
NOISE = 0.4  # the behaviour logprobs: the model's own plus N(0, NOISE²) per token

OBJECTIVES = {
    "pg": AlgorithmConfig(),
    "pg_tis": AlgorithmConfig(importance="tis", tis_cap=1.2),
    "pg_masked_is": AlgorithmConfig(importance="masked_is", mis_upper=2.0),
    "ppo": AlgorithmConfig(loss="ppo", dual_clip_c=3.0),
    "ppo_masked_is": AlgorithmConfig(loss="ppo", importance="masked_is", mis_upper=2.0),
    "decoupled_ppo": AlgorithmConfig(loss="decoupled_ppo", behav_imp_weight_cap=1.3),
    "decoupled_ppo_tis": AlgorithmConfig(loss="decoupled_ppo", importance="tis", tis_cap=1.2),
    "decoupled_ppo_masked_is": AlgorithmConfig(loss="decoupled_ppo", importance="masked_is", mis_upper=2.0),
}
# what shows that the batch puts each objective's own machinery to work (decoupled PPO's
# clip is idle with one update per batch: its proximal policy is the current one)
EXERCISED = {
    "pg": [],
    "pg_tis": ["is_truncated_fraction"],
    "pg_masked_is": ["is_dropped_sequence_fraction"],
    "ppo": ["clip_fraction"],
    "ppo_masked_is": ["clip_fraction", "is_dropped_sequence_fraction"],
    "decoupled_ppo": ["is_dropped_token_fraction"],
    "decoupled_ppo_tis": ["is_truncated_fraction"],
    "decoupled_ppo_masked_is": ["is_dropped_sequence_fraction"],
}


def groups_of(logprobs: list[list[float]] | None = None) -> list[Group]:
    flat = iter(logprobs) if logprobs is not None else None
    groups = []
    for g, specs in enumerate(SAMPLES):
        samples = [
            Sample(prompt, response, next(flat) if flat else [0.0] * len(response), [0] * len(response),
                   "stop", {"score": score}, loss_mask=None if mask is None else np.array(mask))
            for prompt, response, score, mask in specs
        ]  # fmt: skip
        groups.append(Group.for_prompt(Prompt(uid=f"u{g}", task="math", prompt="q"), samples=samples))
    return groups


def policy(
    model_dir: Path, tmp_path: Path, algorithm: AlgorithmConfig, double: bool = True
) -> PolicyGradient:
    pg = PolicyGradient(str(model_dir), str(tmp_path / "out"), lr=1e-2, algorithm=algorithm)
    if double:
        pg.model.double()  # the same parameters, converted in place: the optimizer keeps them
    return pg


def behaviour_logprobs(model_dir: Path, tmp_path: Path, seed: int = 0) -> list[list[float]]:
    """What engines slightly off the trainer's weights would record: every response
    token's logprob under the model, plus noise."""
    pg = policy(model_dir, tmp_path, AlgorithmConfig())
    tokens = to_padded(groups_of(), pad_id=pg.pad_id)
    with torch.no_grad():
        lp = pg.logprobs(tokens)
    rng = np.random.default_rng(seed)
    out = []
    for i, sample in enumerate(s for g in groups_of() for s in g.samples):
        p, r = len(sample.prompt_ids), len(sample.response_ids)
        out.append((lp[i, p - 1 : p - 1 + r].numpy() + rng.normal(0.0, NOISE, r)).tolist())
    return out


def one_pass_step(pg: PolicyGradient, groups: list[Group]) -> dict[str, float]:
    """The step as the trainer took it before micro-batches: the whole batch padded
    at once, one forward, ``policy_loss``, one backward."""
    cfg = pg.algorithm
    advantages = batch_advantages(groups, cfg.advantage, eps=cfg.adv_eps, std=cfg.adv_std)
    tokens = to_padded(groups, advantages, pad_id=pg.pad_id)
    logprobs = pg.logprobs(tokens)
    proximal = logprobs.detach() if cfg.needs_proximal_logprobs else None
    loss, metrics = policy_loss(
        logprobs, tokens.old_logprobs, tokens.advantages, tokens.loss_mask, cfg, proximal_logprobs=proximal
    )
    pg.optimizer.zero_grad()
    loss.backward()
    pg.optimizer.step()
    return metrics


def weights(pg: PolicyGradient) -> list[Any]:
    return [p.detach().clone() for p in pg.model.parameters()]


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's RMSNorm in the hidden states' own dtype (transformers casts to float32)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def forward(self: Any, hidden: Any) -> Any:
        scale = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * (hidden * scale)

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


@pytest.fixture(scope="module")
def model_and_batch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Group]]:
    tmp = tmp_path_factory.mktemp("micro")
    model_dir = save_model(tmp / "model", seed=0)
    return model_dir, groups_of(behaviour_logprobs(model_dir, tmp))


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_micro_batches_give_the_whole_batchs_update_and_metrics(
    tmp_path: Path, model_and_batch: tuple[Path, list[Group]], objective: str, agg: str
) -> None:
    model_dir, groups = model_and_batch
    cfg = OBJECTIVES[objective].model_copy(update={"agg": agg, "agg_norm": 8.0})
    reference = policy(model_dir, tmp_path, cfg)
    before = weights(reference)
    expected = one_pass_step(reference, groups)
    after = weights(reference)
    assert max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True)) > 1e-3
    for name in EXERCISED[objective]:
        assert 0.0 < expected[name] < 1.0, (name, expected)

    gradients = [p.grad.clone() for p in reference.model.parameters()]
    for size in (1, 3, WHOLE, 0):
        pg = policy(model_dir, tmp_path, cfg.model_copy(update={"micro_batch_size": size}))
        loss = pg(TrainBatch.of_groups(1, groups))
        for got, want in zip([p.grad for p in pg.model.parameters()], gradients, strict=True):
            assert torch.allclose(got, want, rtol=0.0, atol=ATOL), (size, float((got - want).abs().max()))
        for got, want in zip(weights(pg), after, strict=True):
            assert torch.allclose(got, want, rtol=0.0, atol=ATOL), (size, float((got - want).abs().max()))
        assert sorted(pg.metrics) == sorted(expected), size
        for name, value in expected.items():
            assert pg.metrics[name] == pytest.approx(value, rel=1e-9, abs=1e-12), (size, name)
        assert loss == pg.metrics["loss"]


def test_the_whole_batch_in_one_pass_is_the_step_as_before_bit_for_bit(
    tmp_path: Path, model_and_batch: tuple[Path, list[Group]]
) -> None:
    """micro_batch_size 0 (the default), in the float32 the trainer runs in: the very
    update and metrics of the one-pass step."""
    model_dir, groups = model_and_batch
    cfg = AlgorithmConfig(loss="ppo", importance="masked_is", agg="seq_mean_token_mean")
    reference = policy(model_dir, tmp_path, cfg, double=False)
    expected = one_pass_step(reference, groups)
    pg = policy(model_dir, tmp_path, cfg, double=False)
    pg(TrainBatch.of_groups(1, groups))
    assert all(torch.equal(a, b) for a, b in zip(weights(pg), weights(reference), strict=True))
    assert pg.metrics == pytest.approx(expected, rel=1e-12)


def test_each_micro_batch_is_padded_to_its_own_longest_sequence(
    tmp_path: Path, model_and_batch: tuple[Path, list[Group]]
) -> None:
    model_dir, groups = model_and_batch
    lengths = [len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples]
    chunks = padded_chunks(groups, np.ones(WHOLE), 3)
    assert [c.input_ids.shape for c in chunks] == [
        (3, max(lengths[0:3])), (3, max(lengths[3:6])), (1, lengths[6])
    ]  # fmt: skip
    assert [int(c.loss_mask.sum()) for c in chunks] == [4 + 2 + 5, 1 + 3 + 0, 6]
    whole = to_padded(groups, np.ones(WHOLE))
    assert torch.equal(torch.cat([c.loss_mask.sum(1) for c in chunks]), whole.loss_mask.sum(1))

    pg = policy(model_dir, tmp_path, AlgorithmConfig(micro_batch_size=1))
    widths: list[tuple[int, ...]] = []
    embed = pg.model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, i, o: widths.append(tuple(i[0].shape)))
    pg(TrainBatch.of_groups(1, groups))
    hook.remove()
    assert widths == [(1, n) for n in lengths]  # one sample a pass, no padding


def test_without_recorded_logprobs_pg_reports_no_ratio_for_the_whole_batch(
    tmp_path: Path, model_and_batch: tuple[Path, list[Group]]
) -> None:
    """One sample's engine recorded none: plain pg trains without any behaviour
    logprobs, in every micro-batch, as in one pass (no ratio metrics at all)."""
    model_dir, groups = model_and_batch
    recorded = [list(s.logprobs) for g in groups for s in g.samples]
    recorded[1] = []
    groups = groups_of(recorded)
    reference = policy(model_dir, tmp_path, AlgorithmConfig())
    expected = one_pass_step(reference, groups)
    assert "ratio_mean" not in expected
    pg = policy(model_dir, tmp_path, AlgorithmConfig(micro_batch_size=2))
    pg(TrainBatch.of_groups(1, groups))
    assert sorted(pg.metrics) == sorted(expected)
    assert all(
        torch.allclose(a, b, rtol=0.0, atol=1e-9)
        for a, b in zip(weights(pg), weights(reference), strict=True)
    )


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_loss_parts_of_row_splits_add_up_to_the_whole(objective: str) -> None:
    """``policy_loss_part`` on rows split any way (a split without a trained token
    among them) sums to ``policy_loss`` on all of them: numerator, count and metrics."""
    gen = torch.Generator().manual_seed(1)
    shape = (6, 5)
    logprobs = (torch.rand(shape, generator=gen, dtype=torch.float64) * -2).requires_grad_()
    old = logprobs.detach() + torch.randn(shape, generator=gen, dtype=torch.float64) * NOISE
    adv = torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(shape)
    mask = torch.rand(shape, generator=gen) > 0.3
    mask[2] = False  # a row with nothing trained, alone in its split
    for agg in AGGREGATIONS:
        cfg = OBJECTIVES[objective].model_copy(update={"agg": agg, "agg_norm": 4.0})
        proximal = logprobs.detach() if cfg.needs_proximal_logprobs else None
        loss, expected = policy_loss(logprobs, old, adv, mask, cfg, proximal_logprobs=proximal)
        total = LossSums()
        for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
            _, sums = policy_loss_part(
                logprobs[rows], old[rows], adv[rows], mask[rows], cfg,
                proximal_logprobs=None if proximal is None else proximal[rows],
            )  # fmt: skip
            total.add(sums)
        assert total.metrics(cfg) == pytest.approx(expected, rel=1e-12, abs=1e-15), agg
        assert math.isclose(total.loss(cfg), float(loss.detach()), rel_tol=1e-12)


def test_a_bad_micro_batch_size_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_ALGORITHM__MICRO_BATCH_SIZE", "-8")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value).startswith(
        "invalid setting algorithm.micro_batch_size (ROLLSTREAM_ALGORITHM__MICRO_BATCH_SIZE): must be >= 0"
    )
    monkeypatch.setenv("ROLLSTREAM_ALGORITHM__MICRO_BATCH_SIZE", "16")
    assert load_settings().algorithm.micro_batch_size == 16
    with pytest.raises(ValidationError, match="micro_batch_size"):
        AlgorithmConfig(micro_batch_size=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"size is -1: samples per chunk, a whole number >= 0"):
        padded_chunks(groups_of(), size=-1)
