"""The ``shm`` weight transport: for engines on the trainer's node. The trainer copies each
tensor straight into a shared mapping of a tmpfs file (/dev/shm) that engines map too,
so a step costs one copy out of the trainer and one into the engine. The weight-sync
event's URI names the file and what it must hold:

    shm:///dev/shm/rollstream-shm/<run>-<pid>-<nonce>/slot-<i>-<generation>
        ?step=<t>&seq=<fence>&token=<hex>&node=<host>[&fallback=<another transport's URI>]

Two such files (slots) take turns, so the trainer writes step t+1 into one while an
engine still reads step t from the other; a slot is overwritten two sends later.

A slot's layout and fence are shared/shm_slot.py's (docs/stream-format.md §5.3.1).

The index: ``{"format": 1, "step": t, "seq": s, "tensors": {name: [offset, nbytes,
dtype, shape, version]}}``, every tensor of the model (torch dtype names). ``version``
is the send at which the tensor's value last changed: an engine that holds a tensor of
the same version (from either slot) skips it, so a step that changed some tensors
(``changed_only``, a LoRA adapter) moves only those. A slot keeps each tensor at the same
offset from send to send while the set of names, dtypes and shapes stays; a set that
changes gets a new layout, and a new, larger file (a new generation: a reader that still
maps the old one keeps it until it lets go) when it no longer fits.

The fence is a seqlock: the trainer makes ``seq`` odd, writes the tensors, the index and
the step, then makes ``seq`` even (the URI's ``seq``). A reader checks ``seq`` against
the URI before it reads and after it has copied everything out; any difference (a trainer
killed mid-copy leaves it odd; a slot reused by a later step moves it on) fails the
sync, naming the URI, and nothing read is handed on. x86's store order keeps the
trainer's writes in program order; that is what the fence relies on.

With CUDA, the trainer page-locks its mappings once (``cudaHostRegister``), so its
device tensors go into them by DMA with non-blocking copies and one synchronisation
(where registering fails: through pinned staging buffers); an engine on a GPU
registers its mappings too and copies host -> device straight from them (``device``).
Without CUDA the same transport is a shared-memory copy.

The files live under /dev/shm/rollstream-shm/, one directory per sender named for the
run and the trainer's pid; ``close`` removes it, and a sender that starts removes the
directories of its run whose trainer process is gone (a trainer killed by SIGKILL).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import shutil
import socket
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import orjson

from rollstream.shared.shm_slot import Slot, read_header, register, unregister
from rollstream.shared.transports import SHM, Into, TransportSettings, WeightError

log = logging.getLogger(__name__)

ROOT = "rollstream-shm"


def node_name() -> str:
    return socket.gethostname()


# --- the sender ----------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(root: Path, run: str) -> list[Path]:
    """Remove the directories of ``run`` whose trainer process is gone; returns them."""
    gone = []
    for directory in root.glob(f"{run}-*-*") if root.is_dir() else []:
        pid = directory.name.removeprefix(f"{run}-").split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)
            gone.append(directory)
    return gone


def safe_run(run: str) -> str:
    name = "".join(c if c.isalnum() or c in "._" else "_" for c in (run or "default"))
    return name.strip(".") or "default"


class ShmSender:
    """Writes each send into the slot the previous send did not use."""

    def __init__(
        self,
        settings: TransportSettings,
        run: str = "",
        root: str | Path | None = None,
        ipc: bool = False,
        host: bool = True,
    ) -> None:
        """``ipc``: also a device twin of each slot that engines on the trainer's GPU map by
        CUDA IPC handle (shared/transport_ipc.py; unmeasured); ``host`` False: no host bytes
        then (every engine on that GPU), where the twin can be shared."""
        import torch

        base = Path(root) if root is not None else SHM / ROOT
        if not base.parent.is_dir() or not os.access(base.parent, os.W_OK):
            raise WeightError(
                f"weights.kind = 'shm': {str(base.parent)!r} is not a writable directory (no tmpfs "
                "here: use weights.kind = 'file' or 'auto')"
            )
        base.mkdir(exist_ok=True)
        self.run = safe_run(run)
        for gone in sweep(base, self.run):
            log.info("weights: removed %s, left by a trainer that is gone", gone)
        self.directory = base / f"{self.run}-{os.getpid()}-{secrets.token_hex(4)}"
        self.directory.mkdir(mode=0o700)
        # gone with the sender, or at the interpreter's exit, when nobody called close (a
        # trainer that never closes its sender); sweep is for a process killed outright
        self._remove = weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        self.settings = settings
        self.token = secrets.token_bytes(16)
        self.node = node_name()
        self.slots = [Slot(self.directory, i, self.token) for i in range(2)]
        self.cuda = bool(torch.cuda.is_available())
        self._identity: dict[str, tuple[int, int]] = {}
        self._version: dict[str, int] = {}
        self._sends = 0
        self._pinned: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.ipc, self.host = ipc, host
        self._twins: Any = None
        self._ipc_why = ""
        self.last: dict[str, Any] = {}  # what the last send did (written, bytes, slot)

    def _versions(self, tensors: Mapping[str, Any]) -> dict[str, int]:
        """Each tensor's value version: this send's number where it changed (every tensor
        without changed_only), else the version it had."""
        out = {}
        for name, t in tensors.items():
            identity = (int(t.data_ptr()), int(t._version))
            if not self.settings.changed_only or self._identity.get(name) != identity:
                out[name] = self._sends
            else:
                out[name] = self._version[name]
        self._identity = {n: (int(t.data_ptr()), int(t._version)) for n, t in tensors.items()}
        return out

    def send(self, step: int, tensors: Mapping[str, Any], fallback: str = "") -> str:
        import torch

        with self._lock:
            self._sends += 1
            versions = self._versions(tensors)
            self._version = versions
            target = getattr(torch, self.settings.dtype) if self.settings.dtype else None
            prepared: dict[str, Any] = {}
            for name, t in tensors.items():
                t = t.detach()
                if target is not None and t.is_floating_point() and t.dtype != target:
                    t = t.to(target)
                prepared[name] = t
            specs = [
                (n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
                for n, t in prepared.items()
            ]
            slot = self.slots[self._sends % 2]
            slot.fit(specs, self.cuda)
            twin, handle = self._twin(slot, prepared)
            write = [n for n in prepared if slot.versions.get(n) != versions[n]]
            slot.begin()
            written = self._copy(slot, {n: prepared[n] for n in write}, twin, host=twin is None or self.host)
            slot.versions = {n: versions[n] for n in prepared}
            index: dict[str, Any] = {
                "format": 1,
                "step": step,
                "seq": slot.seq + 1,
                "tensors": {n: [*slot.offsets[n], d, list(s), versions[n]] for n, d, s, _ in specs},
            }
            if twin is not None:
                index["ipc"], index["host"] = handle, self.host
            seq = slot.end(step, orjson.dumps(index))
            self.last = {"written": len(write), "bytes": written, "slot": slot.index, "seq": seq}
            query = {"step": step, "seq": seq, "token": self.token.hex(), "node": self.node}
            if fallback:
                query["fallback"] = fallback
            return f"shm://{slot.path}?{urlencode(query)}"

    def _twin(self, slot: Slot, tensors: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The slot's device twin and its handle, where IPC is asked for and possible; a
        twin that is new (a new layout) takes every tensor again."""
        if not self.ipc:
            return None, {}
        from rollstream.shared import transport_ipc

        device, why = transport_ipc.sender_capability(tensors)
        if device is None:
            if why != self._ipc_why:
                log.info("weights: no CUDA IPC (%s): engines read the shared memory", why)
                self._ipc_why = why
            return None, {}
        if self._twins is None:
            self._twins = transport_ipc.Twins()
        before = self._twins.buffers.get(slot.index)
        twin, handle = self._twins.get(slot.index, slot.index_at, device)
        if twin is not before:
            slot.versions = {}
        return twin, handle

    def _copy(self, slot: Slot, tensors: Mapping[str, Any], twin: Any = None, host: bool = True) -> int:
        """Each tensor's bytes into the slot: device tensors by non-blocking copies (into
        the registered mapping, else through pinned buffers), and into the device twin
        (``twin``: device -> device), one synchronisation."""
        import torch

        total = 0
        devices = set()
        for name, t in tensors.items():
            offset, nbytes = slot.offsets[name]
            total += nbytes
            if not nbytes:
                continue
            if twin is not None:
                twin[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                if t.device.type == "cuda":
                    devices.add(t.device)
                if not host:
                    continue
            dst = slot.view[offset : offset + nbytes].view(t.dtype).view(t.shape)
            if t.device.type == "cpu":
                dst.copy_(t)
            elif slot.registered:
                dst.copy_(t, non_blocking=True)
                devices.add(t.device)
            else:  # pageable: a device copy into it would crawl; pinned, then memcpy
                pinned = self._pinned.get(name)
                if pinned is None or pinned.shape != t.shape or pinned.dtype != t.dtype:
                    pinned = self._pinned[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                pinned.copy_(t, non_blocking=True)
                torch.cuda.current_stream(t.device).synchronize()
                dst.copy_(pinned)
        for device in devices:
            torch.cuda.synchronize(device)
        return total

    def close(self) -> None:
        with self._lock:
            for slot in self.slots:
                slot.release()
            self._remove()


# --- the reader ----------------------------------------------------------------------


def parse(uri: str) -> tuple[Path, int, int, bytes, str, str]:
    """(path, step, seq, token, node, fallback) of an shm URI; a clear error for others."""
    parts = urlsplit(uri)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    try:
        step, seq, token = int(query["step"]), int(query["seq"]), bytes.fromhex(query["token"])
    except (KeyError, ValueError) as exc:
        raise WeightError(
            f"weights at {uri!r}: not shm://<path>?step=<t>&seq=<n>&token=<hex>&node=<host> ({exc})"
        ) from exc
    if parts.scheme != "shm" or not parts.path or seq % 2 or len(token) != 16:
        raise WeightError(f"weights at {uri!r}: not shm://<path>?step=<t>&seq=<even>&token=<32 hex>")
    return Path(parts.path), step, seq, token, query.get("node", ""), query.get("fallback", "")


class _Mapped:
    """A reader's mapping of a slot file, kept between syncs (and page-locked once)."""

    def __init__(self, path: Path, device: Any) -> None:
        import torch

        with path.open("rb") as f:
            self.inode = os.fstat(f.fileno()).st_ino
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # read-only: only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            self.view = torch.frombuffer(self.map, dtype=torch.uint8)
        self.registered = device is not None and device.type == "cuda" and register(self.view, True)

    def current(self, path: Path) -> bool:
        """Whether ``path`` is still this mapping's file (not removed, not replaced)."""
        try:
            return path.stat().st_ino == self.inode
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Unregistered; the mapping itself closes with its last user (a reader in
        another thread may still be copying from it)."""
        if self.registered:
            unregister(self.view)
            self.registered = False


_MAPPED: dict[Path, _Mapped] = {}
_MAPPED_LOCK = threading.Lock()


def _mapping(path: Path, device: Any) -> _Mapped | None:
    """The process's mapping of ``path``: None when the file is not there. Mappings of
    files since removed or replaced are let go here: a removed tmpfs file's memory is
    freed only once nobody maps it."""
    with _MAPPED_LOCK:
        for other in [p for p, held in _MAPPED.items() if not held.current(p)]:
            _MAPPED.pop(other).release()
        held = _MAPPED.get(path)
        if held is None:
            try:
                held = _MAPPED[path] = _Mapped(path, device)
            except FileNotFoundError:
                return None
        return held


def receive_shm(
    uri: str, sources: dict[str, str], device: Any = None, into: Into | None = None
) -> Iterator[tuple[str, Any]]:
    """The tensors of the slot at ``uri`` that the engine does not hold yet, copied out of
    the mapping (onto ``device`` when it is a GPU; into what ``into`` gives where it gives
    one: an engine's reused buffers, whose pages are not faulted in again at every sync,
    in the engine's dtype), handed on only once the fence shows
    the slot unchanged since the URI was published. On another node (the file is not
    there, or is another sender's) the URI's ``fallback`` is read instead, if it has one."""
    path, step, seq, token, node, fallback = parse(uri)
    held = _mapping(path, device)
    if held is None or read_header(held.map)[4] != token:
        if fallback:
            from rollstream.shared.transports import receive

            log.info("weights: %s is not on this node (%s): reading %s", uri, node_name(), fallback)
            return receive(fallback, sources)
        raise WeightError(
            f"weights at {uri!r}: no such shared-memory file here (the trainer is on node {node!r}, "
            f"this engine on {node_name()!r}; or the trainer has moved on or stopped): engines on "
            "other nodes need weights.kind 'file' (a shared directory), 'collective' or 'auto'"
        )
    return iter(_read(uri, held, step, seq, sources, device, into))


def _read(
    uri: str, held: _Mapped, step: int, seq: int, sources: dict[str, str], device: Any, into: Into | None
) -> list[tuple[str, Any]]:
    import torch

    def check(when: str) -> None:
        now, at, _, _, _ = read_header(held.map)
        if now != seq or at != step:
            state = "being written" if now % 2 else "holds a later step"
            raise WeightError(
                f"weights at {uri!r}: the slot {state} {when} (fence {now}, step {at}; the URI's "
                f"{seq}, step {step}): a later sync is out, or the trainer stopped mid-write"
            )

    check("before reading")
    _, _, offset, length, token = read_header(held.map)
    index = orjson.loads(held.map[offset : offset + length])
    if index.get("format") != 1 or index.get("seq") != seq:
        raise WeightError(
            f"weights at {uri!r}: an index of format {index.get('format')!r}, seq {index.get('seq')}"
        )
    gpu = device is not None and device.type == "cuda"
    source_view = held.view
    registered = held.registered
    if "ipc" in index:  # the trainer shares a device twin (shared/transport_ipc.py)
        from rollstream.shared import transport_ipc

        usable, why = transport_ipc.reader_capability(index["ipc"], device)
        if usable:
            source_view, registered = transport_ipc.open_twin(index["ipc"], device), True
        elif not index.get("host", True):
            raise WeightError(
                f"weights at {uri!r}: only on the trainer's GPU (CUDA IPC), and this engine cannot "
                f"map it: {why}"
            )
    out: list[tuple[str, Any]] = []
    seen: dict[str, str] = {}
    for name, (at, nbytes, dtype, shape, version) in index["tensors"].items():
        source = f"shm:{token.hex()}:{version}"
        seen[name] = source
        if sources.get(name) == source:
            continue
        kind = getattr(torch, dtype)
        flat = source_view[at : at + nbytes]
        view = flat.view(kind).view(shape) if nbytes else torch.empty(shape, dtype=kind)
        copy = into(name, tuple(shape), kind) if into is not None else None
        if copy is None:
            copy = torch.empty(shape, dtype=kind, device=device if gpu else "cpu")
        copy.copy_(view, non_blocking=gpu and registered)
        out.append((name, copy))
    if gpu:
        torch.cuda.synchronize(device)
    check("after reading")  # only now is what was copied known whole
    sources.update(seen)
    return out
