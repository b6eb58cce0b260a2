"""CUDA IPC for the shm transport (shared/transport_shm.py): an engine on the trainer's own
GPU copies device -> device from a buffer of the trainer's, mapped by IPC handle, instead
of going through host memory.

UNMEASURED, and never run: written on a machine without a GPU. Every use is behind the
capability checks here, which fall back to the shared memory's host bytes and say why.

How: the trainer keeps a device twin of each shm slot (one flat uint8 buffer on its GPU,
the slot's layout: each tensor at the slot's offset) and copies each tensor into it
device -> device; the slot's index (orjson) then carries the twin's IPC handle as hex
strings, ``"ipc": {"uuid", "device", "handle", "size", "offset", "ref_handle",
"ref_offset", "event_handle", "event_sync"}`` (torch's ``_share_cuda_`` fields: no
pickle), and ``"host": false`` when the trainer wrote no host bytes (``auto`` with every
engine on its GPU). The slot's fence covers the twin as it covers the host bytes: the
trainer synchronises its device before it makes ``seq`` even, a reader synchronises its
copies before it checks ``seq`` again. An engine maps a twin once (by handle) and keeps
the mapping while the handle stays the same.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


def device_uuid(device: Any) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def sender_capability(tensors: Mapping[str, Any]) -> tuple[Any, str]:
    """The CUDA device every tensor is on, when the trainer can share it by IPC (else None),
    and why (not)."""
    import torch

    devices = {t.device for t in tensors.values()}
    if not devices or any(d.type != "cuda" for d in devices):
        return None, "the trainer's tensors are not all on a GPU"
    if len(devices) > 1:
        return None, f"the trainer's tensors are on {len(devices)} GPUs"
    if not hasattr(torch.UntypedStorage, "_share_cuda_"):
        return None, "this torch cannot share CUDA memory"
    return devices.pop(), "one GPU"


def reader_capability(ipc: Mapping[str, Any] | None, device: Any) -> tuple[bool, str]:
    """Whether an engine holding its weights on ``device`` can map the twin ``ipc``
    describes, and why (not)."""
    if not ipc:
        return False, "the trainer shares no GPU buffer"
    if device is None or getattr(device, "type", "") != "cuda":
        return False, f"the engine is not on a GPU ({device})"
    import torch

    if not torch.cuda.is_available():
        return False, "CUDA is not available here"
    if not hasattr(torch.UntypedStorage, "_new_shared_cuda"):
        return False, "this torch cannot map shared CUDA memory"
    mine = device_uuid(device)
    if mine != ipc.get("uuid"):
        return False, f"the engine is on GPU {mine}, the trainer's buffer on {ipc.get('uuid')}"
    return True, f"the same GPU {mine}"


def export(buffer: Any) -> dict[str, Any]:
    """The IPC handle of a flat device buffer, as JSON-able fields."""
    fields = buffer.untyped_storage()._share_cuda_()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
    return {
        "uuid": device_uuid(buffer.device),
        "device": int(device),
        "handle": bytes(handle).hex(),
        "size": int(size),
        "offset": int(offset),
        "ref_handle": bytes(ref_handle).hex(),
        "ref_offset": int(ref_offset),
        "event_handle": bytes(event_handle or b"").hex(),
        "event_sync": bool(event_sync),
    }


_OPEN: dict[str, Any] = {}
_OPEN_LOCK = threading.Lock()


def open_twin(ipc: Mapping[str, Any], device: Any) -> Any:
    """The trainer's twin as a uint8 tensor on ``device`` (mapped once per handle)."""
    import torch

    with _OPEN_LOCK:
        held = _OPEN.get(ipc["handle"])
        if held is None:
            storage: Any = torch.UntypedStorage
            shared = storage._new_shared_cuda(
                device.index if device.index is not None else torch.cuda.current_device(),
                bytes.fromhex(ipc["handle"]),
                ipc["size"],
                ipc["offset"],
                bytes.fromhex(ipc["ref_handle"]),
                ipc["ref_offset"],
                bytes.fromhex(ipc["event_handle"]) or None,
                ipc["event_sync"],
            )
            held = torch.empty(0, dtype=torch.uint8, device=device).set_(shared, 0, (ipc["size"],), (1,))
            for old in list(_OPEN)[:-3]:  # twins since replaced (a new layout)
                _OPEN.pop(old)
            _OPEN[ipc["handle"]] = held
        return held


class Twins:
    """The trainer's device twins, one per slot, replaced when a slot's layout grows."""

    def __init__(self) -> None:
        self.buffers: dict[int, Any] = {}
        self.handles: dict[int, dict[str, Any]] = {}

    def get(self, slot: int, size: int, device: Any) -> tuple[Any, dict[str, Any]]:
        import torch

        buffer = self.buffers.get(slot)
        if buffer is None or buffer.numel() < size or buffer.device != device:
            buffer = self.buffers[slot] = torch.empty(size, dtype=torch.uint8, device=device)
            self.handles[slot] = export(buffer)
        return buffer, self.handles[slot]
