"""Runs inside vLLM's worker processes (``worker_extension_cls``): reload the weights a
trainer published as a directory of safetensors, in place, between engine steps.

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


def published_weights(path: str, ties: bool) -> Iterator[tuple[str, Any]]:
    """The weights a trainer published at ``path`` (a directory, or another transport's
    URI, shared/transports.py): through a directory's Hugging Face index when it has
    one (the file transport's: a step that changed only some tensors points into
    earlier steps' directories for the rest, so the files of this directory alone are
    not the model), else every ``*.safetensors`` in it; the embeddings again as
    ``lm_head.weight`` as ``tied_weights`` does."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(path)
    if parts.scheme == "file":
        path = unquote(parts.path)
    elif parts.scheme:  # another transport (collective://; ray:// needs Ray in this process)
        from rollstream.shared.transports import receive

        tensors = dict(receive(path, {}))
    if parts.scheme in ("", "file"):
        if not (Path(path) / "model.safetensors.index.json").is_file():
            yield from tied_weights(checkpoint_files(path), ties)
            return
        from rollstream.shared.transports import receive_file

        tensors = dict(receive_file(path, {}))
    yield from tensors.items()
    embeddings = [n for n in tensors if n.endswith(EMBEDDINGS_SUFFIX)]
    if ties and LM_HEAD not in tensors and len(embeddings) == 1:
        yield LM_HEAD, tensors[embeddings[0]]


class WeightReloader:
    """Mixed into vLLM's worker class; called through ``collective_rpc``."""

    def rollstream_reload_weights(self, path: str) -> int:
        """Load the weights at ``path`` in place; returns how many tensors were read."""
        worker: Any = self
        hf_config = worker.model_runner.model_config.hf_config
        ties = bool(getattr(hf_config, "tie_word_embeddings", False))
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in published_weights(path, ties):
                count += 1
                yield item

        worker.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        log.info("reloaded %d tensors from %s (tied embeddings: %s)", count, path, ties)
        return count
