"""The ``collective`` weight transport: the trainer broadcasts a step's tensors, in
buckets, over a torch.distributed process group (gloo: CPU tensors; NCCL on GPUs is the
same protocol with device buckets, not built yet) that it forms with each engine that
asks. The weight-sync event's URI names the trainer's rendezvous store and the step:

    collective://<host>:<port>/<key>

The trainer runs a torch ``TCPStore`` at host:port (``weights.address``). For each send
it stores ``manifest/<key>`` (orjson: ``{"format": 1, "step": t, "buckets": [bytes,
...], "tensors": {name: [bucket, offset, nbytes, dtype, shape]}}``) and keeps the
buckets of the last ``weights.keep`` keys. An engine that fetches:

1. reads ``manifest/<key>`` (absent: the step was dropped; the sync fails naming it);
2. takes a ticket ``n = ADD tickets 1`` and sets ``request/<n>`` to the key;
3. forms a two-rank gloo group over the store's prefix ``pg/<n>/`` as rank 1 (the
   trainer is rank 0), receives a broadcast int64 status (1: held, 0: dropped since),
   then one broadcast per bucket (uint8, the manifest's sizes), and copies its
   tensors out of them.

The trainer serves requests in ticket order in a thread of its own, a fresh group for
each, so an engine that joins late or restarts simply asks (it gets the whole set).
"""

from __future__ import annotations

import datetime
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import orjson

from rollstream.shared.transports import Staging, TransportSettings, WeightError

log = logging.getLogger(__name__)
TIMEOUT = datetime.timedelta(seconds=60)


def _broadcast(group: Any, tensor: Any) -> None:
    dist: Any = _c10d()
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _c10d() -> Any:
    """torch's c10d bindings (the store, gloo's group, the options), typed loosely."""
    import torch.distributed as dist

    return dist


def _group(store: Any, ticket: int, rank: int) -> Any:
    dist: Any = _c10d()
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pg/{ticket}/", store), rank, 2, TIMEOUT)


class CollectiveSender:
    def __init__(self, settings: TransportSettings) -> None:
        TCPStore = _c10d().TCPStore

        self.settings = settings
        host, _, port = (settings.address or "127.0.0.1:0").rpartition(":")
        self.host = host or "127.0.0.1"
        try:
            self.store = TCPStore(
                self.host, int(port or 0), is_master=True, wait_for_workers=False, timeout=TIMEOUT
            )
        except (RuntimeError, ValueError) as exc:
            raise WeightError(f"weights.address {settings.address!r}: cannot listen there: {exc}") from exc
        self.port = int(self.store.port)
        self._staging = Staging(settings.dtype)
        self._held: dict[str, list[Any]] = {}
        self._keys: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.served = 0
        self._thread = threading.Thread(target=self._serve, name="weights-collective", daemon=True)
        self._thread.start()

    def send(self, step: int, tensors: Mapping[str, Any]) -> str:
        import torch

        limit = self.settings.bucket_mb << 20
        groups: list[list[Any]] = [[]]
        where: dict[str, list[Any]] = {}
        size = 0
        for name, t in self._staging(tensors).items():
            nbytes = t.numel() * t.element_size()
            if groups[-1] and size + nbytes > limit:
                groups.append([])
                size = 0
            where[name] = [len(groups) - 1, size, nbytes, str(t.dtype).removeprefix("torch."), list(t.shape)]
            groups[-1].append(t.reshape(-1).view(torch.uint8))
            size += nbytes
        buckets = [torch.cat(g) if g else torch.empty(0, dtype=torch.uint8) for g in groups]
        key = f"step-{step}-{uuid.uuid4().hex[:8]}"
        manifest = {"format": 1, "step": step, "buckets": [b.numel() for b in buckets], "tensors": where}
        with self._lock:
            self._held[key] = buckets
            self._keys.append(key)
            for old in self._keys[: -self.settings.keep]:
                self._held.pop(old, None)
                self.store.delete_key(f"manifest/{old}")
            self._keys = self._keys[-self.settings.keep :]
        self.store.set(f"manifest/{key}", orjson.dumps(manifest).decode())
        return f"collective://{self.host}:{self.port}/{key}"

    def _serve(self) -> None:
        import torch

        ticket = 0
        while not self._stop.is_set():
            ticket += 1
            name = f"request/{ticket}"
            while not self._stop.is_set():
                if self.store.check([name]):
                    break
                self._stop.wait(0.01)
            if self._stop.is_set():
                return
            key = self.store.get(name).decode()
            with self._lock:
                buckets = self._held.get(key)
            try:
                group = _group(self.store, ticket, 0)
                _broadcast(group, torch.tensor([1 if buckets is not None else 0], dtype=torch.int64))
                for bucket in buckets or []:
                    _broadcast(group, bucket)
                self.served += 1
            except RuntimeError as exc:  # the engine went away mid-way: it will ask again
                log.warning("weights: collective send of %s to request %d failed: %s", key, ticket, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def parse(uri: str) -> tuple[str, int, str]:
    parts = urlsplit(uri)
    key = parts.path.strip("/")
    if parts.scheme != "collective" or not parts.hostname or not parts.port or not key:
        raise WeightError(f"weights at {uri!r}: not collective://<host>:<port>/<key>")
    return parts.hostname, parts.port, key


def receive_collective(uri: str, sources: dict[str, str]) -> Iterator[tuple[str, Any]]:
    import torch

    TCPStore = _c10d().TCPStore
    host, port, key = parse(uri)
    try:
        store = TCPStore(host, port, is_master=False, timeout=TIMEOUT)
    except RuntimeError as exc:
        raise WeightError(f"weights at {uri!r}: the trainer's store does not answer: {exc}") from exc
    if not store.check([f"manifest/{key}"]):
        raise WeightError(
            f"weights at {uri!r}: the trainer holds no step {key!r} (dropped: a later step is out)"
        )
    manifest = orjson.loads(store.get(f"manifest/{key}"))
    ticket = int(store.add("tickets", 1))
    store.set(f"request/{ticket}", key)
    group = _group(store, ticket, 1)
    status = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, status)
    if int(status[0]) != 1:
        raise WeightError(f"weights at {uri!r}: dropped by the trainer before it was sent")
    buckets = []
    for size in manifest["buckets"]:
        bucket = torch.empty(size, dtype=torch.uint8)
        _broadcast(group, bucket)
        buckets.append(bucket)
    for name, (bucket, offset, nbytes, dtype, shape) in manifest["tensors"].items():
        sources[name] = f"collective:{key}"
        flat = buckets[bucket][offset : offset + nbytes]
        yield name, flat.view(getattr(torch, dtype)).reshape(shape)
