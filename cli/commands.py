"""What each command does, in terms of the library; the parser lives in cli.main."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import redis
from tqdm import tqdm

from rollstream.cli.process import Process, cold_stop, running, start_line, stop_on_signals, wait_until_gone
from rollstream.producer.feeder import Cursor, Feeder
from rollstream.producer.prompts import read_prompt_file
from rollstream.shared import telemetry
from rollstream.shared.buffer import ReplayBuffer, default_consumer_name
from rollstream.shared.connection import check_server, connect, wait_for_redis
from rollstream.shared.errors import CorruptValueError, InputError, SettingsError
from rollstream.shared.events import CONTROL_EVENTS, STOP, WEIGHT_SYNC, RunControl
from rollstream.shared.keys import GROUP_OF_KIND, GROUPS, TRAIN_STEP, Keys, Role
from rollstream.shared.liveness import Heartbeat, live_processes
from rollstream.shared.logs import Ticker, on_terminal
from rollstream.shared.runconfig import check_run_settings, run_identity
from rollstream.shared.scaling import EngineCount
from rollstream.shared.settings import Settings, redact_url
from rollstream.shared.status import RunStatus, run_status
from rollstream.shared.waiting import NotYet, wait_until

log = logging.getLogger("rollstream")
FEED_PART = 5000  # prompts a one-shot feed writes between two updates of its progress bar


def _buffer(settings: Settings, role: str) -> ReplayBuffer:
    return ReplayBuffer(connect(settings.redis), settings, default_consumer_name(role))


def feed(
    settings: Settings,
    path: str,
    task: str,
    stop: threading.Event,
    *,
    first_uid_wins: bool = False,
    wait: bool = False,
) -> int:
    """One-shot feed: every line is checked before anything is written. A person typing it
    gets an unreachable Redis as an error at once (exit 3); with ``wait`` (a script or a
    process manager starting it beside Redis) it waits up to process.wait_timeout_s."""
    settings.task(task)
    prompts = read_prompt_file(path, task, first_uid_wins=first_uid_wins)
    start_line("feed", settings, file=path, task=task)
    if wait:
        waited = wait_for_redis(settings.redis, settings.process.wait_timeout_s, stop)
        if waited is None:
            return 0
        client = waited
    else:
        client = connect(settings.redis)
    run_identity(client, Keys(settings.run), settings.redis.url)  # a run marked lost is not fed again
    check_run_settings(client, Keys(settings.run), settings, default_consumer_name("feed"))
    buffer = ReplayBuffer(client, settings, default_consumer_name("feed"))
    added = existing = 0
    # a progress bar on a terminal: a big file takes a while (each part is idempotent by uid)
    with tqdm(total=len(prompts), unit="prompt", desc=f"feed {task}", disable=not on_terminal()) as bar:
        for start in range(0, len(prompts), FEED_PART):
            part = buffer.feed(prompts[start : start + FEED_PART])
            added, existing = added + part.added, existing + part.existing
            bar.update(part.added + part.existing)
    print(f"{path}: {added} prompts added to task {task!r}, {existing} already there")
    return 0


def run_feeder(
    settings: Settings,
    path: str,
    task: str,
    *,
    epochs: int,
    shuffle: bool,
    seed: int,
    keep_ahead: int,
    stop: threading.Event,
    until_stopped: bool = False,
) -> int:
    """Keep about ``keep_ahead`` unclaimed prompts in the stream until every epoch is
    fed; with ``until_stopped`` stay until SIGTERM or the run's stop event after that,
    so that a process manager does not take a finished feeder for the end of the run."""
    settings.task(task)
    state: dict[str, Any] = {"fed": 0, "epoch": 0}
    with running(
        settings, Role.FEEDER, stop, detail=lambda: dict(state), task=task, file=path, epochs=epochs
    ) as process:
        if process is None:
            return 0
        feeder = Feeder(
            ReplayBuffer(process.client, settings, process.name),
            path,
            task,
            epochs=epochs,
            shuffle=shuffle,
            seed=seed,
            keep_ahead=keep_ahead,
        )
        _, cursor = feeder.start_cursor()
        total = len(feeder.offsets) * epochs
        log.info("feeder: %d prompts x %d epochs, at epoch %d position %d", len(feeder.offsets), epochs,
                 cursor.epoch, cursor.pos)  # fmt: skip
        with tqdm(total=total, initial=feeder.done(cursor), unit="prompt", desc=f"feed {task}",
                  disable=not on_terminal()) as bar:  # fmt: skip
            ticker = Ticker(settings.process.progress_s)

            def on_fed(n: int, at: Cursor) -> None:
                bar.update(n)
                state.update(fed=state["fed"] + n, epoch=at.epoch, pos=at.pos)
                if ticker.due():
                    log.info("feeder: %d prompts fed, epoch %d of %d", feeder.done(at), at.epoch, epochs)

            stats = feeder.run(stop, on_fed)
        done = stats.epoch >= epochs
        log.info("feeder: %s after %d prompts this run, epoch %d of %d",
                 "done" if done else "stopped", stats.fed, stats.epoch, epochs)  # fmt: skip
        if done and until_stopped and not stop.is_set():
            log.info("feeder: every epoch is fed; staying until stopped (the cursor is kept)")
            state["done"] = True
            stop.wait()
    return 0


def format_status(status: RunStatus) -> str:
    lines = [
        f"run {status.run}: model_step {status.model_step}, train_step {status.train_step}"
        f"{', PAUSED' if status.paused else ''}, dead letters {status.dead_letters}, events {status.events}"
        f"{'' if status.run_id is None else f', run id {status.run_id}'}",
        *([f"LOST: {status.lost}"] if status.lost else []),
        f"{'stream':44} {'length':>7} {'pending':>7} {'lag':>7} {'consumers':>9} {'oldest idle':>11}",
    ]
    for s in status.streams:
        idle = "-" if s.oldest_pending_idle_ms is None else f"{s.oldest_pending_idle_ms / 1000:.1f}s"
        lines.append(f"{s.key:44} {s.length:>7} {s.pending:>7} {s.lag:>7} {s.consumers:>9} {idle:>11}")
    for task, a in status.accounts.items():
        lines.append(
            f"prompts of {task}: fed {a.fed} = trained {a.trained} + waiting {a.waiting} + in pools "
            f"{a.in_pools} + filtered {a.filtered} + dropped {a.dropped} + dead {a.dead} + lost {a.lost}"
            + (f" - not fed {a.not_fed}" if a.not_fed else "")
        )
        if a.not_fed:
            lines.append(
                f"  not fed {a.not_fed}: groups of {task} that no producer made from a fed prompt (written "
                "by hand, or by a producer that does not count completed), in the figures above"
            )
    if status.progress:
        lines.append("counts: " + ", ".join(f"{k}={v}" for k, v in status.progress.items()))
    lines.append(
        f"processes ({len(status.processes)} alive):" if status.processes else "processes: none alive"
    )
    for p in status.processes:
        detail = ", ".join(f"{k} {v}" for k, v in p.detail.items())
        lines.append(f"  {p.role:9} {p.name:40} heartbeat {p.age_s:4.1f}s ago  {detail}")
    return "\n".join(lines)


def status(settings: Settings, *, as_json: bool) -> int:
    buffer = _buffer(settings, "status")
    result = run_status(buffer.client, buffer.keys)
    if as_json:
        sys.stdout.write(orjson.dumps(result.to_dict()).decode() + "\n")
    else:
        print(format_status(result))
    return 0


def check(settings: Settings, *, engines: bool = False) -> int:
    """Exit 0 when Redis answers (and, with ``engines``, every engine of the run)."""
    client = connect(settings.redis, check=False, ride_out=False)
    version = check_server(client, settings.redis.url)
    print(f"Redis {version} answers at {redact_url(settings.redis.url)}")
    if not engines:
        return 0
    from rollstream.producer.pool import EnginePool, PoolError, init_ray

    address = settings.ray.address or RunControl(client, Keys(settings.run)).ray_address()
    if not address:
        raise PoolError(f"run {settings.run!r} has no Ray address: is `rollstream engines` running?")
    init_ray(address)
    pool = EnginePool.attach(serving_settings(settings, client))
    assert pool is not None
    silent = []
    for i, health in enumerate(pool.probe()):
        if health is None:
            silent.append(i)
            print(f"engine {i} ({pool.handles[i]}) does not answer")
        else:
            print(f"engine {i} answers: model step {health.model_step}, {health.outstanding} requests")
    if silent:
        raise PoolError(f"{len(silent)} of {len(pool.handles)} engines do not answer: {silent}")
    return 0


def control(settings: Settings, action: str) -> int:
    """pause / resume / stop: an event on the run's events stream that every process follows."""
    if action not in CONTROL_EVENTS:
        raise ValueError(f"unknown run-control action {action!r}; known: {', '.join(CONTROL_EVENTS)}")
    client = connect(settings.redis)
    event_id = RunControl(client, Keys(settings.run)).publish(action)
    print(f"run {settings.run!r}: {action} published (event {event_id})")
    return 0


def steps(settings: Settings, *, train_step: int | None, yes: bool, model_step: int | None = None) -> int:
    """Show the run's step counters and whether they leave it stuck; with ``train_step``
    (and ``yes``) set the last committed train step, for an operator's repair; with
    ``model_step`` (and ``yes``) publish a weight sync to that step even below the run's
    (a rollback, or the repair of a corrupt model_step)."""
    client = connect(settings.redis)
    control = RunControl(client, Keys(settings.run))
    if model_step is not None:
        try:
            shown: Any = control.model_step()
        except CorruptValueError as exc:
            shown = repr(exc.value)
        if not yes:
            print(f"would set model_step {shown} -> {model_step} and publish its weight sync: add --yes "
                  "to do it (stop the trainer first)")  # fmt: skip
            return 1
        event = control.publish(WEIGHT_SYNC, model_step, rollback=True)
        print(f"model_step set {shown} -> {model_step} (weight sync event {event})")
        return 0
    model, train = control.model_step(), control.train_step()
    threshold = settings.rollout.stale_threshold
    # what a group made now (on model_step) would be at the trainer's next step
    staleness = train + 1 - model - 1
    print(f"run {settings.run!r}: model_step {model}, train_step {train} (last committed)")
    print(f"a group made now is {staleness} steps stale at train step {train + 1}; it expires at {threshold}")
    if staleness >= threshold:
        print(
            f"STUCK: every group the producers make expires. Repair with "
            f"`rollstream steps --train-step {model} --yes` (the trainer then goes on at step {model + 1})"
        )
    if train_step is None:
        return 0 if staleness < threshold else 1
    if not yes:
        print(f"would set train_step {train} -> {train_step}: add --yes to do it (stop the trainer first)")
        return 1
    client.hset(Keys(settings.run).state, TRAIN_STEP, train_step)
    print(f"train_step set to {train_step}: a trainer started now goes on at step {train_step + 1}")
    return 0


def dead_letter(settings: Settings, stream: str, entry_id: str, reason: str) -> int:
    """Move one entry of the run (``stream``: KIND:TASK such as groups:math, a stream key,
    or a task for its groups stream) to the dead letters with ``reason``: what an operator
    does with an entry no reader of this version reads, or a group that crashes the
    trainer. Counted in the task's dead (and groups_dead) like every dead letter."""
    keys = Keys(settings.run)
    kind, _, task = stream.partition(":")
    if stream.startswith(f"{keys.base}:"):
        kind, task = keys.parse_stream(stream) or ("", "")
    elif not task:
        kind, task = GROUPS, stream
    if kind not in GROUP_OF_KIND or not task:
        raise InputError(
            f"dead-letter: {stream!r} names no stream of run {settings.run!r}: give KIND:TASK "
            f"(KIND one of {', '.join(GROUP_OF_KIND)}), a stream key, or a task for its groups"
        )
    if not re.fullmatch(r"[0-9]{1,20}-[0-9]{1,20}", entry_id):
        raise InputError(f"dead-letter: {entry_id!r} is not a stream entry id (like 1712345678901-0)")
    if not reason.strip():
        raise InputError("dead-letter: --reason must say why (it is stored with the dead letter)")
    buffer = ReplayBuffer(connect(settings.redis), settings, default_consumer_name("operator"))
    dead, owner, deliveries = buffer.dead_letter_by_hand(kind, task, entry_id, reason)
    if deliveries < 0:
        print(f"{keys.stream(kind, task)} {entry_id} is in {keys.dead} already, as {dead}: nothing done")
        return 0
    held = f"pending for {owner}, delivered {deliveries} times" if owner else "not pending"
    print(f"{keys.stream(kind, task)} {entry_id} ({held}) moved to {keys.dead} as {dead}: by hand: {reason}")
    return 0


def redis_server(settings: Settings, config: str, data_dir: str) -> int:
    """Run redis-server in the foreground with ``config``, on the port of the run's Redis
    URL (and its password), keeping its append-only file in ``data_dir``. It replaces
    this process: SIGTERM reaches redis-server, which saves and exits 0."""
    from urllib.parse import urlsplit

    from rollstream.shared.embedded import find_redis_server

    url = urlsplit(settings.redis.url)
    if url.scheme != "redis" or url.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SettingsError(
            "`rollstream redis` serves this machine's loopback; redis.url is "
            f"{redact_url(settings.redis.url)} (run your own redis-server for other addresses)"
        )
    if not Path(config).is_file():
        raise InputError(f"{config}: no such file (run from the repository root, or give --config)")
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    binary = find_redis_server()
    _check_data_dir(binary, Path(data_dir))
    args = [binary, config, "--port", str(url.port or 6379), "--dir", str(Path(data_dir).resolve())]
    if url.password:
        args += ["--requirepass", url.password]
    log.info("redis starting: %s %s, port %s, data in %s", binary, config, url.port or 6379, data_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(binary, args)
    return 0  # not reached


def _check_data_dir(binary: str, data_dir: Path) -> None:
    """Refuse an append-only directory that ``binary`` cannot load: Redis 7 keeps its AOF
    as appendonlydir/ (a manifest and parts), which Redis 6.2 does not read; it would
    start empty and the run would look lost."""
    from rollstream.shared.embedded import server_version

    version = server_version(binary)
    if (data_dir / "appendonlydir").is_dir() and version < (7,):
        raise InputError(
            f"{data_dir} holds a Redis 7 append-only directory (appendonlydir/) that {binary} "
            f"(Redis {'.'.join(map(str, version))}) cannot load: it would start empty. Put a "
            "redis-server >= 7 on PATH, or move the directory away to start the run afresh"
        )


def engines(
    settings: Settings, *, address: str | None, foreground: bool, stop_engines: bool, stop: threading.Event
) -> int:
    """Start the run's engine actors and exit (detached: they need a Ray cluster that
    outlives this command), keep them while this process runs (--foreground), or remove
    them (--stop)."""
    import signal

    import ray

    from rollstream.producer.pool import EnginePool, PoolError, actor_name, init_ray, namespace

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
        killed = EnginePool.stop(settings)
        with contextlib.suppress(redis.RedisError):
            EngineCount(client, Keys(settings.run)).clear_serving()
        print(f"stopped {killed} engine actors of run {settings.run!r}")
        return 0
    pool: list[EnginePool] = []
    silent = SilentEngines(settings)

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
        pool.append(EnginePool.start(settings, detached=not foreground))
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
                        autoscale_step(settings, pool[0], count, process.client)
                    except (redis.RedisError, CorruptValueError) as exc:
                        log.warning("engines: autoscale skipped: %s", exc)
                with contextlib.suppress(redis.RedisError):
                    wanted = count.wanted()
                    if wanted is not None and wanted != len(pool[0].handles):
                        scale_engines(settings, pool[0], count, wanted, stop, detached=False)
            # producers stopping at the same time still hand their in-flight groups back
            # through the engines: keep them until the producers are gone (bounded)
            wait_until_gone(process, (Role.PRODUCER,))
        finally:
            unwatch()
            killed = EnginePool.stop(settings)
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


SCALE_POLL_S = 1.0  # how often the engines process and producers look at the run's engine counts
DRAIN_S = 120.0  # the longest a scaled-in engine has to finish its groups before it is removed
SILENT_WARNING_S = 10.0  # an engine that does not answer this long is warned about, once
AUTOSCALE_S = 30.0  # how often the engines process applies the run's autoscale rule


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


class SilentEngines:
    """Warns once when an engine stops answering (its node died, it is restarting) and
    says when it answers again: Ray re-creates it on a node with what it needs."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.since: dict[int, float] = {}
        self.warned: set[int] = set()

    def note(self, healths: list[Any]) -> None:
        from rollstream.producer.pool import describe_needs

        now = time.monotonic()
        for i, health in enumerate(healths):
            if health is not None:
                if i in self.warned:
                    log.info("engines: engine %d answers again", i)
                self.since.pop(i, None)
                self.warned.discard(i)
                continue
            first = self.since.setdefault(i, now)
            if now - first >= SILENT_WARNING_S and i not in self.warned:
                self.warned.add(i)
                log.warning(
                    "engines: engine %d has not answered for %.0f s (its node gone?): Ray re-creates it "
                    "(engines.max_restarts %d) on a node with %s, and waits for one; producers send "
                    "its groups to the other engines meanwhile",
                    i, now - first, self.settings.engines.max_restarts, describe_needs(self.settings.engines),
                )  # fmt: skip


def scale_engines(
    settings: Settings, pool: Any, count: EngineCount, target: int, stop: threading.Event, *, detached: bool
) -> None:
    """Grow the run's engines to ``target`` (new actors, announced once they answer) or
    shrink them (announced first, so that producers stop sending them work; drained up to
    DRAIN_S, then removed: what they still hold fails there and producers retry it on
    the engines left)."""
    import ray

    from rollstream.producer.pool import EnginePool, create_engine, describe_needs, remove_engine

    current = len(pool.handles)
    if target > current:
        log.info("engines: scaling out from %d to %d engines", current, target)
        new = [create_engine(settings, i, detached=detached) for i in range(current, target)]
        calls = [h.health.remote() for h in new]
        started, warned = time.monotonic(), False
        while not stop.is_set():
            _, waiting = ray.wait(calls, num_returns=len(calls), timeout=SCALE_POLL_S)
            if not waiting:
                break
            if not warned and time.monotonic() - started > SILENT_WARNING_S:
                warned = True
                log.warning("engines: %d new engines wait for a Ray node with %s (see `ray status`)",
                            len(waiting), describe_needs(settings.engines))  # fmt: skip
        else:
            return
        pool.resize(pool.handles + new)
        count.set_serving(target)
        log.info("engines: %d engines serving", target)
    elif target < current:
        leaving = EnginePool(settings.run, pool.handles[target:])
        count.set_serving(target)  # producers send them no new work from now
        pool.resize(pool.handles[:target])
        log.info("engines: scaling in from %d to %d engines: draining %d", current, target, current - target)
        deadline = time.monotonic() + DRAIN_S
        stop.wait(2 * SCALE_POLL_S + 1)  # the producers' next look at the count
        while time.monotonic() < deadline and not stop.is_set():
            busy = [h for h in leaving.probe(timeout_s=1.0) if h is not None and h.outstanding]
            if not busy:
                break
            stop.wait(0.5)
        else:
            log.warning("engines: the engines scaled in still had requests after %.0f s: removed anyway, "
                        "producers retry them on the engines left", DRAIN_S)  # fmt: skip
        for i in range(target, current):
            remove_engine(settings.run, i)
        pool.forget_retired()
        log.info("engines: %d engines serving", target)


def autoscale_step(settings: Settings, pool: Any, count: EngineCount, client: redis.Redis) -> int | None:
    """One look of the run's autoscale rule (`rollstream engines scale --min A --max B`):
    one engine more while the engines are busy and work waits for producers, one fewer
    while they idle (shared/scaling.py ``autoscale_target``); asks for it as `engines
    scale` does. Returns the count it wants, None without a rule."""
    import statistics

    from rollstream.shared.keys import ABORTED, EVALS, EXPIRED, PROMPTS
    from rollstream.shared.scaling import autoscale_target

    rule = count.autoscale()
    if rule is None:
        return None
    healths = [h for h in pool.probe(timeout_s=2.0) if h is not None]
    busy = statistics.fmean(h.busy_fraction for h in healths) if healths else None
    status = run_status(client, Keys(settings.run))
    lag = sum(s.lag for s in status.streams if s.kind in (PROMPTS, ABORTED, EXPIRED, EVALS))
    current = len(pool.handles)
    target = autoscale_target(current, rule[0], rule[1], busy, lag)
    if target != current:
        log.info("engines: autoscale (min %d, max %d): busy %s, %d prompts waiting: %d -> %d engines",
                 rule[0], rule[1], "-" if busy is None else f"{busy:.2f}", lag, current, target)  # fmt: skip
        count.want(target)
    return target


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
    from rollstream.producer.pool import EnginePool, PoolError, init_ray

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
    pool = EnginePool.attach(serving_settings(settings, client))
    assert pool is not None
    scale_engines(settings, pool, count, target, stop, detached=True)
    print(f"run {settings.run!r}: {target} engines serving")
    return 0


def join_ray(address: str, stop: threading.Event, *, local: bool = False) -> str:
    """``init_ray`` for a process that a process manager stops with SIGTERM: SIGTERM and
    SIGINT stay this process's own (``stop_on_signals``) during ``ray.init`` and after
    ``ray.shutdown``; returns the cluster's GCS address.

    ``ray.init`` first installs a SIGTERM handler of its own (``sys.exit(15)``: a SIGTERM
    during the seconds it takes ended the process with status 15), and Ray's core worker
    then its failure-signal handler, which prints a stack trace for a SIGTERM and, when
    ``ray.shutdown`` removes it, leaves SIGTERM at its default action while Python still
    names our handler: a process manager's SIGTERM after the shutdown (the wait for the
    run's other processes at the end of a run) killed the process (rc -15). Neither is
    installed here."""
    import ray._private.ray_constants as ray_constants
    import ray._private.utils as ray_utils

    from rollstream.producer.pool import init_ray

    install = getattr(ray_utils, "set_sigterm_handler", None)
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True  # read when the core worker starts
    if install is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        return init_ray(address, local=local)
    finally:
        if install is not None:
            ray_utils.set_sigterm_handler = install
        stop_on_signals(stop)


def produce(
    settings: Settings, *, burst: bool, local_engines: bool, address: str | None, stop: threading.Event
) -> int:
    """Run a producer until SIGTERM or the run's stop event (or, with burst, until it
    has no work it may take)."""
    import asyncio

    from rollstream.producer.pool import BasePool, EnginePool, LocalPool, PoolError
    from rollstream.producer.worker import Producer

    with running(settings, Role.PRODUCER, stop, heartbeat=False, follow=False, mode=settings.rollout.mode,
                 engines="local" if local_engines else settings.engines.kind) as process:  # fmt: skip
        if process is None:
            return 0
        pool: BasePool | None
        if local_engines:
            pool = LocalPool.start(settings)
        else:
            ray_address = address or settings.ray.address or _recorded_ray_address(process)
            if not ray_address:
                return 0
            join_ray(ray_address, stop)
            pool = EnginePool.attach(
                serving_settings(settings, process.client), settings.process.wait_timeout_s, stop
            )
            if pool is None:
                return 0

        async def main() -> None:
            done, cold = asyncio.Event(), asyncio.Event()
            loop = asyncio.get_running_loop()
            watcher = threading.Thread(target=_hand_to_loop, args=(stop, loop, done, cold), daemon=True)
            watcher.start()
            producer = Producer(settings, process.client, pool, name=process.name, liveness=process.liveness)
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

    from rollstream.producer.pool import actor_name, namespace

    count = EngineCount(process.client, Keys(process.settings.run))
    while not stop.wait(SCALE_POLL_S):
        try:
            serving = count.serving()
        except (redis.RedisError, CorruptValueError):
            continue
        if serving is None or serving == len(pool.serving()):
            continue
        run = process.settings.run
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

    what = f"the Ray address of run {process.settings.run!r}"
    return wait_until(probe, what, process.settings.process.wait_timeout_s, process.stop)


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


def train(
    settings: Settings,
    *,
    steps: int,
    step_time_s: float,
    consumer: str,
    stop: threading.Event,
    hf_model: str | None = None,
    weights_dir: str = "weights",
    lr: float = 1e-5,
    stop_run: bool = False,
    record: str | None = None,
    eval_file: str | None = None,
    eval_every: int = 10,
    eval_task: str | None = None,
    state_file: str | None = None,
    log_to: str = "",
    log_dir: str | None = None,
) -> int:
    """The reference trainer for ``steps`` steps, a log line per step (and a tqdm bar on
    a terminal); with ``hf_model`` a real policy-optimisation step (the loss the
    ``algorithm`` settings select) whose weights the hf engines load; with
    ``stop_run`` the run's stop event once the steps are done; with ``eval_file``
    its prompts evaluated every ``eval_every`` steps through the coordinator, sampled
    as in training and greedily, a log line each; with ``state_file`` the trainer's own
    record of the run (its id and last committed step), checked at the start: a Redis
    that lost the run is then named, never trained again from step 1."""
    from rollstream.consumer.tracking import open_loggers
    from rollstream.consumer.trainer import ReferenceTrainer, StepLog

    held_out = None
    if eval_file:
        task = eval_task or settings.tasks[0].name
        settings.task(task)
        held_out = read_prompt_file(eval_file, task)  # every line checked before anything runs
        interval = settings.rollout.sync_weights_interval
        if eval_every % interval:
            raise SettingsError(
                f"--eval-every {eval_every} must be a multiple of rollout.sync_weights_interval "
                f"({interval}): an eval runs on the weights a sync has just published"
            )

    policy = None
    if hf_model:
        from rollstream.consumer.pg import PolicyGradient

        policy = PolicyGradient(
            hf_model, weights_dir, lr=lr, device=settings.engines.hf.device, algorithm=settings.algorithm,
            weights=settings.weights, run=settings.run,
        )  # fmt: skip
    last: dict[str, Any] = {}
    rollout = settings.rollout
    own = _read_trainer_record(state_file, settings.run) if state_file else None
    known = (
        (str(own["run_id"]), f"the trainer's record {state_file}: delete it to start afresh") if own else None
    )
    with running(
        settings, Role.TRAINER, stop, name=consumer, detail=lambda: dict(last), known_run=known,
        steps=steps, batch_size=rollout.batch_size, max_staleness=rollout.max_staleness,
    ) as process:  # fmt: skip
        if process is None:
            return 0
        if own is not None:
            _check_trainer_record(process, own, str(state_file))
        evaluator = None
        if held_out:
            from rollstream.consumer.coordinator import BatchCoordinator
            from rollstream.consumer.evaluation import EvalSet, Evaluator

            sampled = EvalSet("heldout", held_out)
            coordinator = BatchCoordinator(process.client, settings, consumer=f"{consumer}-eval")
            evaluator = Evaluator(coordinator, [sampled, sampled.greedy("greedy")], eval_every)
        trainer = ReferenceTrainer(process.client, settings, step_time_s=step_time_s, consumer=consumer,
                                   policy=policy, evaluator=evaluator)  # fmt: skip
        if record:
            trainer.on_commit = _recorder(record)
        # per-step learning figures to TensorBoard and W&B (--log-to), under verl / TRL names
        config = settings.model_dump(mode="json", include={"run", "tasks", "rollout", "algorithm"})
        trackers = open_loggers(log_to, log_dir or str(Path("runs") / settings.run), settings.run, config)
        with tqdm(total=steps, unit="step", desc="train", disable=not on_terminal()) as bar:

            def on_step(entry: StepLog) -> None:
                trackers.log(entry.step, {**entry.figures, **entry.eval})
                if state_file:
                    _write_trainer_record(state_file, process, entry.step)
                bar.update(1)
                # steps_left: `rollstream status --watch` shows the run's ETA from it
                done = last.get("done", 0) + 1
                last.update(step=entry.step, groups=entry.groups, done=done, steps_left=steps - done)
                reward = "-" if entry.reward_mean is None else f"{entry.reward_mean:.3f}"
                log.info(
                    "trainer: step %d, %d groups, expired %d, staleness %s, reward %s, step %.2f s, "
                    "waited %.2f s",
                    entry.step, entry.groups, entry.expired, dict(sorted(entry.staleness.items())), reward,
                    entry.train_s, entry.wait_s,
                )  # fmt: skip
                if entry.eval:
                    shown = {
                        k.removeprefix("eval/"): round(v, 4) for k, v in entry.eval.items() if "mean@" in k
                    }
                    log.info(
                        "trainer: eval at step %d: %s (%.1f s)", entry.step, shown, entry.eval["eval/seconds"]
                    )

            try:
                result = trainer.run(steps, on_step, stop)
            finally:
                trackers.close()
        log.info("trainer: %d steps done%s", len(result.steps), ", stopped" if stop.is_set() else "")
        if stop_run and len(result.steps) == steps:
            event = process.control.publish(STOP)
            log.info("trainer: published the run's stop event %s", event)
    return 0


def _read_trainer_record(path: str, run: str) -> dict[str, Any] | None:
    """The trainer's own record of ``run`` (None when it has none: a new run, or a file
    of another run)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the trainer's record: {exc}") from None
    try:
        record = orjson.loads(raw)
        ok = isinstance(record, dict) and isinstance(record["run_id"], str) and int(record["train_step"]) >= 0
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise InputError(
            f"{path}: not a trainer's record (JSON with run, run_id and train_step): {raw[:80]!r}; "
            "delete it to start the run afresh"
        )
    return record if record.get("run") == run else None


def _check_trainer_record(process: Process, own: dict[str, Any], path: str) -> None:
    """A run id that matches, but a train_step in Redis behind the record's: Redis lost
    its last writes (a crash within the append-only file's fsync second, or an older copy
    of its data). Training again from there would train those steps twice."""
    from rollstream.shared.errors import RunLost
    from rollstream.shared.runconfig import committed_step

    stored, recorded = committed_step(process.client, process.keys), int(own["train_step"])
    if stored < recorded:
        raise RunLost(
            f"run {process.settings.run!r}: Redis at {redact_url(process.settings.redis.url)} holds "
            f"train_step {stored}, but the trainer's record {path} says step {recorded} was committed: "
            "Redis lost its latest writes (an older copy of its data?). Nothing was trained: restore "
            f"Redis's data, or go on from there on purpose with `rollstream steps --train-step {recorded} "
            "--yes` (the groups of the lost steps are gone)"
        )


def _write_trainer_record(path: str, process: Process, step: int) -> None:
    """After each committed step: the run's id and the step, replaced atomically."""
    record = {
        "run": process.settings.run, "run_id": process.run_id, "train_step": step,
        "redis": redact_url(process.settings.redis.url), "ts": time.time(),
    }  # fmt: skip
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_bytes(orjson.dumps(record) + b"\n")
    os.replace(temporary, target)


def _recorder(path: str) -> Any:
    """Append what each step trains, before its commit, and the commit after it, as JSON
    lines: an account of training kept outside Redis (the chaos suite checks against it)."""
    handle = open(path, "ab")  # noqa: SIM115 - open for the life of the process

    def record(step: int, batch: Any) -> None:
        if batch is None:
            entry: dict[str, Any] = {"event": "commit", "step": step, "ts": time.time()}
        else:
            # the oldest version among the tokens decoded, not the group's stored tag
            groups = [[g.group_id, _oldest_version(g)] for g in batch.groups]
            entry = {"event": "read", "step": step, "ts": time.time(), "groups": groups}
        handle.write(orjson.dumps(entry) + b"\n")
        handle.flush()
        os.fsync(handle.fileno())

    return record


def _oldest_version(group: Any) -> int:
    versions = [int(s.response_versions.min()) for s in group.samples if len(s.response_versions)]
    return min(versions, default=-1)
