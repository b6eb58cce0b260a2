"""``weights.kind = "auto"``: the transport picked from where the engines are.

Where the choice is made: at the trainer, at every send, from the engines' placements
when the trainer is given them (``engines``: a callable returning each live engine's
node and device, e.g. from the engine actors' reports), and at the engine for what the
trainer cannot know. The trainer publishes one URI per sync; when some engines are on
its node and some elsewhere, or it does not know, the URI is an ``shm://`` one carrying a
``fallback`` (another transport's URI for the same step): an engine reads the shared
memory when the file is there and is the sender's (same node), else the fallback. So an
engine that moves, or that the trainer has not heard of, still loads the step.

The order, best first:

  ipc         CUDA IPC, every engine on the trainer's own GPU: device -> device
              (shared/transport_ipc.py: written without a GPU, unmeasured). Chosen only
              when the placements name the same GPU and CUDA is there;
              ``ipc_capability`` says why not, so the log names what is missing.
  shm         engines on the trainer's node (shared/transport_shm.py)
  file        engines elsewhere, ``weights.dir`` set (a directory they share)
  collective  engines elsewhere, no shared directory (a gloo broadcast)

Unknown placements: shm, with a fallback when the settings name a place reachable from
other nodes (``weights.dir`` or ``weights.address``). No tmpfs: the remote kind.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rollstream.shared.transports import SHM, Sender, TransportSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where a trainer or an engine holds its weights: the node (hostname or Ray node id:
    the same kind for all) and the device (``"cpu"``, or ``"cuda:<uuid or index>"``)."""

    node: str
    device: str = "cpu"


@dataclass(frozen=True)
class Choice:
    kind: str  # the transport whose URI is published: ipc, shm, file, collective
    fallback: str  # the kind an shm URI falls back to on another node; "" for none
    reason: str


def ipc_capability(trainer: Placement, engine: Placement, built: bool = True) -> tuple[bool, str]:
    """Whether an engine could map the trainer's tensors by CUDA IPC handle, and why not."""
    if not built:
        return False, "CUDA IPC is turned off"
    if not trainer.device.startswith("cuda") or not engine.device.startswith("cuda"):
        return False, f"not both on a GPU (trainer {trainer.device}, engine {engine.device})"
    if trainer.node != engine.node:
        return False, f"on other nodes ({trainer.node}, {engine.node})"
    if trainer.device != engine.device:
        return False, f"on other GPUs of the node ({trainer.device}, {engine.device})"
    try:
        import torch
    except ImportError:
        return False, "no torch"
    if not torch.cuda.is_available():
        return False, "CUDA is not available in the trainer"
    if os.name != "posix":
        return False, "CUDA IPC needs Linux"
    return True, f"the same GPU {trainer.device}"


def shm_available() -> bool:
    return SHM.is_dir() and os.access(SHM, os.W_OK)


def choose(
    trainer: Placement,
    engines: list[Placement] | None,
    settings: TransportSettings,
    shm: bool,
    ipc_built: bool = True,
) -> Choice:
    """The transport for the engines at ``engines`` (None: not known)."""
    remote = "file" if settings.dir else "collective"
    why_remote = "weights.dir names a shared directory" if settings.dir else "no shared directory"
    if engines is not None and not engines:
        engines = None
    if engines is not None:
        ipc = [ipc_capability(trainer, e, ipc_built) for e in engines]
        if all(ok for ok, _ in ipc):
            return Choice("ipc", "", f"every engine on the trainer's GPU: {ipc[0][1]}")
    if not shm:
        return Choice(remote, "", f"no writable {SHM} here: {remote} ({why_remote})")
    if engines is None:
        reachable = bool(settings.dir or settings.address)
        return Choice(
            "shm",
            remote if reachable else "",
            "the engines' nodes are not known: shared memory"
            + (
                f", {remote} for engines elsewhere"
                if reachable
                else " (no weights.dir or address for others)"
            ),
        )
    local = [e for e in engines if e.node == trainer.node]
    if not local:
        return Choice(remote, "", f"no engine on the trainer's node {trainer.node}: {remote} ({why_remote})")
    if len(local) == len(engines):
        why = ipc[0][1] if engines else ""
        return Choice("shm", "", f"every engine on the trainer's node {trainer.node} (no IPC: {why})")
    return Choice(
        "shm",
        remote,
        f"{len(local)} of {len(engines)} engines on the trainer's node {trainer.node}: shared memory, "
        f"{remote} for the others ({why_remote})",
    )


class AutoSender:
    """Sends through the transport ``choose`` picks at each send, logging each new choice."""

    def __init__(
        self,
        settings: TransportSettings,
        out_dir: str,
        run: str,
        config_files: Mapping[str, str],
        engines: Callable[[], list[Placement]] | None = None,
        trainer: Placement | None = None,
    ) -> None:
        from rollstream.shared.transport_shm import node_name

        self.settings = settings
        self.out_dir = out_dir
        self.run = run
        self.config_files = dict(config_files)
        self.engines = engines
        self.trainer = trainer or Placement(node_name())
        self.shm = shm_available()
        self._senders: dict[str, Sender] = {}
        self.choice: Choice | None = None

    def _sender(self, kind: str) -> Sender:
        from rollstream.shared.transports import sender_for

        sender = self._senders.get(kind)
        if sender is None and kind == "ipc":  # shared memory's slots, a device twin, no host bytes
            from rollstream.shared.transport_shm import ShmSender

            sender = self._senders[kind] = ShmSender(self.settings, self.run, ipc=True, host=False)
        if sender is None:
            sender = sender_for(self.settings.model_copy(update={"kind": kind}), self.out_dir, self.run,
                                self.config_files)  # fmt: skip
            self._senders[kind] = sender
        return sender

    def send(self, step: int, tensors: Mapping[str, Any]) -> str:
        placements = self.engines() if self.engines is not None else None
        choice = choose(self.trainer, placements, self.settings, self.shm)
        if choice != self.choice:
            log.info("weights: auto chose %s%s: %s", choice.kind,
                     f" (fallback {choice.fallback})" if choice.fallback else "", choice.reason)  # fmt: skip
            self.choice = choice
        if choice.kind not in ("shm", "ipc"):
            return self._sender(choice.kind).send(step, tensors)
        fallback = self._sender(choice.fallback).send(step, tensors) if choice.fallback else ""
        from rollstream.shared.transport_shm import ShmSender

        shm = self._sender(choice.kind)
        assert isinstance(shm, ShmSender)
        return shm.send(step, tensors, fallback=fallback)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
