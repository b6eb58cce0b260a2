"""Policy losses against numbers worked out by hand, gradients by autograd.

Logprobs are chosen so that the ratios are round numbers: a current logprob of log 0.6
against a behaviour logprob of log 0.4 is a ratio of 1.5. Float64 throughout, so the
comparisons can be tight.
"""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from tests.helpers import require

torch = require("torch", "hf")

from rollstream.consumer.losses import (
    AlgorithmConfig,
    aggregate,
    masked_is_weights,
    policy_loss,
    ppo_clip_token_loss,
    truncated_is_weights,
)

NAN = float("nan")


def logs(*probs: float, grad: bool = False) -> torch.Tensor:
    """One row of log-probabilities."""
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64, requires_grad=grad)


def row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float64)


def ones(n: int) -> torch.Tensor:
    return torch.ones(1, n, dtype=torch.bool)


def value(t: torch.Tensor) -> float:
    return float(t.detach())


def grad_of(loss: torch.Tensor, leaf: torch.Tensor) -> list[float]:
    loss.backward()
    assert leaf.grad is not None
    return leaf.grad.flatten().tolist()


# --- aggregation ---------------------------------------------------------------------------

# A ragged batch: 3 trained tokens in the first sequence, 1 in the second, none in the
# third; what is off the mask (a NaN among it) must not count.
PER_TOKEN = [[1.0, 2.0, 3.0, NAN], [4.0, 100.0, 100.0, 100.0], [7.0, 7.0, 7.0, 7.0]]
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "norm", "expected", "grads"),
    [
        # (1 + 2 + 3 + 4) / 4 tokens; each token 1/4
        ("token_mean", 1.0, 2.5, [0.25] * 3 + [0.25]),
        # mean of the sequences' means (6/3 = 2, 4/1 = 4) = 3; tokens 1/(3·2), 1/(1·2)
        ("seq_mean_token_mean", 1.0, 3.0, [1 / 6] * 3 + [0.5]),
        # mean of the sequences' sums (6, 4) = 5; each token 1/2
        ("seq_mean_token_sum", 1.0, 5.0, [0.5] * 3 + [0.5]),
        # Dr. GRPO's constant normaliser 4: (6 + 4) / (2 · 4); each token 1/8
        ("seq_mean_token_sum", 4.0, 1.25, [0.125] * 3 + [0.125]),
    ],
)
def test_aggregation_modes_on_a_ragged_batch(
    mode: str, norm: float, expected: float, grads: list[float]
) -> None:
    per_token = torch.tensor(PER_TOKEN, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.bool)
    loss = aggregate(per_token, mask, mode, norm=norm)  # type: ignore[arg-type]
    assert value(loss) == pytest.approx(expected, rel=1e-12)
    g = grad_of(loss, per_token)
    assert [g[0], g[1], g[2], g[4]] == pytest.approx(grads, rel=1e-12)
    assert g[3] == 0.0 and not any(math.isnan(v) for v in g)  # the NaN off the mask: no gradient

    # the same tokens packed in one row, sequences marked by seq_index
    packed = torch.tensor([[v for r in PER_TOKEN for v in r]], dtype=torch.float64)
    index = torch.tensor([[0] * 4 + [1] * 4 + [2] * 4])
    flat_mask = torch.tensor([[v for r in MASK for v in r]], dtype=torch.bool)
    assert value(aggregate(packed, flat_mask, mode, seq_index=index, norm=norm)) == pytest.approx(expected)  # type: ignore[arg-type]


def test_an_empty_mask_gives_zero_with_a_gradient() -> None:
    per_token = torch.tensor([[1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        loss = aggregate(per_token, torch.zeros(1, 2, dtype=torch.bool), mode)  # type: ignore[arg-type]
        assert value(loss) == 0.0
    assert grad_of(loss, per_token) == [0.0, 0.0]
    with pytest.raises(ValueError, match="allowed: token_mean, seq_mean_token_mean, seq_mean_token_sum"):
        aggregate(per_token, ones(2), "sum")  # type: ignore[arg-type]


# --- plain policy gradient -------------------------------------------------------------


def test_pg_is_reinforce_with_the_advantage() -> None:
    lp = logs(0.5, 0.25, 0.2, grad=True)
    adv = row(1.0, 1.0, -2.0)
    loss, metrics = policy_loss(lp, None, adv, ones(3))
    # -(1·log 0.5 + 1·log 0.25 - 2·log 0.2) / 3
    assert value(loss) == pytest.approx(-(math.log(0.5) + math.log(0.25) - 2 * math.log(0.2)) / 3)
    assert grad_of(loss, lp) == pytest.approx([-1 / 3, -1 / 3, 2 / 3])  # -A / tokens
    assert metrics["clip_fraction"] == 0.0 and metrics["is_weight_mean"] == 1.0
    assert metrics["tokens"] == 3.0 and "ratio_mean" not in metrics  # no behaviour logprobs given


# --- PPO-clip against the behaviour policy ---------------------------------------------


def test_ppo_clip_zeroes_the_gradient_where_the_clip_takes_over() -> None:
    # ratios 1.5, 1.5, 0.5, 0.5 (0.6/0.4 and 0.2/0.4), advantages +1, -1, +1, -1, eps 0.2
    lp = logs(0.6, 0.6, 0.2, 0.2, grad=True)
    old = logs(0.4, 0.4, 0.4, 0.4)
    adv = row(1.0, -1.0, 1.0, -1.0)
    loss, metrics = policy_loss(lp, old, adv, ones(4), AlgorithmConfig(loss="ppo"))
    # per token: max(-1.5, -1.2) = -1.2 (clipped); max(1.5, 1.2) = 1.5;
    #            max(-0.5, -0.8) = -0.5;           max(0.5, 0.8) = 0.8 (clipped)
    assert value(loss) == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)
    # unclipped tokens: d(-A·r)/d log π = -A·r, over 4 tokens
    assert grad_of(loss, lp) == pytest.approx([0.0, 1.5 / 4, -0.5 / 4, 0.0])
    assert metrics["clip_fraction"] == 0.5
    assert (metrics["ratio_mean"], metrics["ratio_min"], metrics["ratio_max"]) == pytest.approx(
        (1.0, 0.5, 1.5)
    )
    # k3: mean of (r - 1 - log r) = ((0.5 - log 1.5)·2 + (-0.5 - log 0.5)·2) / 4 = log(4/3) / 2
    assert metrics["approx_kl"] == pytest.approx(math.log(4 / 3) / 2)


def test_clip_higher_lets_a_positive_advantage_rise_further() -> None:
    old = logs(0.4)
    adv = row(1.0)
    # ratio 1.25 (0.5 / 0.4): beyond 1 + 0.2, within 1 + 0.28
    symmetric = logs(0.5, grad=True)
    loss, _ = policy_loss(symmetric, old, adv, ones(1), AlgorithmConfig(loss="ppo"))
    assert value(loss) == pytest.approx(-1.2)
    assert grad_of(loss, symmetric) == [0.0]
    higher = logs(0.5, grad=True)
    loss, metrics = policy_loss(higher, old, adv, ones(1), AlgorithmConfig(loss="ppo", eps_high=0.28))
    assert value(loss) == pytest.approx(-1.25)
    assert grad_of(loss, higher) == pytest.approx([-1.25])
    assert metrics["clip_fraction"] == 0.0


def test_dual_clip_bounds_a_negative_advantage() -> None:
    # ratio 4 (0.8 / 0.2), advantage -1: PPO keeps max(4, 1.2) = 4; dual clip c = 3 caps it at 3
    lp = logs(0.8, grad=True)
    per_token, took_over, ratio = ppo_clip_token_loss(lp, logs(0.2), row(-1.0))
    assert value(per_token.sum()) == pytest.approx(4.0)
    assert (took_over.tolist(), ratio.tolist()) == ([[False]], [[pytest.approx(4.0)]])
    assert grad_of(per_token.sum(), lp) == pytest.approx([4.0])  # -A·r
    lp = logs(0.8, grad=True)
    loss, metrics = policy_loss(lp, logs(0.2), row(-1.0), ones(1), AlgorithmConfig(loss="ppo", dual_clip_c=3))
    assert value(loss) == pytest.approx(3.0)
    assert grad_of(loss, lp) == [0.0]
    assert metrics["clip_fraction"] == 1.0


# --- decoupled PPO ---------------------------------------------------------------------

# token 1: μ 0.2, π_prox 0.4 (w = 2), π 0.6 (r = 1.5); token 2: μ 0.2, π_prox 0.1 (w = 0.5),
# π 0.11 (r = 1.1); both advantages +1, eps 0.2
BEHAVIOUR = (0.2, 0.2)
PROXIMAL = (0.4, 0.1)
CURRENT = (0.6, 0.11)


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_behaviour() -> None:
    lp = logs(*CURRENT, grad=True)
    prox = logs(*PROXIMAL, grad=True)  # given with a gradient: the loss must not use it
    loss, metrics = policy_loss(
        lp, logs(*BEHAVIOUR), row(1.0, 1.0), ones(2), AlgorithmConfig(loss="decoupled_ppo"),
        proximal_logprobs=prox,
    )  # fmt: skip
    # token 1: w · max(-1.5, -1.2) = 2 · -1.2 = -2.4 (clipped); token 2: 0.5 · -1.1 = -0.55
    assert value(loss) == pytest.approx((-2.4 - 0.55) / 2)
    assert grad_of(loss, lp) == pytest.approx([0.0, -0.5 * 1.1 / 2])  # -w·A·r / tokens
    assert prox.grad is None  # the proximal policy and the weight are constants
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 1.1) / 2)
    assert metrics["is_weight_mean"] == pytest.approx((2 + 0.5) / 2)
    assert metrics["clip_fraction"] == 0.5


def test_decoupled_ppo_weight_cap_drops_tokens_as_areal_does() -> None:
    lp = logs(*CURRENT, grad=True)
    cfg = AlgorithmConfig(loss="decoupled_ppo", behav_imp_weight_cap=1.5)
    loss, metrics = policy_loss(
        lp, logs(*BEHAVIOUR), row(1.0, 1.0), ones(2), cfg, proximal_logprobs=logs(*PROXIMAL)
    )
    # token 1's w = 2 > 1.5: weight 0, still counted in the denominator
    assert value(loss) == pytest.approx((0.0 - 0.55) / 2)
    assert grad_of(loss, lp) == pytest.approx([0.0, -0.275])
    assert metrics["is_dropped_token_fraction"] == 0.5


def test_decoupled_ppo_with_tis_truncates_the_behaviour_weight() -> None:
    lp = logs(*CURRENT, grad=True)
    cfg = AlgorithmConfig(loss="decoupled_ppo", importance="tis", tis_cap=1.5)
    loss, metrics = policy_loss(
        lp, logs(*BEHAVIOUR), row(1.0, 1.0), ones(2), cfg, proximal_logprobs=logs(*PROXIMAL)
    )
    # token 1's w = min(2, 1.5): 1.5 · -1.2 = -1.8; token 2: 0.5 · -1.1 = -0.55
    assert value(loss) == pytest.approx((-1.8 - 0.55) / 2)
    assert metrics["is_truncated_fraction"] == 0.5 and metrics["is_weight_max"] == pytest.approx(1.5)


# --- truncated importance sampling -----------------------------------------------------


def test_tis_caps_the_ratio_and_detaches_it() -> None:
    # ratios π/μ: 0.6 / 0.2 = 3, capped at C = 2; 0.1 / 0.2 = 0.5, kept
    lp = logs(0.6, 0.1, grad=True)
    old = logs(0.2, 0.2)
    assert truncated_is_weights(lp, old, 2.0).flatten().tolist() == pytest.approx([2.0, 0.5])
    loss, metrics = policy_loss(
        lp, old, row(1.0, 1.0), ones(2), AlgorithmConfig(importance="tis", tis_cap=2.0)
    )
    assert value(loss) == pytest.approx(-(2 * math.log(0.6) + 0.5 * math.log(0.1)) / 2)
    # a detached weight: d(-w·A·log π)/d log π = -w·A, over 2 tokens. (Were w not detached,
    # the second token's would be -0.5·(1 + log 0.1) / 2.)
    assert grad_of(loss, lp) == pytest.approx([-1.0, -0.25])
    assert metrics["is_truncated_fraction"] == 0.5
    assert metrics["ratio_max"] == pytest.approx(3.0)


# --- sequence-level masked importance sampling -----------------------------------------

# three sequences of two tokens, μ = 0.2 everywhere; token ratios
# seq 0: 2 and 1.5 -> product 3 > 2: dropped
# seq 1: 1.2 and 0.9 -> product 1.08: kept
# seq 2: 0.5 and 0.8 -> product 0.4 < 1/2: dropped
MIS_CURRENT = [[0.4, 0.3], [0.24, 0.18], [0.1, 0.16]]


def mis_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor(
        [[math.log(p) for p in r] for r in MIS_CURRENT], dtype=torch.float64, requires_grad=True
    )
    old = torch.full((3, 2), math.log(0.2), dtype=torch.float64)
    return lp, old, torch.ones(3, 2, dtype=torch.float64), torch.ones(3, 2, dtype=torch.bool)


def test_masked_is_drops_exactly_the_out_of_range_sequences() -> None:
    lp, old, adv, mask = mis_batch()
    weights, kept = masked_is_weights(lp, old, mask, upper=2.0)
    assert kept.tolist() == [[False, False], [True, True], [False, False]]
    assert weights.flatten().tolist() == pytest.approx([0, 0, 1.08, 1.08, 0, 0])
    loss, metrics = policy_loss(lp, old, adv, mask, AlgorithmConfig(importance="masked_is", mis_upper=2.0))
    # only sequence 1 trains, weighted by 1.08, over its 2 tokens (the dropped ones leave the denominator)
    assert value(loss) == pytest.approx(-1.08 * (math.log(0.24) + math.log(0.18)) / 2)
    assert grad_of(loss, lp) == pytest.approx([0, 0, -0.54, -0.54, 0, 0])
    assert metrics["is_dropped_sequence_fraction"] == pytest.approx(2 / 3)
    assert metrics["is_weight_mean"] == pytest.approx(1.08)


def test_masked_is_bounds_and_levels() -> None:
    lp, old, _, mask = mis_batch()
    # a lower bound of 0.3 keeps sequence 2 (0.4)
    _, kept = masked_is_weights(lp, old, mask, upper=2.0, lower=0.3)
    assert kept[:, 0].tolist() == [False, True, True]
    # geometric means: sqrt(3) ≈ 1.73, sqrt(1.08) ≈ 1.04, sqrt(0.4) ≈ 0.63: all within [0.5, 2]
    weights, kept = masked_is_weights(lp, old, mask, upper=2.0, level="geometric")
    assert kept.all()
    assert weights[:, 0].tolist() == pytest.approx([math.sqrt(3), math.sqrt(1.08), math.sqrt(0.4)])
    # packed: the same sequences in one row, marked by seq_index
    index = torch.tensor([[0, 0, 1, 1, 2, 2]])
    _, kept = masked_is_weights(
        lp.reshape(1, 6), old.reshape(1, 6), mask.reshape(1, 6), upper=2.0, seq_index=index
    )
    assert kept.tolist() == [[False, False, True, True, False, False]]


def test_masked_is_with_ppo_drops_without_reweighting() -> None:
    lp, old, adv, mask = mis_batch()
    cfg = AlgorithmConfig(loss="ppo", eps_low=0.3, eps_high=0.3, importance="masked_is", mis_upper=2.0)
    loss, _ = policy_loss(lp, old, adv, mask, cfg)
    # sequence 1 alone, ratios 1.2 and 0.9 inside [0.7, 1.3]: -(1.2 + 0.9) / 2, no 1.08 factor
    assert value(loss) == pytest.approx(-(1.2 + 0.9) / 2)
    assert grad_of(loss, lp) == pytest.approx([0, 0, -0.6, -0.45, 0, 0])


def test_ratio_metrics_leave_out_the_dropped_sequences() -> None:
    lp, old, adv, mask = mis_batch()
    cfg = AlgorithmConfig(loss="ppo", eps_low=0.3, eps_high=0.3, importance="masked_is", mis_upper=2.0)
    _, metrics = policy_loss(lp, old, adv, mask, cfg)
    # the trained sequence's ratios are 1.2 and 0.9; the dropped ones' go outside that
    assert (metrics["ratio_min"], metrics["ratio_max"]) == pytest.approx((0.9, 1.2))
    assert metrics["ratio_mean"] == pytest.approx(1.05)


# --- what the composed loss refuses ------------------------------------------------------


def test_missing_inputs_are_refused() -> None:
    lp = logs(0.5, grad=True)
    with pytest.raises(ValueError, match="loss 'ppo' with importance 'none' needs old_logprobs"):
        policy_loss(lp, None, row(1.0), ones(1), AlgorithmConfig(loss="ppo"))
    with pytest.raises(ValueError, match="needs proximal_logprobs"):
        policy_loss(lp, logs(0.5), row(1.0), ones(1), AlgorithmConfig(loss="decoupled_ppo"))
    with pytest.raises(ValueError, match="NaN on trained tokens"):
        policy_loss(lp, row(NAN), row(1.0), ones(1), AlgorithmConfig(loss="ppo"))
    # NaN off the mask is ignored
    loss, _ = policy_loss(
        logs(0.5, 0.5), row(math.log(0.5), NAN), row(1.0, 1.0), torch.tensor([[True, False]]),
        AlgorithmConfig(loss="ppo"),
    )  # fmt: skip
    assert value(loss) == pytest.approx(-1.0)  # ratio 1, advantage 1, one token


@pytest.mark.parametrize("loss_name", ["pg", "ppo"])
def test_nan_advantages_off_the_mask_leave_the_gradient_finite(loss_name: str) -> None:
    lp = logs(0.5, 0.25, grad=True)
    loss, _ = policy_loss(
        lp, logs(0.5, 0.25), row(2.0, NAN), torch.tensor([[True, False]]), AlgorithmConfig(loss=loss_name)
    )
    # d/dlogπ of -A·log π (pg) or -A·π/μ at π = μ (ppo) on the one trained token: -2; 0 off it
    assert grad_of(loss, lp) == pytest.approx([-2.0, 0.0])


def test_pg_without_a_correction_trains_on_unknown_behaviour_logprobs() -> None:
    lp = logs(0.5, grad=True)
    loss, metrics = policy_loss(lp, row(NAN), row(1.0), ones(1), AlgorithmConfig(loss="pg"))
    assert value(loss) == pytest.approx(-math.log(0.5))
    assert "ratio_mean" not in metrics  # nothing to take a ratio against
    with pytest.raises(ValueError, match="importance 'tis' needs them"):
        policy_loss(lp, row(NAN), row(1.0), ones(1), AlgorithmConfig(importance="tis"))


def test_config_names_what_is_wrong() -> None:
    cfg = AlgorithmConfig()
    assert (cfg.advantage, cfg.loss, cfg.importance, cfg.agg) == ("grpo", "pg", "none", "token_mean")
    assert not cfg.needs_behaviour_logprobs and not cfg.needs_proximal_logprobs
    assert AlgorithmConfig(importance="tis").needs_behaviour_logprobs
    assert AlgorithmConfig(loss="decoupled_ppo").needs_proximal_logprobs
    with pytest.raises(ValidationError, match="'pg', 'ppo' or 'decoupled_ppo'"):
        AlgorithmConfig(loss="grpo")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="'token_mean', 'seq_mean_token_mean' or 'seq_mean_token_sum'"):
        AlgorithmConfig(agg="mean")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="importance 'tis' corrects loss 'pg' or 'decoupled_ppo'"):
        AlgorithmConfig(loss="ppo", importance="tis")
    with pytest.raises(ValidationError, match="behav_imp_weight_cap bounds decoupled_ppo"):
        AlgorithmConfig(loss="ppo", behav_imp_weight_cap=5.0)
    with pytest.raises(ValidationError, match="eps_low"):
        AlgorithmConfig(eps_low=1.5)
    with pytest.raises(ValidationError, match="clip_eps"):
        AlgorithmConfig(clip_eps=0.2)  # type: ignore[call-arg]
