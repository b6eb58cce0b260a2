"""Policy losses for a trainer on rollstream's batches, and the config that picks one.

Needs torch (the hf extra) to compute; torch is imported when a function here runs, so
``AlgorithmConfig`` is importable (and validates settings) without it.

Every tensor argument is per token, of one shape ([B, T] padded or [1, N] packed, as
``consumer.tensors`` lays a batch out): ``logprobs`` of the current policy (with
gradient), ``old_logprobs`` the behaviour policy's, recorded by the engine that
sampled the token (``TokenBatch.old_logprobs``), ``advantages`` (the sample's, per
token) and ``loss_mask`` (True on trained tokens). Values off the mask are ignored,
NaN included. Notation below: π the current policy, μ the behaviour policy, π_prox a
proximal policy, A the advantage, r the ratio of the loss.

The objectives (``loss``):

- ``pg``: REINFORCE with the advantage, ``-A · log π`` per token. On-policy it is the
  policy gradient; on stale data it is biased unless an ``importance`` correction
  reweights it.
- ``ppo``: PPO-clip with the behaviour policy as the old policy (no recomputation):
  ``max(-A·r, -A·clip(r, 1 - eps_low, 1 + eps_high))`` with ``r = π / μ``. Separate
  ``eps_low`` / ``eps_high`` give DAPO's "clip-higher" (eps_high 0.28); ``dual_clip_c``
  (> 1) adds dual-clip PPO's bound ``-A·c`` on negative advantages (Ye et al.,
  verl's ``clip_ratio_c``).
- ``decoupled_ppo``: AReaL's decoupled PPO objective (Fu et al., "AReaL: A Large-Scale
  Asynchronous Reinforcement Learning System for Language Reasoning"): the clip is taken
  against a proximal policy (``proximal_logprobs``, recomputed by the trainer with the
  weights it has just before the update), ``r = π / π_prox``, and the loss is
  multiplied by the behaviour importance weight ``w = π_prox / μ``, detached. As in
  AReaL's ``behav_imp_weight_cap``, tokens whose w exceeds the cap get weight 0 (they
  still count in the loss's denominator). With one update per batch π equals π_prox at
  the step, so the clip is inactive and the loss is a w-weighted policy gradient; with
  several updates per batch the clip bounds the later ones.

The behaviour corrections (``importance``), of the ratio ``ρ = π_ref / μ`` (π_ref the
current policy, detached, for ``pg`` and ``ppo``; π_prox for ``decoupled_ppo``):

- ``none``: ``pg`` and ``ppo`` use weight 1, ``decoupled_ppo`` its w above.
- ``tis``: truncated importance sampling, per token ``min(ρ_t, tis_cap)``, detached:
  the TIS of Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (verl's rollout correction, mode "truncate", level "token"). Not with
  ``ppo``: its ratio already is π/μ.
- ``masked_is``: sequence-level masked importance sampling, as in verl's rollout
  correction (mode "mask"; Liu, Li et al., "When Speed Kills Stability: Demystifying RL
  Collapse from the Training-Inference Mismatch"): the sequence ratio
  ``ρ_s = exp(Σ_t log ρ_t)`` over the sequence's trained tokens (``mis_level
  "geometric"``: ``exp(mean_t log ρ_t)``); a sequence with ``ρ_s`` outside
  ``[mis_lower, mis_upper]`` (bounds included; ``mis_lower`` defaults to
  ``1 / mis_upper``) is dropped: left out of the loss and of its denominators. A kept
  sequence's tokens are weighted by ``ρ_s`` (detached) for ``pg`` and
  ``decoupled_ppo``; for ``ppo`` the drop alone applies, its ratio already being π/μ.

Log-ratios are clamped to [-20, 20] before ``exp`` (as verl does), so a token the
current policy finds far likelier or unlikelier than μ does not overflow.

μ is what the engines record: the sampled token's logprob under the model's own
distribution, before temperature and top-p (vLLM's "raw" logprobs; the hf and sim
engines alike), and ``consumer.tensors.token_logprobs`` computes π the same way. The
ratios above therefore measure how far the weights have moved (staleness, and any
numerical mismatch between engine and trainer), not the sampler's shaping: with a
temperature other than 1 or top-p < 1 they are not the ratio to the distribution the
tokens were drawn from. verl divides the logits by the temperature instead; rollstream
keeps both sides untempered so that the recorded and the recomputed values agree.

Aggregation (``agg``) of the per-token losses ℓ over the trained tokens:

- ``token_mean``: ``Σ ℓ / number of tokens`` in the batch (DAPO's token-level loss);
- ``seq_mean_token_mean``: the mean over sequences of each sequence's token mean (the
  original GRPO);
- ``seq_mean_token_sum``: ``Σ ℓ / (number of sequences · agg_norm)``: each sequence's
  token sum, averaged over sequences, with a constant normaliser (Dr. GRPO sets it to
  the generation budget, max_tokens; 1 by default).

A sequence counts when it has at least one trained token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeAlias, get_args

from rollstream.shared.algorithm_settings import (
    Aggregation,
    AlgorithmSettings,
    ImportanceCorrection,
    PolicyLoss,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "AGGREGATIONS",
    "IMPORTANCE_CORRECTIONS",
    "POLICY_LOSSES",
    "AlgorithmConfig",
    "LossSums",
    "aggregate",
    "aggregate_terms",
    "aggregation_count",
    "divisor",
    "masked_is_weights",
    "pg_token_loss",
    "policy_loss",
    "policy_loss_part",
    "ppo_clip_token_loss",
    "truncated_is_weights",
]

POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)
IMPORTANCE_CORRECTIONS: tuple[str, ...] = get_args(ImportanceCorrection)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)

LOG_RATIO_LIMIT = 20.0


# The config is shared/settings.py's ``algorithm`` block (so that a run's settings carry
# it and shared imports no consumer code); consumer code calls it AlgorithmConfig.
AlgorithmConfig: TypeAlias = AlgorithmSettings


# --- building blocks ---------------------------------------------------------------------


def _exp_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()


def _sequences(like: torch.Tensor, seq_index: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Each position's sequence and the number of sequences: rows of a [B, T] tensor, or
    ``seq_index`` (``TokenBatch.seq_index``) for any layout."""
    import torch

    if seq_index is None:
        if like.dim() != 2:
            raise ValueError(
                f"without seq_index every row is a sequence: need [B, T], got {tuple(like.shape)}"
            )
        index = torch.arange(like.shape[0], device=like.device)[:, None].expand_as(like)
        return index, like.shape[0]
    if seq_index.shape != like.shape:
        raise ValueError(f"seq_index has shape {tuple(seq_index.shape)}, the tokens {tuple(like.shape)}")
    return seq_index, (int(seq_index.max()) + 1 if seq_index.numel() else 0)


def _segment_sum(values: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    return values.new_zeros(count).index_add(0, index.reshape(-1), values.reshape(-1))


def aggregate_terms(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: Aggregation = "token_mean",
    *,
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """``aggregate``'s numerator (with gradient) and the count its divisor is made of
    (trained tokens for token_mean, sequences with a trained token for the seq_mean
    modes), apart: both add up over a batch's micro-batches split by sequence, so their
    sums divided (``divisor``) are the whole batch's loss."""
    import torch

    mask = loss_mask.bool()
    counted = aggregation_count(mask, mode, seq_index=seq_index)
    values = torch.where(mask, per_token, torch.zeros_like(per_token))
    if mode == "token_mean":
        return values.sum(), counted
    index, count = _sequences(values, seq_index)
    sums = _segment_sum(values, index, count)
    if mode == "seq_mean_token_mean":
        tokens = _segment_sum(mask.to(values.dtype), index, count)
        return (sums / tokens.clamp(min=1)).sum(), counted
    return sums.sum(), counted


def aggregation_count(
    loss_mask: torch.Tensor, mode: Aggregation = "token_mean", *, seq_index: torch.Tensor | None = None
) -> float:
    """The count ``aggregate``'s divisor is made of: the tokens on ``loss_mask`` for
    token_mean, the sequences with one for the seq_mean modes."""
    mask = loss_mask.bool()
    if mode == "token_mean":
        return float(mask.sum())
    if mode not in AGGREGATIONS:
        raise ValueError(f"agg is {mode!r}; allowed: {', '.join(AGGREGATIONS)}")
    index, count = _sequences(mask, seq_index)
    return float((_segment_sum(mask.float(), index, count) > 0).sum())


def divisor(mode: Aggregation, count: float, norm: float = 1.0) -> float:
    """What ``aggregate`` divides its numerator by, from ``aggregate_terms``' count: at
    least 1, times ``norm`` for seq_mean_token_sum."""
    return max(count, 1.0) * (norm if mode == "seq_mean_token_sum" else 1.0)


def aggregate(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: Aggregation = "token_mean",
    *,
    seq_index: torch.Tensor | None = None,
    norm: float = 1.0,
) -> torch.Tensor:
    """The scalar loss from per-token losses over ``loss_mask`` (see the module
    docstring); 0 (with a gradient of zeros) when the mask is empty."""
    numerator, count = aggregate_terms(per_token, loss_mask, mode, seq_index=seq_index)
    return numerator / divisor(mode, count, norm)


def pg_token_loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE per token: ``-A · log π`` (the advantage is a constant)."""
    return -advantages.detach() * logprobs


def ppo_clip_token_loss(
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip per token against ``anchor_logprobs`` (μ for PPO, π_prox for decoupled
    PPO): ``max(-A·r, -A·clip(r, 1 - eps_low, 1 + eps_high))``, ``r = π / anchor``; with
    ``dual_clip_c``, ``min(that, -A·c)`` where A < 0. Returns the per-token loss, where
    a clip took over (no gradient there) and r (detached)."""
    import torch

    adv = advantages.detach()
    ratio = _exp_ratio(logprobs - anchor_logprobs.detach())
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    took_over = clipped > unclipped
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        took_over = took_over | dual
    return loss, took_over, ratio.detach()


def truncated_is_weights(
    ref_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """TIS weights ``min(π_ref / μ, cap)`` per token, detached."""
    return _exp_ratio(ref_logprobs.detach() - behaviour_logprobs.detach()).clamp(max=cap)


def masked_is_weights(
    ref_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    upper: float,
    lower: float | None = None,
    level: Literal["sequence", "geometric"] = "sequence",
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level masked IS: per token, its sequence's ratio ``ρ_s`` (product of
    π_ref / μ over the sequence's masked tokens; the geometric mean with level
    "geometric"), detached, and whether the sequence is kept (``lower ≤ ρ_s ≤ upper``,
    ``lower`` 1 / ``upper`` by default). Dropped sequences have weight 0."""
    import torch

    mask = loss_mask.bool()
    log_ratio = torch.where(
        mask, ref_logprobs.detach() - behaviour_logprobs.detach(), torch.zeros_like(ref_logprobs)
    )
    index, count = _sequences(log_ratio, seq_index)
    log_seq = _segment_sum(log_ratio, index, count)
    if level == "geometric":
        log_seq = log_seq / _segment_sum(mask.to(log_ratio.dtype), index, count).clamp(min=1)
    low = math.log(1.0 / upper if lower is None else lower)
    kept = (log_seq >= low) & (log_seq <= math.log(upper))
    weight = torch.where(kept, log_seq, torch.zeros_like(log_seq)).exp() * kept
    return weight[index], kept[index]


# --- the composed loss -------------------------------------------------------------------


@dataclass(slots=True)
class LossSums:
    """A batch's loss and metrics as what adds up over its micro-batches (split by
    sequence): the aggregation's numerator and count (``aggregate_terms``), each mean's
    sum and count, each extreme. ``add`` takes in another micro-batch's; ``metrics`` are
    then the whole batch's, as ``policy_loss`` reports them for it in one pass."""

    numerator: float = 0.0
    count: float = 0.0
    tokens: float = 0.0
    means: dict[str, list[float]] = field(default_factory=dict)  # name: [sum, count]
    extremes: dict[str, tuple[bool, float | None]] = field(default_factory=dict)  # name: (largest, value)

    def mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        self.means[name] = [float(values[mask].sum()), float(mask.sum())]

    def extreme(self, name: str, values: torch.Tensor, mask: torch.Tensor, largest: bool) -> None:
        chosen = values[mask]
        found = None if not chosen.numel() else float(chosen.max() if largest else chosen.min())
        self.extremes[name] = (largest, found)

    def add(self, other: LossSums) -> None:
        self.numerator += other.numerator
        self.count += other.count
        self.tokens += other.tokens
        for name, (total, count) in other.means.items():
            mine = self.means.setdefault(name, [0.0, 0.0])
            mine[0] += total
            mine[1] += count
        for name, (largest, found) in other.extremes.items():
            mine_found = self.extremes.get(name, (largest, None))[1]
            if mine_found is not None and found is not None:
                found = max(mine_found, found) if largest else min(mine_found, found)
            self.extremes[name] = (largest, found if found is not None else mine_found)

    def loss(self, config: AlgorithmConfig) -> float:
        return self.numerator / divisor(config.agg, self.count, config.agg_norm)

    def metrics(self, config: AlgorithmConfig) -> dict[str, float]:
        """Means over their counts (0 where none), extremes (0 where no token), the
        trained tokens and the loss."""
        out = {name: total / count if count else 0.0 for name, (total, count) in self.means.items()}
        out.update({name: 0.0 if found is None else found for name, (_, found) in self.extremes.items()})
        out["tokens"] = self.tokens
        out["loss"] = self.loss(config)
        return dict(sorted(out.items()))


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: AlgorithmConfig | None = None,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss ``config`` selects (objective × behaviour correction × aggregation) and
    its metrics.

    ``old_logprobs`` (μ) may be None, or NaN on trained tokens (``consumer.tensors`` puts
    NaN where the engine recorded none), only for ``pg`` without a correction;
    ``proximal_logprobs`` is required by ``decoupled_ppo``; ``seq_index`` marks
    sequences in a packed layout (rows are sequences without it).

    Metrics, over the trained tokens: ``loss``; ``tokens``; ``ratio_mean`` /
    ``ratio_min`` / ``ratio_max`` of the loss's ratio (π/μ for pg and ppo, π/π_prox for
    decoupled_ppo; absent for pg without μ); ``approx_kl``, KL(anchor ‖ π) by the k3
    estimator ``(r - 1) - log r`` (Schulman, "Approximating KL Divergence");
    ``clip_fraction``, the tokens where a clip took over (0 for pg); ``is_weight_mean``
    / ``is_weight_max``, the behaviour weights applied (1 without any); and, by
    correction, ``is_truncated_fraction`` (tis: tokens capped),
    ``is_dropped_sequence_fraction`` (masked_is) or ``is_dropped_token_fraction``
    (behav_imp_weight_cap).
    """
    cfg = config if config is not None else AlgorithmConfig()
    numerator, sums = policy_loss_part(
        logprobs, old_logprobs, advantages, loss_mask, cfg, proximal_logprobs=proximal_logprobs,
        seq_index=seq_index,
    )  # fmt: skip
    return numerator / divisor(cfg.agg, sums.count, cfg.agg_norm), sums.metrics(cfg)


def policy_loss_part(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: AlgorithmConfig | None = None,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """``policy_loss`` of one micro-batch of a batch split by sequence, as parts: the
    aggregation's numerator (with gradient) and the ``LossSums`` that add up to the whole
    batch's. Every term but the aggregation's divisor is a sequence's own (masked IS's
    ratio included), so backpropagating each micro-batch's numerator and dividing the
    summed gradient by the whole batch's divisor gives the whole batch's gradient: the
    divisor is only known once every micro-batch has run (masked IS drops sequences out
    of it). Arguments as ``policy_loss``'s."""
    import torch

    cfg = config if config is not None else AlgorithmConfig()
    mask = loss_mask.bool()
    zeros = torch.zeros_like(logprobs)
    # masked before any product: a NaN off the mask times the 0 gradient torch.where
    # hands back would still be NaN in the backward pass
    adv = torch.where(mask, advantages.detach().to(logprobs.dtype), zeros)
    behaviour = None
    if old_logprobs is not None:
        behaviour = torch.where(mask, old_logprobs.detach().to(logprobs.dtype), zeros)
        if bool(torch.isnan(behaviour).any()):
            if cfg.needs_behaviour_logprobs:
                raise ValueError(
                    "old_logprobs has NaN on trained tokens: the behaviour logprobs are missing "
                    f"(an engine that recorded none), and loss {cfg.loss!r} with importance "
                    f"{cfg.importance!r} needs them"
                )
            behaviour = None  # pg without a correction: trained without them, no ratio metrics
    if behaviour is None and cfg.needs_behaviour_logprobs:
        raise ValueError(
            f"loss {cfg.loss!r} with importance {cfg.importance!r} needs old_logprobs: the behaviour "
            "logprobs the engines recorded per token"
        )
    proximal = None
    if cfg.needs_proximal_logprobs:
        if proximal_logprobs is None:
            raise ValueError(
                "loss 'decoupled_ppo' needs proximal_logprobs: the logprobs recomputed before the update"
            )
        proximal = torch.where(mask, proximal_logprobs.detach().to(logprobs.dtype), zeros)
    current = torch.where(mask, logprobs.detach(), zeros)
    ref = proximal if proximal is not None else current  # where the behaviour correction leads
    sums = LossSums(tokens=float(mask.sum()))

    weight = torch.ones_like(logprobs)
    trained = mask
    if cfg.importance == "tis":
        assert behaviour is not None
        raw = _exp_ratio(ref - behaviour)
        weight = raw.clamp(max=cfg.tis_cap)
        sums.mean("is_truncated_fraction", (raw > cfg.tis_cap).float(), mask)
    elif cfg.importance == "masked_is":
        assert behaviour is not None
        seq_weight, kept = masked_is_weights(
            ref, behaviour, mask, upper=cfg.mis_upper, lower=cfg.mis_lower, level=cfg.mis_level,
            seq_index=seq_index,
        )  # fmt: skip
        trained = mask & kept
        if cfg.loss != "ppo":
            weight = seq_weight
        index, count = _sequences(mask, seq_index)
        present = _segment_sum(mask.float(), index, count) > 0
        dropped = _segment_sum((mask & ~kept).float(), index, count) > 0
        sums.means["is_dropped_sequence_fraction"] = [float(dropped.sum()), float(present.sum())]
    elif proximal is not None:  # decoupled PPO's own behaviour weight π_prox / μ
        assert behaviour is not None
        weight = _exp_ratio(proximal - behaviour)
        if cfg.behav_imp_weight_cap is not None:
            over = weight > cfg.behav_imp_weight_cap
            weight = torch.where(over, zeros, weight)
            sums.mean("is_dropped_token_fraction", over.float(), mask)

    anchor = proximal if proximal is not None else behaviour
    if cfg.loss == "pg":
        per_token = pg_token_loss(logprobs, adv)
        took_over = torch.zeros_like(mask)
        ratio = None if anchor is None else _exp_ratio(current - anchor)
    else:
        assert anchor is not None
        per_token, took_over, ratio = ppo_clip_token_loss(
            logprobs, anchor, adv, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c
        )
    per_token = per_token * weight.detach()
    numerator, sums.count = aggregate_terms(per_token, trained, cfg.agg, seq_index=seq_index)
    sums.numerator = float(numerator.detach())
    if ratio is not None:  # over the tokens trained (masked IS's dropped sequences left out)
        sums.mean("ratio_mean", ratio, trained)
        sums.extreme("ratio_min", ratio, trained, largest=False)
        sums.extreme("ratio_max", ratio, trained, largest=True)
        sums.mean("approx_kl", ratio - 1 - ratio.log(), trained)
    sums.mean("clip_fraction", took_over.float(), trained)
    sums.mean("is_weight_mean", weight, trained)
    sums.extreme("is_weight_max", weight, trained, largest=True)
    return numerator, sums
