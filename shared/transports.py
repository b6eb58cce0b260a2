"""Weight transports: how the tensors of a model step go from the trainer to every
engine. The weight-sync event (docs/stream-format.md §5.3) names the step and, in its
``uri``, the transport and where to fetch:

    /path/to/dir  or  file:///path/to/dir     file: safetensors in a directory
    ray://<namespace>/<registry actor>/<key>  ray: buckets in Ray's object store
                                              (shared/transport_ray.py)
    collective://<host>:<port>/<key>          collective: a gloo broadcast from the trainer
                                              (shared/transport_collective.py)
    shm:///dev/shm/...?step=&seq=&token=      shm: a shared-memory file on the trainer's node
                                              (shared/transport_shm.py)

``weights.kind = "auto"`` picks one of them from where the engines are
(shared/transport_auto.py).

A trainer sends with ``sender_for(settings).send(step, tensors)`` and publishes the
URI it returns; an engine reads with ``receive(uri, names)``, which yields
(name, tensor) on the CPU (views of the transport's memory where it can: the engine
copies them into its parameters, the one copy). Tensors not yielded are unchanged
since the last step the engine loaded through the same transport: a transport may
send only what changed, and says so (``base``) so that an engine that missed a step,
or restarted, reads the whole set.

The file transport writes ``<dir>/step-<t>/`` with shards ``model-0000i-of-0000k
.safetensors`` written in parallel (one thread each), the Hugging Face index
``model.safetensors.index.json`` (so the directory is a checkpoint any loader reads,
vLLM's included) and the config files. With ``changed_only`` a step's shards hold only
the tensors modified since the previous send (torch's in-place version counters tell),
and the index maps the others to the shard of an earlier step that holds their
latest value: the index is always the whole model. ``dir`` on /dev/shm (tmpfs) keeps
the bytes in memory when trainer and engines share a node.

torch is imported by the functions that need it: this module is importable without
the hf extra.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field

INDEX = "model.safetensors.index.json"
# A LoRA adapter travels as two tensors per adapted layer P (its name in the base model):
# P.lora_A (rank x in) and P.lora_B (out x rank, LoRA's scale folded in); an engine sets
# P.weight to its loaded weight + lora_B @ lora_A (consumer/lora.py, hf_weights.py)
LORA_A, LORA_B = ".lora_A", ".lora_B"
SHM = Path("/dev/shm")
log = logging.getLogger(__name__)

# safetensors' dtype names, and numpy's for reading them back as bytes of that width
_ST_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


class TransportSettings(BaseModel):
    """How the trainer sends weights (``weights.*``); engines follow the event's URI."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal["file", "ray", "collective", "shm", "auto"] = Field(
        default="file",
        description="file (a directory), ray (object store), collective (gloo broadcast), shm (shared "
        "memory: engines on the trainer's node), auto (shm where it can, else file or collective)",
    )
    dir: str = Field(
        default="",
        description="file: where step directories go; empty: the trainer's output directory",
    )
    shards: int = Field(default=4, ge=1, le=64, description="file: shards written in parallel")
    changed_only: bool = Field(
        default=False,
        description="send only tensors modified since the last send (engines kind hf, vllm; "
        "a step's directory then holds only those, its index the whole model)",
    )
    full_every: int = Field(
        default=20, ge=0, description="every this many sends, a full set (older steps can go); 0: never"
    )
    keep: int = Field(default=3, ge=1, description="steps kept readable (engines still loading one)")
    bucket_mb: int = Field(default=512, ge=1, description="ray, collective: size of one bucket")
    dtype: Literal["", "bfloat16", "float16", "float32"] = Field(
        default="",
        description="floating tensors sent in this dtype (the engines', e.g. bfloat16 from a float32 "
        "trainer: half the bytes); empty: as the trainer holds them",
    )
    address: str = Field(
        default="",
        description="collective: host:port the trainer's rendezvous store listens on, which engines "
        "connect to; empty: 127.0.0.1 and a free port (trainer and engines on one machine)",
    )


# (name, shape, dtype) -> a tensor of that shape to copy it into (any dtype), or None
Into = Callable[[str, tuple[int, ...], Any], Any]


class WeightError(Exception):
    """Weights that cannot be sent or read (named with their URI)."""


class Sender(Protocol):
    def send(self, step: int, tensors: Mapping[str, Any]) -> str:
        """Make ``tensors`` (name -> torch tensor, any device) of ``step`` fetchable;
        returns the URI for the weight-sync event."""
        ...

    def close(self) -> None: ...


def sender_for(
    settings: TransportSettings, out_dir: str, run: str = "", config_files: Mapping[str, str] | None = None
) -> Sender:
    """The trainer's sender for ``weights.kind``."""
    if settings.kind == "ray":
        from rollstream.shared.transport_ray import RaySender

        return RaySender(settings, run)
    if settings.kind == "collective":
        from rollstream.shared.transport_collective import CollectiveSender

        return CollectiveSender(settings)
    if settings.kind == "shm":
        from rollstream.shared.transport_shm import ShmSender

        return ShmSender(settings, run)
    if settings.kind == "auto":
        from rollstream.shared.transport_auto import AutoSender

        return AutoSender(settings, out_dir, run, config_files or {})
    return FileSender(settings, settings.dir or out_dir, config_files or {})


def receive(
    uri: str, sources: dict[str, str] | None = None, device: Any = None, into: Into | None = None
) -> Iterator[tuple[str, Any]]:
    """The tensors at ``uri``, on the CPU (``device``: a GPU the engine holds its weights
    on, which a transport may copy onto straight from its memory: shm; ``into``: where a
    transport that must copy may put a tensor, e.g. an engine's buffers reused from sync
    to sync, in its own dtype: shm). ``sources``: the
    engine's record of where each of its tensors was last read from (updated here); a
    tensor whose source has not changed since is skipped (a step that changed only some
    tensors costs only those).
    An engine that starts, or loads from elsewhere, passes an empty one."""
    sources = {} if sources is None else sources
    scheme = urlsplit(uri).scheme
    if scheme == "ray":
        from rollstream.shared.transport_ray import receive_ray

        return receive_ray(uri, sources)
    if scheme == "collective":
        from rollstream.shared.transport_collective import receive_collective

        return receive_collective(uri, sources)
    if scheme == "shm":
        from rollstream.shared.transport_shm import receive_shm

        return receive_shm(uri, sources, device, into)
    if scheme in ("", "file"):
        return receive_file(uri, sources)
    raise WeightError(
        f"weights at {uri!r}: no transport for the scheme {scheme!r} (file, ray, collective, shm)"
    )


def unique_tensors(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Each tensor once: a tied copy (lm_head = embeddings) under its first name only."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in tensors.items():
        key = (int(t.data_ptr()), t.numel())
        if key in seen and t.numel():
            continue
        seen.add(key)
        out[name] = t
    return out


def tensor_digests(tensors: Mapping[str, Any]) -> dict[str, str]:
    """sha256 of each tensor's bytes (on the CPU, contiguous), by name: whether two holders
    (a trainer and an engine) have the same weights, tensor by tensor, without moving them."""
    import hashlib

    import torch

    out = {}
    for name, t in tensors.items():
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        out[name] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    return out


# --- file --------------------------------------------------------------------------


def _path(uri: str) -> Path:
    parts = urlsplit(uri)
    return Path(unquote(parts.path)) if parts.scheme == "file" else Path(uri)


class FileSender:
    """Step directories of safetensors shards, written in parallel, changed tensors only."""

    def __init__(self, settings: TransportSettings, root: str, config_files: Mapping[str, str]) -> None:
        self.settings = settings
        self.root = Path(root)
        self.config_files = dict(config_files)
        # the index of the last step sent: name -> shard path relative to root
        self._where: dict[str, str] = {}
        self._changes = Changes(settings)
        self._staging = Staging(settings.dtype)
        self._steps: list[int] = []
        self._pool = ThreadPoolExecutor(settings.shards, thread_name_prefix="weights-write")

    def send(self, step: int, tensors: Mapping[str, Any]) -> str:
        directory = self.root / f"step-{step}"
        # the same step again (a trainer redoing it): its directory is written anew, and the
        # index may have pointed into it for tensors this send would not write: a full set
        full, changed = self._changes.select(tensors, force_full=directory.exists())
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        staged = self._staging(changed)
        shards = split(list(staged.items()), self.settings.shards)
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        host = shards
        list(
            self._pool.map(lambda a: write_safetensors(directory / a[0], a[1]), zip(files, host, strict=True))
        )
        where = {} if full else dict(self._where)
        for file, shard in zip(files, shards, strict=True):
            for name, _ in shard:
                where[name] = f"step-{step}/{file}"
        index = {
            "metadata": {
                "total_size": 0,
                "rollstream_step": step,
                "rollstream_base": "full" if full else "delta",
            },
            "weight_map": {name: os.path.relpath(self.root / rel, directory) for name, rel in where.items()},
        }
        for name, text in self.config_files.items():
            (directory / name).write_text(text)
        (directory / INDEX).write_text(json.dumps(index))
        self._where = where
        self._steps.append(step)
        self._forget()
        return str(directory)

    def _forget(self) -> None:
        """Step directories that neither the last ``keep`` steps nor the current index need."""
        keep = set(self._steps[-self.settings.keep :])
        needed = {rel.split("/", 1)[0] for rel in self._where.values()}
        for step in list(self._steps[: -self.settings.keep]):
            name = f"step-{step}"
            if step not in keep and name not in needed:
                shutil.rmtree(self.root / name, ignore_errors=True)
                self._steps.remove(step)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Changes:
    """Which tensors changed since the last send: torch bumps a tensor's version counter at
    every in-place change (an optimizer step), and a tensor replaced has another address.
    Every ``full_every`` sends (and the first), the whole set."""

    def __init__(self, settings: TransportSettings) -> None:
        self.settings = settings
        self._seen: dict[str, tuple[int, int]] = {}  # name -> (data_ptr, version)
        self._sends = 0

    def select(self, tensors: Mapping[str, Any], force_full: bool = False) -> tuple[bool, dict[str, Any]]:
        every = self.settings.full_every
        full = (
            force_full
            or not self.settings.changed_only
            or not self._seen
            or bool(every and self._sends % every == 0)
        )
        changed = {n: t for n, t in tensors.items() if full or self._seen.get(n) != _identity(t)}
        self._seen = {n: _identity(t) for n, t in tensors.items()}
        self._sends += 1
        return full, changed


def _identity(t: Any) -> tuple[int, int]:
    return (int(t.data_ptr()), int(t._version))


def to_host(t: Any) -> Any:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu", non_blocking=False)
    return t.contiguous()


class Staging:
    """Device tensors copied to pinned host buffers, reused from send to send, with one
    synchronisation for all: ``.cpu()`` into pageable memory ran at 1.2 GB/s on an H200,
    a pinned copy at 54 GB/s. Host tensors pass through as they are (no copy)."""

    def __init__(self, dtype: str = "") -> None:
        self._buffers: dict[str, Any] = {}
        self.dtype = dtype  # floating tensors sent in this dtype ("": their own)

    def __call__(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}
        devices = set()
        target = getattr(torch, self.dtype) if self.dtype else None
        for name, t in tensors.items():
            t = t.detach()
            if target is not None and t.is_floating_point() and t.dtype != target:
                t = t.to(target)  # on the device: half the bytes to move from there on
            if t.device.type == "cpu":
                out[name] = t.contiguous()
                continue
            buffer = self._buffers.get(name)
            if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
                buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self._buffers[name] = buffer
            buffer.copy_(t, non_blocking=True)
            devices.add(t.device)
            out[name] = buffer
        for device in devices:
            torch.cuda.synchronize(device)
        return out


def split(items: list[tuple[str, Any]], count: int) -> list[list[tuple[str, Any]]]:
    """Tensors into at most ``count`` shards of about equal bytes (largest first)."""
    shards: list[list[tuple[str, Any]]] = [[] for _ in range(min(count, max(1, len(items))))]
    sizes = [0] * len(shards)
    for name, t in sorted(items, key=lambda kv: -kv[1].numel() * kv[1].element_size()):
        i = sizes.index(min(sizes))
        shards[i].append((name, t))
        sizes[i] += t.numel() * t.element_size()
    return [s for s in shards if s] or [[]]


def write_safetensors(path: Path, tensors: list[tuple[str, Any]]) -> None:
    """One safetensors file, each tensor's bytes written straight from its memory (no
    serialised copy in between, the GIL released while the kernel copies)."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    views = []
    for name, t in tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        views.append(t.reshape(-1).view(torch.uint8).numpy() if nbytes else b"")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for view in views:
            out.write(memoryview(view))


def read_safetensors(path: Path) -> Iterator[tuple[str, Any]]:
    """The tensors of one safetensors file as views of its memory map (read-only)."""
    import warnings

    import torch

    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    (length,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(bytes(mapped[8 : 8 + length]))
    header.pop("__metadata__", None)
    start = 8 + length
    names = {v: k for k, v in _ST_DTYPES.items()}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = getattr(torch, names[info["dtype"]])
        if end == begin:
            yield name, torch.empty(info["shape"], dtype=dtype)
            continue
        with warnings.catch_warnings():  # a read-only map: the engine only copies from it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=start + begin)
        yield name, flat.view(dtype).reshape(info["shape"])


def receive_file(uri: str, sources: dict[str, str]) -> Iterator[tuple[str, Any]]:
    """A step directory: by its index (which may point into earlier steps' directories)
    or every ``*.safetensors`` in it."""
    directory = _path(uri)
    index = directory / INDEX
    files: dict[Path, set[str] | None] = {}
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        for name, rel in weight_map.items():
            file = (directory / rel).resolve()
            if sources.get(name) != str(file):
                files.setdefault(file, set()).add(name)  # type: ignore[union-attr]
    else:
        shards = sorted(directory.glob("*.safetensors"))
        if not shards:
            raise WeightError(f"no *.safetensors in {str(directory)!r}")
        files = {shard.resolve(): None for shard in shards}
    for file, names in files.items():
        for name, t in read_safetensors(file):
            if names is None or name in names:
                sources[name] = str(file)
                yield name, t


def default_dir(run: str) -> str:
    """/dev/shm/rollstream/<run> when there is a tmpfs, else empty (the trainer's own)."""
    return str(SHM / "rollstream" / run) if SHM.is_dir() and os.access(SHM, os.W_OK) else ""
