"""The producer side's long-running commands: `rollstream produce` (and proxy) and
`rollstream judge`, the rq judge worker."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import redis

from rollstream.cli.engines import join_ray, serving_settings
from rollstream.cli.process import Process, cold_stop, running, stop_on_signals, wait_until_gone
from rollstream.producer.fleet.autoscale import SCALE_POLL_S
from rollstream.producer.fleet.scaling import EngineCount
from rollstream.shared.errors import CorruptValueError
from rollstream.shared.keys import Keys, Role
from rollstream.shared.settings import Settings
from rollstream.shared.waiting import NotYet, wait_until

log = logging.getLogger("rollstream")


def produce(
    settings: Settings, *, burst: bool, local_engines: bool, address: str | None, stop: threading.Event
) -> int:
    """Run a producer until SIGTERM or the run's stop event (or, with burst, until it
    has no work it may take)."""
    import asyncio

    from rollstream.producer.assembly import build_producer
    from rollstream.producer.fleet.actors import PoolError
    from rollstream.producer.fleet.pool import BasePool, EnginePool, LocalPool

    with running(settings, Role.PRODUCER, stop, heartbeat=False, follow=False, mode=settings.rollout.mode,
                 engines="local" if local_engines else settings.engines.kind) as process:  # fmt: skip
        if process is None:
            return 0
        pool: BasePool | None
        if local_engines:
            pool = LocalPool.start(settings.engines)
        else:
            ray_address = address or settings.ray.address or _recorded_ray_address(process)
            if not ray_address:
                return 0
            join_ray(ray_address, stop)
            serving = serving_settings(settings, process.client).engines.count
            pool = EnginePool.attach(settings.run, serving, settings.process.wait_timeout_s, stop)
            if pool is None:
                return 0

        async def main() -> None:
            done, cold = asyncio.Event(), asyncio.Event()
            loop = asyncio.get_running_loop()
            watcher = threading.Thread(target=_hand_to_loop, args=(stop, loop, done, cold), daemon=True)
            watcher.start()
            producer = build_producer(
                process.client, settings, pool=pool, name=process.name, liveness=process.liveness
            )
            if isinstance(pool, EnginePool):
                threading.Thread(
                    target=_follow_engine_count, args=(process, pool, loop, stop), daemon=True
                ).start()
            stats = await producer.run(done, burst=burst, cold=cold)
            process.run_stopped = producer.run_stopped
            outcomes = ", ".join(f"{k} {v}" for k, v in sorted(stats.outcomes.items())) or "nothing"
            log.info("producer %s stopped: %s; %d weight syncs", producer.name, outcomes, stats.weight_syncs)
            print(
                f"producer {producer.name} stopped: {outcomes}; {stats.weight_syncs} weight syncs", flush=True
            )

        moved = threading.Event()
        if not local_engines and not (address or settings.ray.address):
            threading.Thread(
                target=_watch_ray_address, args=(process, ray_address, stop, moved), daemon=True
            ).start()
        asyncio.run(main())
        if not local_engines:
            import ray

            ray.shutdown()  # while the engines' cluster still runs: it waits for producers
            stop_on_signals(stop)  # and SIGTERM stays ours for the wait for the others that follows
        if moved.is_set():
            raise PoolError(
                f"the run's engines moved to another Ray cluster ({process.control.ray_address()}); "
                "this producer stopped so that its restart attaches there"
            )
    return 0


def _follow_engine_count(process: Process, pool: Any, loop: Any, stop: threading.Event) -> None:
    """Serve with the engines the run's engines process says serve now: new ones join
    (found by name), those scaled in get no new work."""
    import ray

    from rollstream.producer.fleet.actors import actor_name, namespace

    count = EngineCount(process.client, Keys(process.run))
    while not stop.wait(SCALE_POLL_S):
        try:
            serving = count.serving()
        except (redis.RedisError, CorruptValueError):
            continue
        if serving is None or serving == len(pool.serving()):
            continue
        run = process.run
        try:
            handles = [ray.get_actor(actor_name(run, i), namespace=namespace(run)) for i in range(serving)]
        except ValueError:
            continue  # not registered yet: look again
        log.info("producer: %d engines serve the run now (were %d)", serving, len(pool.serving()))
        with contextlib.suppress(RuntimeError):  # the loop ended
            loop.call_soon_threadsafe(pool.resize, handles)


def _watch_ray_address(
    process: Process, attached: str, stop: threading.Event, moved: threading.Event
) -> None:
    """An engines process that restarted runs a new Ray cluster: a producer attached to the
    old one cannot reach the engines, so it stops (with an error, for its supervisor to
    restart it) instead of failing every group."""
    while not stop.wait(2.0):
        try:
            now = process.control.ray_address()
        except redis.RedisError:
            continue
        if now and now != attached:
            log.error("the run's Ray cluster changed from %s to %s: stopping", attached, now)
            moved.set()
            stop.set()
            return


def _hand_to_loop(stop: threading.Event, loop: Any, done: Any, cold: Any) -> None:
    """SIGTERM sets the thread-side flags; the producer waits on asyncio events: ``done``
    for the first signal, ``cold`` for a second one."""
    stop.wait()
    with contextlib.suppress(RuntimeError):  # the loop already ended (the run's stop event)
        loop.call_soon_threadsafe(done.set)
    flag = cold_stop(stop)
    if flag is None:
        return
    while not flag.wait(0.5):
        if loop.is_closed():
            return
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(cold.set)


def _recorded_ray_address(process: Process) -> str | None:
    """The Ray address the run's engines process recorded, waiting for it."""

    def probe() -> str:
        address = process.control.ray_address()
        if not address:
            raise NotYet("no engines process has recorded one yet (is `rollstream engines` running?)")
        return address

    what = f"the Ray address of run {process.run!r}"
    return wait_until(probe, what, process.timeouts.wait_timeout_s, process.stop)


def judge(settings: Settings, *, stop: threading.Event, burst: bool = False) -> int:
    """An rq worker on the judge queue (JSON serializer, never pickle) that waits for Redis,
    keeps a heartbeat and follows the run's stop event. rq installs its own SIGTERM
    handler (a warm shutdown: the running job finishes); a stop event is handed to it
    the same way."""
    import os
    import signal

    from rq import Queue
    from rq.serializers import JSONSerializer
    from rq.worker import WorkerStatus

    from rollstream.producer.judges.rq import JUDGE_QUEUE, JudgeWorker
    from rollstream.shared.connection import refuse_on_cluster

    refuse_on_cluster(settings.redis, "the rq judge worker")  # rq's keys share no hash tag
    with running(settings, Role.JUDGE, stop, queue=JUDGE_QUEUE) as process:
        if process is None:
            return 0
        queue = Queue(JUDGE_QUEUE, connection=process.client, serializer=JSONSerializer)
        worker = JudgeWorker([queue], connection=process.client, serializer=JSONSerializer)

        worked = threading.Event()

        def hand_over() -> None:
            stop.wait()
            if process.run_stopped:  # producers still wait on their last judge jobs
                wait_until_gone(process, (Role.PRODUCER,))
            # to rq's own SIGTERM handler (a warm stop), once its work loop listens: a stop
            # that came while the worker was starting was taken by ours, and the worker then
            # judged on, beating, for ever (every other process of the run waited for it)
            while not worked.is_set():
                if signal.getsignal(signal.SIGTERM) == worker.request_stop and worker.get_state() in (
                    WorkerStatus.IDLE, WorkerStatus.BUSY,
                ):  # fmt: skip
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                worked.wait(0.05)

        threading.Thread(target=hand_over, daemon=True).start()
        # rq logs four lines per job at INFO: only with -v
        level = logging.getLogger().level
        try:
            worker.work(burst=burst, logging_level="DEBUG" if level <= logging.DEBUG else "WARNING")
        finally:
            worked.set()
        # rq leaves its cold-stop handler (SystemExit) on SIGTERM: a process manager's SIGTERM
        # during the wait for the run's other processes that follows cut that wait short
        stop_on_signals(stop)
        log.info("judge: worker %s stopped", worker.name)
    return 0
