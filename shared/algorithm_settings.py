"""The loss family's settings (``algorithm.*``): the trainer-side algorithm of a run,
which consumer/advantages.py and consumer/losses.py implement. shared/settings.py
composes the model into the settings tree.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "AdvantageEstimator",
    "Aggregation",
    "AlgorithmSettings",
    "ImportanceCorrection",
    "PolicyLoss",
    "StdKind",
]


# The trainer-side algorithm's names live here, not in consumer/, so that settings validate
# without torch and shared imports neither side: consumer.advantages and consumer.losses
# take them from here (consumer/losses.py's docstring says what each choice does).
AdvantageEstimator: TypeAlias = Literal["grpo", "dr_grpo", "rloo"]
StdKind: TypeAlias = Literal["unbiased", "population"]
PolicyLoss: TypeAlias = Literal["pg", "ppo", "decoupled_ppo"]
ImportanceCorrection: TypeAlias = Literal["none", "tis", "masked_is"]
Aggregation: TypeAlias = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


class AlgorithmSettings(BaseModel):
    """The trainer-side algorithm of a run (``consumer.losses.AlgorithmConfig``): advantage
    estimator, policy loss, behaviour correction, aggregation and their knobs, and how the
    reference trainer runs a step (micro-batches, LoRA). The defaults are GRPO advantages
    with a token-mean policy gradient, the whole batch in one pass."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    advantage: AdvantageEstimator = "grpo"
    adv_std: StdKind = Field(default="unbiased", description="grpo: the std's divisor, n - 1 or n")
    adv_eps: float = Field(default=1e-6, ge=0, description="grpo: (r - mean) / (std + adv_eps)")
    loss: PolicyLoss = "pg"
    eps_low: float = Field(default=0.2, gt=0, lt=1, description="ppo clip: r >= 1 - eps_low")
    eps_high: float = Field(default=0.2, gt=0, description="ppo clip: r <= 1 + eps_high (DAPO: 0.28)")
    dual_clip_c: float | None = Field(default=None, gt=1, description="dual-clip bound on A < 0")
    behav_imp_weight_cap: float | None = Field(
        default=None, gt=1, description="decoupled_ppo: tokens whose π_prox/μ exceeds it get weight 0"
    )
    importance: ImportanceCorrection = "none"
    tis_cap: float = Field(default=2.0, gt=0, description="tis: the cap C of min(π/μ, C)")
    mis_upper: float = Field(default=2.0, gt=1, description="masked_is: drop a sequence above it")
    mis_lower: float | None = Field(
        default=None, gt=0, lt=1, description="masked_is: drop a sequence below it (1 / mis_upper)"
    )
    mis_level: Literal["sequence", "geometric"] = "sequence"
    agg: Aggregation = "token_mean"
    agg_norm: float = Field(default=1.0, gt=0, description="seq_mean_token_sum's constant divisor")
    micro_batch_size: int = Field(
        default=0,
        ge=0,
        description="samples per forward and backward pass of the reference trainer's step (gradient "
        "accumulation: the same update as the whole batch's, with one micro-batch's activations in memory); "
        "0: the whole batch in one pass",
    )
    lora_rank: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="0: train every weight; r > 0: train a LoRA adapter of rank r (peft) on lora_targets, "
        "the base frozen, and send the engines the adapter's tensors only (hf and vllm engines merge them)",
    )
    lora_alpha: int = Field(default=16, ge=1, description="LoRA's scale is lora_alpha / lora_rank")
    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="the linear layers (by their last name) that carry the adapter",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmSettings:
        if self.loss == "ppo" and self.importance == "tis":
            raise ValueError(
                "importance 'tis' corrects loss 'pg' or 'decoupled_ppo': loss 'ppo' already "
                "weights each token by π/μ (its clipped ratio); use importance 'none' or 'masked_is'"
            )
        if self.behav_imp_weight_cap is not None and (
            self.loss != "decoupled_ppo" or self.importance != "none"
        ):
            raise ValueError(
                "behav_imp_weight_cap bounds decoupled_ppo's behaviour weight: it needs loss "
                f"'decoupled_ppo' and importance 'none' (got loss {self.loss!r}, importance "
                f"{self.importance!r}; 'tis' and 'masked_is' bound the weight their own way)"
            )
        return self

    @property
    def needs_behaviour_logprobs(self) -> bool:
        """Whether the loss uses the logprobs the engines recorded."""
        return self.loss != "pg" or self.importance != "none"

    @property
    def needs_proximal_logprobs(self) -> bool:
        """Whether the trainer must recompute logprobs before the update."""
        return self.loss == "decoupled_ppo"
