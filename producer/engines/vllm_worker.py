"""Runs inside vLLM's worker processes (``worker_extension_cls``): reload the weights a
trainer published as a directory of safetensors, in place, between engine steps.

A LoRA adapter (only the adapter travels: consumer/lora.py) is merged here, into the
weights of the model the engine started from, read again from its files at each sync,
and the whole model reloaded: the engine then decodes at full speed with no LoRA
kernels, which vLLM's own LoRA support (a LoRARequest per generate, the adapter applied
at every token) would not; one policy needs one adapter, not many.

Why an extension rather than vLLM's own ``reload_weights(weights_path=...)``: a model
whose output projection is tied to its input embeddings is saved without
``lm_head.weight`` (``save_pretrained`` leaves tied copies out), and vLLM's in-place
reload then keeps the *old* lm_head — no error, and greedy output no longer matches
the weights on disk. Here the embeddings are fed a second time under the lm_head's
name whenever the files lack it and the model ties them, so both move together.

This module is imported by vLLM's processes, not by rollstream's: it must import
nothing from vLLM at module level (the worker class mixes it in) and nothing heavy
from rollstream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LM_HEAD = "lm_head.weight"
EMBEDDINGS_SUFFIX = "embed_tokens.weight"  # Llama, Qwen, Mistral, Gemma, ... name them so


def checkpoint_files(path: str) -> list[Path]:
    """The safetensors files of a published weights directory, in order; a clear error
    when there are none."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"weights directory {str(directory)!r} does not exist")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in the weights directory {str(directory)!r}")
    return files


def tied_weights(files: list[Path], ties: bool) -> Iterator[tuple[str, Any]]:
    """Every tensor of the files, one at a time, plus the embeddings again as
    ``lm_head.weight`` when the model ties them and the files have no lm_head."""
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    embeddings = [n for n in names if n.endswith(EMBEDDINGS_SUFFIX)]
    add_head = ties and LM_HEAD not in names and len(embeddings) == 1
    if ties and LM_HEAD not in names and len(embeddings) != 1:
        log.warning(
            "the model ties its lm_head to its embeddings, the files have no %s and %d tensors "
            "named *%s: the lm_head is left to vLLM's own tie, which an in-place reload may not "
            "move (turn on engines.vllm.self_check to catch it)",
            LM_HEAD, len(embeddings), EMBEDDINGS_SUFFIX,
        )  # fmt: skip
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                yield name, handle.get_tensor(name)
    if add_head:
        with safe_open(str(names[embeddings[0]]), framework="pt") as handle:
            yield LM_HEAD, handle.get_tensor(embeddings[0])


def published_weights(path: str, ties: bool, base: str | None = None) -> Iterator[tuple[str, Any]]:
    """The weights a trainer published at ``path`` (a directory, or another transport's
    URI, shared/transports.py): through a directory's Hugging Face index when it has
    one (the file transport's: a step that changed only some tensors points into
    earlier steps' directories for the rest, so the files of this directory alone are
    not the model), else every ``*.safetensors`` in it; the embeddings again as
    ``lm_head.weight`` as ``tied_weights`` does. A LoRA adapter (``algorithm.lora_rank``
    > 0: only the adapter travels) comes out as the whole model of ``base``, the
    directory the engine started from, each adapted weight merged (``merged_adapter``)."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(path)
    if parts.scheme == "file":
        path = unquote(parts.path)
    elif parts.scheme:  # another transport (collective://; ray:// needs Ray in this process)
        from rollstream.shared.transports import receive

        tensors = dict(receive(path, {}))
    if parts.scheme in ("", "file"):
        if not (Path(path) / "model.safetensors.index.json").is_file():
            files = checkpoint_files(path)
            if not any(_is_adapter(name) for name in _names(files)):
                yield from tied_weights(files, ties)
                return
            tensors = dict(tied_weights(files, ties=False))
        else:
            from rollstream.shared.transports import receive_file

            tensors = dict(receive_file(path, {}))
    if any(_is_adapter(name) for name in tensors):
        if base is None:
            raise ValueError(f"the weights at {path!r} are a LoRA adapter, and no base model was named")
        yield from merged_adapter(tensors, base, ties, path)
        return
    yield from tensors.items()
    embeddings = [n for n in tensors if n.endswith(EMBEDDINGS_SUFFIX)]
    if ties and LM_HEAD not in tensors and len(embeddings) == 1:
        yield LM_HEAD, tensors[embeddings[0]]


def _names(files: list[Path]) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names += handle.keys()
    return names


def _is_adapter(name: str) -> bool:
    from rollstream.shared.transports import LORA_A, LORA_B

    return name.endswith((LORA_A, LORA_B))


def merged_adapter(
    tensors: dict[str, Any], base: str, ties: bool, where: str = ""
) -> Iterator[tuple[str, Any]]:
    """The model of the directory ``base`` with the LoRA adapter in ``tensors`` merged:
    ``P.weight`` + ``P.lora_B`` @ ``P.lora_A`` for each adapted layer ``P`` (consumer/lora.py
    folds the scale into B), every other tensor as ``base`` holds it, then any full tensor
    ``tensors`` has besides the adapter (those win). Always from the files of ``base``, so
    every sync applies to the same weights and a restarted engine needs only the latest.
    An adapter that does not fit the model is refused before anything is yielded."""
    from rollstream.shared.transports import LORA_A, LORA_B

    adapters = {k for k in tensors if _is_adapter(k)}
    layers = sorted({k.removesuffix(LORA_A).removesuffix(LORA_B) for k in adapters})
    files = checkpoint_files(base)
    shapes: dict[str, tuple[int, ...]] = {}
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    half = [p for p in layers if not {p + LORA_A, p + LORA_B} <= adapters]
    absent = [p for p in layers if f"{p}.weight" not in shapes]

    def fits(p: str) -> bool:
        a, b = tensors[p + LORA_A].shape, tensors[p + LORA_B].shape
        return len(a) == len(b) == 2 and (b[0], a[1]) == shapes[f"{p}.weight"] and a[0] == b[1]

    wrong = [p for p in layers if p not in half and p not in absent and not fits(p)]
    if half or absent or wrong:
        raise ValueError(
            f"the LoRA adapter at {where!r} does not fit the model of {base!r}: half an adapter "
            f"for {half[:3]}, layers the model lacks {absent[:3]}, other shapes {wrong[:3]}"
        )
    full = {k: v for k, v in tensors.items() if k not in adapters}
    by_weight = {f"{p}.weight": p for p in layers}
    for name, tensor in tied_weights(files, ties):
        if name in full:
            continue
        layer = by_weight.get(name)
        if layer is not None:
            a, b = tensors[layer + LORA_A].float(), tensors[layer + LORA_B].float()
            tensor = (tensor.float() + b @ a).to(tensor.dtype)
        yield name, tensor
    yield from full.items()


class WeightReloader:
    """Mixed into vLLM's worker class; called through ``collective_rpc``."""

    def rollstream_reload_weights(self, path: str) -> int:
        """Load the weights at ``path`` in place; returns how many tensors were read."""
        worker: Any = self
        model_config = worker.model_runner.model_config
        ties = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in published_weights(path, ties, base=str(model_config.model)):
                count += 1
                yield item

        worker.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        log.info("reloaded %d tensors from %s (tied embeddings: %s)", count, path, ties)
        return count
