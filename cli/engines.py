"""`rollstream engines`: the run's engine actors on Ray, kept, scaled (by hand or by the
autoscale rule) and removed; and joining Ray with SIGTERM left to this process. How the
fleet scales (the autoscale rule, draining, the silent-engine warning) is
producer/fleet/autoscale.py's; this module reads the settings and runs the process."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import redis

from rollstream.cli.process import running, stop_on_signals, wait_until_gone
from rollstream.cli.status import run_status
from rollstream.producer.fleet.autoscale import (
    AUTOSCALE_S,
    SCALE_POLL_S,
    SilentEngines,
    autoscale_step,
    scale_engines,
)
from rollstream.producer.fleet.scaling import EngineCount
from rollstream.shared import telemetry
from rollstream.shared.connection import connect
from rollstream.shared.errors import CorruptValueError, SettingsError
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys, Role
from rollstream.shared.liveness import Heartbeat, live_processes
from rollstream.shared.settings import Settings
from rollstream.shared.waiting import NotYet, wait_until

log = logging.getLogger("rollstream")


def engines(
    settings: Settings, *, address: str | None, foreground: bool, stop_engines: bool, stop: threading.Event
) -> int:
    """Start the run's engine actors and exit (detached: they need a Ray cluster that
    outlives this command), keep them while this process runs (--foreground), or remove
    them (--stop)."""
    import signal

    import ray

    from rollstream.producer.fleet.actors import PoolError, actor_name, init_ray, namespace
    from rollstream.producer.fleet.pool import EnginePool

    address = address or settings.ray.address
    if not foreground and not address and not stop_engines:
        raise SettingsError(
            "detached engines need a Ray cluster that outlives this command: set ray.address "
            "(ROLLSTREAM_RAY__ADDRESS) to one started with `ray start --head`, or use --foreground"
        )
    if stop_engines:
        client = connect(settings.redis)
        recorded = RunControl(client, Keys(settings.run)).ray_address()
        if not (address or recorded):
            raise PoolError(f"run {settings.run!r} has no Ray address: no engines to stop")
        init_ray(address or recorded)
        killed = EnginePool.stop(settings.run, settings.engines.count)
        with contextlib.suppress(redis.RedisError):
            EngineCount(client, Keys(settings.run)).clear_serving()
        print(f"stopped {killed} engine actors of run {settings.run!r}")
        return 0
    pool: list[EnginePool] = []
    silent = SilentEngines(settings.engines)

    def detail() -> dict[str, Any]:
        if not pool or stop.is_set():  # no probing of actors that are being removed
            return {"engines": len(pool[0].handles) if pool else 0, "stopping": stop.is_set()}
        healths = pool[0].probe(timeout_s=1.0)
        silent.note(healths)
        nodes = [_node_of(where) for where in pool[0].locate(timeout_s=1.0)]
        steps = [h.model_step if h is not None else None for h in healths]
        busy = [round(h.busy_total, 4) if h is not None else None for h in healths]
        return {"engines": len(steps), "model_steps": steps, "busy": busy, "nodes": nodes, "ray": gcs}

    gcs = ""
    with running(settings, Role.ENGINES, stop, detail=detail, heartbeat=False, kind=settings.engines.kind,
                 count=settings.engines.count, ray=address or "a local cluster") as process:  # fmt: skip
        if process is None:
            return 0
        count = EngineCount(process.client, Keys(settings.run))
        wanted = count.wanted()
        if wanted is not None and wanted != settings.engines.count:
            log.info("engines: %d engines, as `rollstream engines scale` asked (engines.count is %d)",
                     wanted, settings.engines.count)  # fmt: skip
            settings = with_engine_count(settings, wanted)
        gcs = join_ray(address, stop, local=True)
        log.info("engines: Ray cluster at %s%s", gcs, "" if address else " (started by this process)")
        pool.append(EnginePool.start(settings.run, settings.engines, detached=not foreground))
        unwatch = telemetry.register(
            telemetry.EngineCollector(lambda: [] if stop.is_set() else pool[0].probe(timeout_s=1.0))
        )
        process.control.set_ray_address(gcs)
        count.set_serving(settings.engines.count)
        names = ", ".join(actor_name(settings.run, i) for i in range(settings.engines.count))
        log.info("%d %s engines ready: %s (namespace %s)", settings.engines.count, settings.engines.kind,
                 names, namespace(settings.run))  # fmt: skip
        if not foreground:
            return 0
        beat = Heartbeat(process.liveness, detail).start()
        try:
            next_autoscale = time.monotonic() + AUTOSCALE_S
            while not stop.wait(SCALE_POLL_S):  # follow `rollstream engines scale`
                if time.monotonic() >= next_autoscale:
                    next_autoscale = time.monotonic() + AUTOSCALE_S
                    try:
                        autoscale_step(pool[0], count, lambda: prompts_waiting(process.client, settings.run))
                    except (redis.RedisError, CorruptValueError) as exc:
                        log.warning("engines: autoscale skipped: %s", exc)
                with contextlib.suppress(redis.RedisError):
                    wanted = count.wanted()
                    if wanted is not None and wanted != len(pool[0].handles):
                        scale_engines(
                            settings.run, settings.engines, pool[0], count, wanted, stop, detached=False
                        )
            # producers stopping at the same time still hand their in-flight groups back
            # through the engines: keep them until the producers are gone (bounded)
            wait_until_gone(process, (Role.PRODUCER,))
        finally:
            unwatch()
            killed = EnginePool.stop(settings.run, settings.engines.count)
            with contextlib.suppress(redis.RedisError):
                process.control.clear_ray_address(gcs)
                count.clear_serving()
            log.info("engines: removed %d engine actors of run %r", killed, settings.run)
            # now, not at exit: this process's Ray cluster goes with it. Ray's own signal
            # handlers would turn a SIGTERM meanwhile (the process manager stopping the
            # rest) into death by signal: we are stopping already.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            ray.shutdown()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            # last: the others of a stopping run wait for this key to go before they exit
            beat.stop()
    return 0


def with_engine_count(settings: Settings, count: int) -> Settings:
    return settings.model_copy(update={"engines": settings.engines.model_copy(update={"count": count})})


def serving_settings(settings: Settings, client: redis.Redis) -> Settings:
    """The settings with engines.count as the run's engines process says it serves now
    (after a `rollstream engines scale`), when it says."""
    serving = EngineCount(client, Keys(settings.run)).serving()
    return settings if serving is None else with_engine_count(settings, serving)


def _node_of(where: dict[str, Any] | None) -> str | None:
    """A node as the engines' heartbeat names it: its ``node`` label, else its address
    and the start of Ray's node id."""
    if where is None:
        return None
    return str(where["labels"].get("node") or f"{where['ip']}/{where['node_id'][:8]}")


def prompts_waiting(client: redis.Redis, run: str) -> int:
    """The entries in the run's pools that no producer has taken yet: what the autoscale
    rule (producer/fleet/autoscale.py) weighs against the engines' busy fraction."""
    from rollstream.shared.keys import ABORTED, EVALS, EXPIRED, PROMPTS

    status = run_status(client, Keys(run))
    return sum(s.lag for s in status.streams if s.kind in (PROMPTS, ABORTED, EXPIRED, EVALS))


def engines_scale(
    settings: Settings,
    target: int | None,
    *,
    wait: bool,
    stop: threading.Event,
    autoscale: tuple[int, int] | None = None,
) -> int:
    """`rollstream engines scale N`: ask the run's engines process for N engines (through
    the state hash; an autoscale rule is dropped: the operator's count wins), and with
    ``wait`` wait until it serves them; without an engines process (detached engines)
    scale here. `rollstream engines scale --min A --max B` sets the autoscale rule the
    engines process follows instead."""
    from rollstream.producer.fleet.actors import PoolError, init_ray
    from rollstream.producer.fleet.pool import EnginePool

    client = connect(settings.redis)
    keys = Keys(settings.run)
    count = EngineCount(client, keys)
    engines_process = any(beat.role == Role.ENGINES for beat in live_processes(client, keys))
    if autoscale is not None:
        count.set_autoscale(*autoscale)
        print(
            f"run {settings.run!r}: engines autoscale between {autoscale[0]} and {autoscale[1]}", flush=True
        )
        if not engines_process:
            log.warning("no engines process of run %r is running: the rule applies once `rollstream engines "
                        "--foreground` runs", settings.run)  # fmt: skip
        return 0
    assert target is not None
    count.clear_autoscale()
    count.want(target)
    if engines_process:
        print(f"run {settings.run!r}: asked the engines process for {target} engines", flush=True)
        if not wait:
            return 0

        def served() -> int:
            if count.serving() != target:
                raise NotYet(f"the engines process serves {count.serving()} engines")
            return target

        wait_until(served, f"{target} engines of run {settings.run!r}", settings.process.wait_timeout_s, stop)
        print(f"run {settings.run!r}: {target} engines serving")
        return 0
    address = settings.ray.address or RunControl(client, keys).ray_address()
    if not address:
        raise PoolError(f"run {settings.run!r} has no Ray address: is `rollstream engines` running?")
    init_ray(address)
    pool = EnginePool.attach(settings.run, serving_settings(settings, client).engines.count)
    assert pool is not None
    scale_engines(settings.run, settings.engines, pool, count, target, stop, detached=True)
    print(f"run {settings.run!r}: {target} engines serving")
    return 0


def join_ray(address: str, stop: threading.Event, *, local: bool = False) -> str:
    """``init_ray`` for a process that a process manager stops with SIGTERM: SIGTERM and
    SIGINT stay this process's own (``stop_on_signals``) during ``ray.init`` and after
    ``ray.shutdown``; returns the cluster's GCS address. Ray's handlers, and why none is
    installed: producer/ray_signals.py."""
    from rollstream.producer.ray_signals import init_ray_keeping_signals

    try:
        return init_ray_keeping_signals(address, local=local)
    finally:
        stop_on_signals(stop)
