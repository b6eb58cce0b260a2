"""New weights for the hf engine (hf.py): read from a transport's URI or a directory of
safetensors, checked against the model, and cast to the engine's dtype, all outside the
decode thread, which then only copies them in between two steps."""

from __future__ import annotations

import torch

from rollstream.producer.engines.base import EngineError
from rollstream.shared.transports import receive


def read_weights(
    uri: str, sources: dict[str, str], params: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors at ``uri`` (a transport's, or a directory of safetensors), checked
    against the model's ``params`` before anything is copied, and where each tensor was
    last read from: ``sources`` with this read's, a copy (a transport reads it to send
    only what changed)."""
    try:
        sources = dict(sources)
        state = dict(receive(uri, sources))
    except EngineError:
        raise
    except Exception as exc:  # a transport's failure, named with its URI
        raise EngineError(f"hf engine: cannot read the weights at {uri!r}: {exc}") from exc
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
