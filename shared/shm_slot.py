"""One slot of the shm weight transport (shared/transport_shm.py): a shared mapping of a
tmpfs file that holds a whole set of tensors, its layout and its fence. Little-endian:

    0   magic   8 bytes  b"RSWSHM01"
    8   seq     u64      the fence: odd while the trainer writes, even when done
    16  step    i64      the model step the slot holds
    24  index   u64, u64 offset and length of the index (orjson)
    40  token   16 bytes the sender's identity (random): the URI's must match
    56  (spare) u64
    64  ...     the tensors' bytes, each at a 64-byte-aligned offset, then the index

A slot keeps each tensor at the same offset from send to send while the set of names,
dtypes and shapes stays; a set that changes gets a new layout, and a new, larger file
(a new generation: a reader that still maps the old one keeps it until it lets go) when
it no longer fits. With CUDA the mapping is page-locked (``cudaHostRegister``) so
device copies into and out of it go by DMA.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import orjson

from rollstream.shared.transports import WeightError

log = logging.getLogger(__name__)

MAGIC = b"RSWSHM01"
HEADER = struct.Struct("<8sQqQQ16sQ")  # magic, seq, step, index offset, index length, token, spare
SEQ = struct.Struct("<Q")
SEQ_AT = 8
DATA_AT = 64
ALIGN = 64
CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --- the layout ----------------------------------------------------------------------


def plan(specs: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """Offsets for tensors ``(name, dtype, shape, nbytes)`` in that order, each aligned;
    returns {name: (offset, nbytes)} and where the data ends."""
    offsets: dict[str, tuple[int, int]] = {}
    at = DATA_AT
    for name, _, _, nbytes in specs:
        offsets[name] = (at, nbytes)
        at = _align(at + nbytes)
    return offsets, at


def index_room(specs: list[tuple[str, str, tuple[int, ...], int]]) -> int:
    """Bytes kept for the index: its size with the widest numbers, and spare."""
    wide = {n: [2**62, 2**62, d, list(s), 2**62] for n, d, s, _ in specs}
    return _align(len(orjson.dumps({"format": 1, "step": 2**62, "seq": 2**62, "tensors": wide})) + 4096)


def read_header(buffer: Any) -> tuple[int, int, int, int, bytes]:
    """(seq, step, index offset, index length, token) of a slot; a clear error for what
    is no slot."""
    if len(buffer) < DATA_AT:
        raise WeightError(f"{len(buffer)} bytes: shorter than a slot's header")
    magic, seq, step, offset, length, token, _ = HEADER.unpack_from(buffer, 0)
    if magic != MAGIC:
        raise WeightError(f"not a weights slot (magic {magic!r})")
    return seq, step, offset, length, token


class Slot:
    """One shared file the sender writes into: its mapping, layout and what it holds."""

    def __init__(self, directory: Path, index: int, token: bytes) -> None:
        self.directory = directory
        self.index = index
        self.token = token
        self.generation = 0
        self.path: Path | None = None
        self.map: mmap.mmap | None = None
        self.view: Any = None  # the mapping as a uint8 tensor
        self.registered = False
        self.size = 0
        self.signature: list[tuple[str, str, tuple[int, ...]]] = []
        self.offsets: dict[str, tuple[int, int]] = {}
        self.index_at = 0
        self.versions: dict[str, int] = {}  # name -> version of the value this slot holds
        self.seq = 0

    def fit(self, specs: list[tuple[str, str, tuple[int, ...], int]], cuda: bool) -> None:
        """The layout for this set of tensors; a larger file when it does not fit."""
        signature = [(n, d, s) for n, d, s, _ in specs]
        if signature == self.signature and self.map is not None:
            return
        offsets, end = plan(specs)
        needed = end + index_room(specs)
        if self.map is None or needed > self.size:
            self._grow(needed + needed // 4, cuda)
        self.signature, self.offsets, self.index_at = signature, offsets, end
        self.versions = {}  # a new layout: every tensor is written again

    def _grow(self, size: int, cuda: bool) -> None:
        old = self.path
        self.release()
        self.generation += 1
        self.path = self.directory / f"slot-{self.index}-{self.generation}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.seq = 0
        HEADER.pack_into(self.map, 0, MAGIC, 0, -1, 0, 0, self.token, 0)
        import torch

        self.view = torch.frombuffer(self.map, dtype=torch.uint8)
        if cuda:
            self.registered = register(self.view, read_only=False)
        if old is not None:
            old.unlink(missing_ok=True)  # readers that map it keep it until they let go

    def release(self) -> None:
        if self.registered:
            unregister(self.view)
            self.registered = False
        self.view = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a tensor still views it: the memory goes with the last view
                log.debug("weights: shm slot %s still viewed at close", self.path)
            self.map = None

    def begin(self) -> None:
        assert self.map is not None
        self.seq += 1 if self.seq % 2 == 0 else 2
        SEQ.pack_into(self.map, SEQ_AT, self.seq)  # odd: being written

    def end(self, step: int, index: bytes) -> int:
        assert self.map is not None
        if len(index) > self.size - self.index_at:
            raise WeightError(f"shm slot {self.path}: the index ({len(index)} bytes) does not fit")
        self.map[self.index_at : self.index_at + len(index)] = index
        struct.pack_into("<qQQ", self.map, 16, step, self.index_at, len(index))
        self.seq += 1
        SEQ.pack_into(self.map, SEQ_AT, self.seq)  # even: complete
        return self.seq


# --- CUDA page-locking ---------------------------------------------------------------


def _cudart() -> Any:
    """torch's bindings of the CUDA runtime (untyped)."""
    import torch

    cuda: Any = torch.cuda
    return cuda.cudart()


def register(view: Any, read_only: bool) -> bool:
    """Page-lock a mapping (a uint8 tensor over it) for DMA; False where CUDA cannot."""
    import torch

    if not torch.cuda.is_available() or view.numel() == 0:
        return False
    try:
        flags = CUDA_HOST_REGISTER_READ_ONLY if read_only else 0
        code = _cudart().cudaHostRegister(view.data_ptr(), view.numel(), flags)
    except (RuntimeError, AttributeError) as exc:
        log.info("weights: cudaHostRegister unavailable (%s): shm copies through pageable memory", exc)
        return False
    if int(code) != 0:
        log.info("weights: cudaHostRegister of %d bytes failed (error %s)", view.numel(), code)
        return False
    return True


def unregister(view: Any) -> None:
    try:
        _cudart().cudaHostUnregister(view.data_ptr())
    except (RuntimeError, AttributeError) as exc:
        log.debug("weights: cudaHostUnregister: %s", exc)
