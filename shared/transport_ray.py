"""The ``ray`` weight transport: the trainer puts a step's tensors in Ray's object
store, in buckets (one object a bucket: a list of byte arrays, one per tensor, that
Ray stores without a serialised copy and hands to a reader on the same node as views
of the shared memory), and registers them under a key in a registry actor (a child of
the trainer's process, named for the run); the
weight-sync event's URI names the registry and the key:

    ray://<namespace>/<registry actor name>/<key>

An engine in the same Ray cluster gets the key's manifest and bucket references from
the registry and ``ray.get``s the buckets it needs: on the trainer's node a mapping
of the object store, elsewhere Ray's own transfer. The objects are owned by the
trainer's process: a trainer that dies takes its steps with it, and an engine that
asks for one then fails naming the URI; the restarted trainer publishes its step
again (it does after a crash between commit and sync).

The manifest (orjson) maps every tensor of the model to where its latest value is:
``{"format": 1, "step": t, "tensors": {name: [source, bucket, position, dtype,
shape]}}``, ``source`` the key of the send that holds it (this one, or an earlier one
when only changed tensors were sent), ``bucket`` an index into that send's bucket
list, ``position`` into the bucket's list of arrays, ``dtype`` torch's name
(``float32``, ``bfloat16``). The registry's ``get(key)`` returns
``(manifest bytes, {source: [bucket refs]})`` for every source the manifest names.
A foreign trainer registers through the same actor methods (see
docs/stream-format.md §5.3.1).
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import orjson

from rollstream.shared.transports import Changes, Staging, TransportSettings, WeightError


class Registry:
    """The registry actor: key -> (manifest, {source: bucket refs})."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[bytes, dict[str, list[Any]]]] = {}

    def put(self, key: str, manifest: bytes, refs: dict[str, list[Any]]) -> int:
        self.entries[key] = (manifest, refs)
        return len(self.entries)

    def get(self, key: str) -> tuple[bytes, dict[str, list[Any]]] | None:
        return self.entries.get(key)

    def drop(self, keys: list[str]) -> int:
        for key in keys:
            self.entries.pop(key, None)
        return len(self.entries)

    def keys(self) -> list[str]:
        return list(self.entries)


def registry_name(run: str) -> str:
    return f"rollstream-weights-{run or 'default'}"


class RaySender:
    def __init__(self, settings: TransportSettings, run: str) -> None:
        import ray

        if not ray.is_initialized():
            raise WeightError("weights.kind = 'ray': Ray is not initialised in the trainer (ray.init)")
        self.settings = settings
        self.namespace = str(ray.get_runtime_context().namespace)
        self.name = registry_name(run)
        actor: Any = ray.remote(num_cpus=0)(Registry)
        self.registry = actor.options(name=self.name, namespace=self.namespace, get_if_exists=True).remote()
        self._changes = Changes(settings)
        self._staging = Staging(settings.dtype)
        self._where: dict[str, list[Any]] = {}  # name -> [source, bucket, position, dtype, shape]
        self._refs: dict[str, list[Any]] = {}  # source -> bucket refs
        self._keys: list[str] = []

    def send(self, step: int, tensors: Mapping[str, Any]) -> str:
        import ray
        import torch

        full, changed = self._changes.select(tensors)
        key = f"step-{step}-{uuid.uuid4().hex[:8]}"
        limit = self.settings.bucket_mb << 20
        buckets: list[list[Any]] = [[]]
        size = 0
        where = {} if full else dict(self._where)
        for name, host in self._staging(changed).items():
            nbytes = host.numel() * host.element_size()
            if buckets[-1] and size + nbytes > limit:
                buckets.append([])
                size = 0
            where[name] = [key, len(buckets) - 1, len(buckets[-1]), str(host.dtype).removeprefix("torch."),
                           list(host.shape)]  # fmt: skip
            buckets[-1].append(host.reshape(-1).view(torch.uint8).numpy())
            size += nbytes
        refs = [ray.put(bucket) for bucket in buckets if bucket]
        self._refs[key] = refs
        self._where = where
        needed = {w[0] for w in where.values()}
        manifest = orjson.dumps({"format": 1, "step": step, "tensors": where})
        ray.get(self.registry.put.remote(key, manifest, {s: self._refs[s] for s in needed}))
        self._keys.append(key)
        old = self._keys[: -self.settings.keep]
        if old:
            self._keys = self._keys[-self.settings.keep :]
            ray.get(self.registry.drop.remote(old))
            for source in old:
                if source not in needed:
                    self._refs.pop(source, None)
        return f"ray://{self.namespace}/{self.name}/{key}"

    def close(self) -> None:
        import ray

        ray.kill(self.registry)


def parse(uri: str) -> tuple[str, str, str]:
    parts = urlsplit(uri)
    name, _, key = parts.path.strip("/").partition("/")
    if parts.scheme != "ray" or not parts.netloc or not name or not key:
        raise WeightError(f"weights at {uri!r}: not ray://<namespace>/<registry>/<key>")
    return parts.netloc, name, key


def receive_ray(uri: str, sources: dict[str, str]) -> Iterator[tuple[str, Any]]:
    import ray
    import torch

    namespace, name, key = parse(uri)
    if not ray.is_initialized():
        raise WeightError(f"weights at {uri!r}: Ray is not initialised in this process")
    try:
        registry = ray.get_actor(name, namespace=namespace)
    except ValueError as exc:
        raise WeightError(
            f"weights at {uri!r}: no registry actor {name!r} in namespace {namespace!r}"
        ) from exc
    entry: Any = ray.get(registry.get.remote(key))
    if entry is None:
        raise WeightError(
            f"weights at {uri!r}: the registry holds no key {key!r} (dropped: a later step is out)"
        )
    raw, refs = entry
    manifest = orjson.loads(raw)
    wanted = {n: w for n, w in manifest["tensors"].items() if sources.get(n) != f"ray:{w[0]}/{w[1]}/{w[2]}"}
    needed = sorted({(w[0], w[1]) for w in wanted.values()})
    buckets = dict(zip(needed, ray.get([refs[s][b] for s, b in needed]), strict=True))
    for n, (source, bucket, position, dtype, shape) in wanted.items():
        with warnings.catch_warnings():  # the object store's memory is read-only: only copied from
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(buckets[(source, bucket)][position])
        sources[n] = f"ray:{source}/{bucket}/{position}"
        yield n, flat.view(getattr(torch, dtype)).reshape(shape)
