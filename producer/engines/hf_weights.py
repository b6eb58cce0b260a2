"""New weights for the hf engine (hf.py): read from a transport's URI or a directory of
safetensors, checked against the model, and cast to the engine's dtype, all outside the
decode thread, which then only copies them in between two steps."""

from __future__ import annotations

import torch

from rollstream.producer.engines.base import EngineError
from rollstream.shared.transports import LORA_A, LORA_B, receive


def read_weights(
    uri: str,
    sources: dict[str, str],
    params: dict[str, torch.Tensor],
    lora_base: dict[str, torch.Tensor] | None = None,
    staging: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors at ``uri`` (a transport's, or a directory of safetensors), checked
    against the model's ``params`` before anything is copied, and where each tensor was
    last read from: ``sources`` with this read's, a copy (a transport reads it to send
    only what changed). A LoRA adapter among them is merged (``merge_adapters``) into
    the weights ``lora_base`` keeps. ``staging``: the engine's buffers (by name, shaped and
    typed as its parameters) that a transport which copies out of shared memory copies
    into, kept from sync to sync; the caller must not read with the same ``staging``
    twice at once."""
    try:
        sources = dict(sources)
        device = next(iter(params.values())).device if params else None

        def into(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
            param = params.get(name)
            if staging is None or param is None or tuple(param.shape) != shape:
                return None
            if name not in staging:
                staging[name] = torch.empty_like(param)
            return staging[name]

        state = dict(receive(uri, sources, device=device, into=into))
    except EngineError:
        raise
    except Exception as exc:  # a transport's failure, named with its URI
        raise EngineError(f"hf engine: cannot read the weights at {uri!r}: {exc}") from exc
    state = merge_adapters(uri, state, params, {} if lora_base is None else lora_base)
    check_fit(uri, state, params)
    # into the engine's dtype here, outside the decode thread (a bfloat16 engine of a
    # float32 trainer): the copy between two steps then moves half the bytes
    for name, tensor in state.items():
        if tensor.dtype != params[name].dtype:
            state[name] = tensor.to(params[name].dtype)
    return state, sources


def check_fit(uri: str, state: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    """save_pretrained leaves tied weights (lm_head = embeddings) out of the files, so a
    full set may lack them; a set of only the changed tensors may lack any. What it has
    must be the model's names and shapes."""
    unexpected = [k for k in state if k not in params]
    shapes = [k for k in state if k in params and state[k].shape != params[k].shape]
    if unexpected or shapes:
        raise EngineError(
            f"hf engine: weights at {uri!r} do not fit the model: "
            f"unexpected {unexpected[:3]}, other shapes {shapes[:3]}"
        )


def merge_adapters(
    uri: str, state: dict[str, torch.Tensor], params: dict[str, torch.Tensor], base: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state`` with each LoRA adapter in it (``P.lora_A``, ``P.lora_B``: shared/transports.py)
    turned into the weight it makes, ``P.weight`` = the weight as the engine loaded it +
    lora_B @ lora_A. ``base`` keeps those loaded weights, taken the first time a layer's
    adapter comes, so that every sync applies to the same base."""
    adapters = {k for k in state if k.endswith((LORA_A, LORA_B))}
    if not adapters:
        return state
    layers = sorted({k.removesuffix(LORA_A).removesuffix(LORA_B) for k in adapters})
    half = [layer for layer in layers if not {layer + LORA_A, layer + LORA_B} <= adapters]
    absent = [layer for layer in layers if f"{layer}.weight" not in params]
    if half or absent:
        raise EngineError(
            f"hf engine: the LoRA adapter at {uri!r} does not fit the model: "
            f"half an adapter for {half[:3]}, layers the model lacks {absent[:3]}"
        )
    out = {k: v for k, v in state.items() if k not in adapters}
    for layer in layers:
        name = f"{layer}.weight"
        if name not in base:
            base[name] = params[name].detach().to("cpu", copy=True)
        a, b = state[layer + LORA_A].float(), state[layer + LORA_B].float()
        if b.shape[0] != base[name].shape[0] or a.shape[1] != base[name].shape[1] or a.shape[0] != b.shape[1]:
            raise EngineError(
                f"hf engine: the LoRA adapter of {layer} at {uri!r} has shapes {tuple(a.shape)} and "
                f"{tuple(b.shape)}, not those of its weight {tuple(base[name].shape)}"
            )
        out[name] = (base[name].float() + b @ a).to(params[name].dtype)
    return out
