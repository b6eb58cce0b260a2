"""The run's engine actors on Ray: their names, where they run (resources, node labels,
placement groups for tensor-parallel engines), how they are created, found and
removed, and joining the run's Ray cluster. The pool that sends them work is
producer/fleet/pool.py (``EnginePool``).

    rollstream:{run}:engine:{i}    actor names, in the Ray namespace rollstream-{run}

Calls carry orjson bytes (producer/engines/base.py ``dumps``), not pickled
objects of ours.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import ray
from ray.exceptions import RayError

from rollstream.producer.engines import make_engine
from rollstream.producer.engines.base import SamplingParams, dumps, loads
from rollstream.producer.fleet.host import EngineHost
from rollstream.shared.engine_settings import EngineSettings
from rollstream.shared.errors import RollstreamError
from rollstream.shared.transports import tensor_digests

log = logging.getLogger(__name__)


class PoolError(RollstreamError):
    """The engine actors cannot be started, found or reached."""


def namespace(run: str) -> str:
    return f"rollstream-{run}"


def actor_name(run: str, index: int) -> str:
    return f"rollstream:{run}:engine:{index}"


def init_ray(address: str = "", *, local: bool = False) -> str:
    """Join the Ray cluster at ``address``, or, with ``local`` and no address, start a
    one-machine cluster owned by this process; returns the address other processes of
    the run join by (the cluster's GCS address; a ``ray://`` address as given).

    ``address`` is the GCS address (``host:port``) for a process on a machine that runs
    a node of the cluster, or the head's Ray Client server (``ray://host:10001``) for one
    that runs none: a container or pod of its own, which Ray's GCS path does not serve
    (the driver needs a raylet it can see).

    Never "whatever cluster runs on this machine": RAY_ADDRESS and Ray's record of the
    last cluster started here are ignored, so a run cannot land on another run's
    cluster. Token authentication stays as Ray sets it up (on by default): a process
    joining from elsewhere needs the cluster's token (RAY_AUTH_TOKEN, or the file that
    RAY_AUTH_TOKEN_PATH names, default ~/.ray/auth_token), as Ray documents.
    """
    if ray.is_initialized():
        return address if is_client_address(address) else str(ray.get_runtime_context().gcs_address)
    stray = os.environ.pop("RAY_ADDRESS", None)
    if stray and stray != address:
        log.warning(
            "ignoring RAY_ADDRESS=%s: a run's Ray cluster is the setting ray.address "
            "(ROLLSTREAM_RAY__ADDRESS) or the one its engines process recorded",
            stray,
        )
    if not address and not local:
        raise PoolError("no Ray address: set ray.address (ROLLSTREAM_RAY__ADDRESS)")
    try:
        if address:
            _ask_for_token_auth()
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError, RayError) as exc:
        raise PoolError(
            f"cannot join the Ray cluster at {address or 'local'}: {first_line(exc)}{join_hint(address, exc)}"
        ) from None
    if is_client_address(address):
        return address
    return str(ray.get_runtime_context().gcs_address)


def is_client_address(address: str) -> bool:
    """A Ray Client address (``ray://host:port``): the driver runs no Ray node of its own."""
    return address.startswith("ray://")


AUTH_WORDS = ("auth", "token", "unauthenticated", "permission")


def join_hint(address: str, exc: BaseException) -> str:
    """What to look at when joining ``address`` failed with ``exc``. The token only when the
    error is about it: a driver that cannot reach a raylet of the cluster (it runs in a
    container or pod of its own: Ray's GCS path needs one on its machine, in its view)
    times out with "Failed to connect", which is no token's fault."""
    if not address:
        return ""
    text = str(exc).lower()
    if any(word in text for word in AUTH_WORDS):
        return (
            " (Ray's token authentication refused this process: it needs the cluster's token "
            "in RAY_AUTH_TOKEN, or in the file RAY_AUTH_TOKEN_PATH names, default ~/.ray/auth_token)"
        )
    if is_client_address(address):
        return (
            " (a Ray Client address: the head must run its client server on that port, "
            "`ray start --head --ray-client-server-port=10001`, with ray[default] installed)"
        )
    return (
        " (a GCS address works only where this process can reach a Ray node of the cluster "
        "on its own machine, e.g. beside `ray start`; a process in a container or pod "
        "without one joins through Ray Client: ray.address ray://HEAD:10001. Check also "
        "the address, the head's port, and that this process has the cluster's token "
        "in RAY_AUTH_TOKEN if token authentication is on)"
    )


def _ask_for_token_auth() -> None:
    """Ray turns token authentication on by itself for a cluster it finds or starts, but
    not for one named by address: ask for it as Ray documents (RAY_AUTH_MODE=token).
    Whoever runs a cluster without authentication sets RAY_AUTH_MODE=disabled themselves."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:  # what Ray does itself: set the variable and have its cached config read it again
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    except ImportError:
        os.environ["RAY_AUTH_MODE"] = "token"


def engine_env(engines: EngineSettings, index: int) -> dict[str, str]:
    """Environment variables of engine actor ``index`` alone: the CPU cores of a vLLM
    engine's threads (engines.vllm.cpu_threads_bind), which vLLM on a CPU otherwise
    binds to the same cores in every engine of the machine."""
    binds = engines.vllm.cpu_threads_bind
    if engines.kind == "vllm" and index < len(binds):
        return {"VLLM_CPU_OMP_THREADS_BIND": binds[index]}
    return {}


def placement_group_name(run: str, index: int) -> str:
    return f"{actor_name(run, index)}:pg"


def engine_payload(engines: EngineSettings) -> bytes:
    """The settings an engine actor builds its engine from. A tensor-parallel vLLM engine
    runs its ranks as Ray workers in the engine's placement group (vLLM's ``ray``
    executor), unless engines.vllm.extra_args says otherwise."""
    tp = engines.tensor_parallel_size
    if engines.kind == "vllm" and tp > 1:
        extra = {"tensor_parallel_size": tp, "distributed_executor_backend": "ray", **engines.vllm.extra_args}
        engines = engines.model_copy(update={"vllm": engines.vllm.model_copy(update={"extra_args": extra})})
    return engines.model_dump_json().encode()


def placement_bundles(engines: EngineSettings) -> list[dict[str, float]]:
    """The bundles of a tensor-parallel engine's placement group, all on one node
    (STRICT_PACK): a GPU per rank; the first also holds the actor's CPUs and custom
    resources."""
    first: dict[str, float] = {"GPU": 1.0, **engines.resources}
    if engines.num_cpus:
        first["CPU"] = engines.num_cpus
    return [first] + [{"GPU": 1.0} for _ in range(engines.tensor_parallel_size - 1)]


def placement_group_options(
    engines: EngineSettings, run: str, index: int, *, detached: bool
) -> dict[str, Any]:
    """What ``ray.util.placement_group`` gets for engine ``index`` (tensor_parallel_size > 1)."""
    options: dict[str, Any] = {
        "bundles": placement_bundles(engines),
        "strategy": "STRICT_PACK",
        "name": placement_group_name(run, index),
    }
    if engines.node_labels:
        options["bundle_label_selector"] = [dict(engines.node_labels) for _ in options["bundles"]]
    if detached:
        options["lifetime"] = "detached"
    return options


def actor_options(
    engines: EngineSettings, run: str, index: int, *, detached: bool, group: Any = None
) -> dict[str, Any]:
    """What Ray gets for engine actor ``index``: its name, what it needs and where it may
    run (engines.num_cpus / num_gpus / resources / node_labels / strategy), or, for a
    tensor-parallel engine, the first bundle of its placement group ``group``, whose
    other bundles its ranks (vLLM's Ray workers) take."""
    options: dict[str, Any] = {
        "name": actor_name(run, index),
        "namespace": namespace(run),
        "num_cpus": engines.num_cpus,
        "num_gpus": engines.num_gpus if engines.tensor_parallel_size == 1 else 0,
        "max_restarts": engines.max_restarts,
        "max_task_retries": 0,  # a request of a dead engine fails; the producer retries it
        "get_if_exists": True,
    }
    if engines.resources:
        options["resources"] = dict(engines.resources)
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        )
    else:
        if engines.node_labels:
            options["label_selector"] = dict(engines.node_labels)
        if engines.strategy == "spread":
            options["scheduling_strategy"] = "SPREAD"
    if detached:
        options["lifetime"] = "detached"
    if env := engine_env(engines, index):
        options["runtime_env"] = {"env_vars": env}
    return options


def describe_needs(engines: EngineSettings) -> str:
    """What one engine asks of a node, for the warning of an engine that waits for capacity."""
    needs = [f"{engines.num_cpus:g} CPU"]
    if gpus := engines.gpus_per_engine:
        needs.append(f"{gpus:g} GPU" + (" on one node" if engines.tensor_parallel_size > 1 else ""))
    needs += [f"{amount:g} {name}" for name, amount in engines.resources.items()]
    needs += [f"label {key}={value}" for key, value in engines.node_labels.items()]
    return ", ".join(needs)


def _find_placement_group(name: str) -> Any:
    """The live placement group of that name (any namespace), or None."""
    from ray.util.placement_group import PlacementGroup

    for pg_id, info in ray.util.placement_group_table().items():
        if info.get("name") == name and info.get("state") != "REMOVED":
            return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))
    return None


@ray.remote
class EngineActor:
    """One engine in a Ray actor, bytes in and out. Async methods: the actor serves many
    requests at once."""

    def __init__(self, engine_settings: bytes, index: int) -> None:
        self.index = index
        self.host = EngineHost(make_engine(EngineSettings.model_validate_json(engine_settings)))

    async def generate(self, request: bytes) -> bytes:
        r = loads(request)
        params = SamplingParams.from_dict(r["params"])
        generations = await self.host.generate(
            r["prompt_ids"], params, r["n"], r["request_id"], int(r.get("min_step", 0))
        )
        return dumps([g.to_dict() for g in generations])

    async def sync_weights(self, model_step: int, path: str | None, mode: str) -> int:
        return await self.host.sync_weights(model_step, path, mode)

    async def abort(self, request_ids: bytes) -> int:
        return await self.host.abort(loads(request_ids))

    async def pause(self) -> None:
        await self.host.pause()

    async def resume(self) -> None:
        await self.host.resume()

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        await self.host.update_weights(model_step, path)

    async def health(self) -> bytes:
        return dumps((await self.host.health()).to_dict())

    def weight_digests(self) -> bytes:
        """The engine's model step and the sha256 of each weight it holds, by name
        (shared/transports.py ``tensor_digests``): which weights it generates with, checked
        tensor by tensor against a trainer's. Engines without a torch model in this
        process (vllm, http) give none."""
        model: Any = getattr(self.host.engine, "model", None)
        state = model.state_dict() if hasattr(model, "state_dict") else {}
        return dumps({"model_step": self.host.model_step, "tensors": tensor_digests(state) if state else {}})

    def where(self) -> bytes:
        """The node this engine runs on: Ray's node id, its address, the labels it was
        started with (Ray's own ray.io/ labels left out)."""
        context = ray.get_runtime_context()
        labels = {k: v for k, v in context.get_node_labels().items() if not k.startswith("ray.io/")}
        ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return dumps({"node_id": context.get_node_id(), "ip": ip, "labels": labels})


def create_engine(run: str, engines: EngineSettings, index: int, *, detached: bool = True) -> Any:
    """Engine actor ``index`` of run ``run`` (the one there already, if any), placed as
    the engines settings say; a tensor-parallel one in its own placement group."""
    with contextlib.suppress(ValueError):
        return ray.get_actor(actor_name(run, index), namespace=namespace(run))
    group = None
    if engines.tensor_parallel_size > 1:
        group = _find_placement_group(placement_group_name(run, index))
        if group is None:
            group = ray.util.placement_group(
                **placement_group_options(engines, run, index, detached=detached)
            )
    options = actor_options(engines, run, index, detached=detached, group=group)
    return EngineActor.options(**options).remote(engine_payload(engines), index)  # type: ignore[attr-defined]


def remove_engine(run: str, index: int) -> bool:
    """Kill engine actor ``index`` of the run, for good, and remove its placement group;
    False when there was no such actor."""
    try:
        handle = ray.get_actor(actor_name(run, index), namespace=namespace(run))
    except ValueError:
        handle = None
    if handle is not None:
        ray.kill(handle, no_restart=True)
    group = _find_placement_group(placement_group_name(run, index))
    if group is not None:
        ray.util.remove_placement_group(group)
    return handle is not None


def engine_indices(run: str) -> set[int]:
    """The indices of the run's engine actors registered with the cluster."""
    prefix = actor_name(run, 0)[:-1]
    found = set()
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else str(entry)
        ns = entry.get("namespace") if isinstance(entry, dict) else namespace(run)
        if ns == namespace(run) and name.startswith(prefix) and name[len(prefix) :].isdigit():
            found.add(int(name[len(prefix) :]))
    return found


WAIT_WARNING_S = 15.0  # an engine not up by then waits for capacity: say so, once


def wait_for_engines(engines: EngineSettings, calls: list[Any], timeout_s: float | None = None) -> None:
    """Wait until each engine answers ``calls`` (their health), warning once, naming what
    an engine needs, when some wait for a node that has it."""
    first = min(WAIT_WARNING_S, timeout_s or WAIT_WARNING_S)
    _, pending = ray.wait(list(calls), num_returns=len(calls), timeout=first)
    if pending:
        log.warning(
            "%d of %d engines are not up after %.0f s: waiting for a Ray node with %s (see `ray status`)",
            len(pending), len(calls), WAIT_WARNING_S, describe_needs(engines),
        )  # fmt: skip
    ray.get(calls, timeout=None if timeout_s is None else max(0.0, timeout_s - WAIT_WARNING_S))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
