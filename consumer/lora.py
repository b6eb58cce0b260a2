"""LoRA on the trainer's side (``algorithm.lora_rank`` > 0): the policy trains a low-rank
adapter (peft) on the linear layers ``algorithm.lora_targets`` name, its base frozen, and
each weight sync sends the adapter's tensors only, a few per cent of the model's bytes at
most (0.3 % for SmolLM2-135M at rank 8 on the attention projections).

What travels, per adapted layer ``P`` (its name in the base model, e.g.
``model.layers.0.self_attn.q_proj``): ``P.lora_A`` (rank x in) and ``P.lora_B`` (out x
rank) with LoRA's scale (alpha / rank) folded into B, so that the layer's weight is
``P.weight + P.lora_B @ P.lora_A``. An engine applies that to the weights it loaded from
the model's directory (producer/engines/hf_weights.py: ``merge_adapters``), every sync
from the same base, so an engine that restarts or missed a step needs only the latest.
"""

from __future__ import annotations

from typing import Any

from rollstream.shared.transports import LORA_A, LORA_B

_PEFT_PREFIX = "base_model.model."


def apply_lora(model: Any, rank: int, alpha: int, targets: list[str]) -> Any:
    """``model`` with a LoRA adapter of ``rank`` on ``targets``, only the adapter trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError(f"algorithm.lora_rank > 0 trains a LoRA adapter: pip install peft ({exc})") from exc
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    return get_peft_model(model, config)


def adapter_tensors(model: Any) -> dict[str, Any]:
    """The adapter of a peft ``model`` as engines read it: ``P.lora_A`` and ``P.lora_B``
    (scale folded in) by each adapted layer's name in the base model."""
    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        layer = name.removeprefix(_PEFT_PREFIX)
        scale = module.scaling["default"]
        out[layer + LORA_A] = module.lora_A["default"].weight.detach()
        out[layer + LORA_B] = (module.lora_B["default"].weight.detach() * scale).contiguous()
    return out
