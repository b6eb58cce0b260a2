"""The operator's commands on a run: status, check, pause / resume / stop, steps,
dead-letter, and redis (a redis-server for a run on this machine)."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import orjson

from rollstream.cli.engines import serving_settings
from rollstream.cli.status import RunStatus, run_status
from rollstream.shared import rewind
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import default_consumer_name
from rollstream.shared.connection import check_server, connect, eviction_risk
from rollstream.shared.errors import CorruptValueError, InputError, SettingsError
from rollstream.shared.events import CONTROL_EVENTS, WEIGHT_SYNC, RunControl
from rollstream.shared.keys import GROUP_OF_KIND, GROUPS, REWOUND, TRAIN_STEP, Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings
from rollstream.shared.settings_errors import redact_url

log = logging.getLogger("rollstream")


def _buffer(settings: Settings, role: str) -> ReplayBuffer:
    return open_buffer(connect(settings.redis), settings, default_consumer_name(role))


def format_status(status: RunStatus) -> str:
    lines = [
        f"run {status.run}: model_step {status.model_step}, train_step {status.train_step}"
        f"{', PAUSED' if status.paused else ''}, dead letters {status.dead_letters}, events {status.events}"
        f"{'' if status.run_id is None else f', run id {status.run_id}'}",
        *([f"LOST: {status.lost}"] if status.lost else []),
        *([f"REWOUND: {status.rewound}"] if status.rewound else []),
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
    risk = eviction_risk(client)
    if risk is not None:
        print(f"warning: {risk}")
    if not engines:
        return 0
    from rollstream.producer.fleet.actors import PoolError, init_ray
    from rollstream.producer.fleet.pool import EnginePool

    address = settings.ray.address or RunControl(client, Keys(settings.run)).ray_address()
    if not address:
        raise PoolError(f"run {settings.run!r} has no Ray address: is `rollstream engines` running?")
    init_ray(address)
    pool = EnginePool.attach(settings.run, serving_settings(settings, client).engines.count)
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
    keys = Keys(settings.run)
    pipe = client.pipeline(transaction=True)
    pipe.hget(keys.state, REWOUND)
    pipe.hset(keys.state, TRAIN_STEP, train_step)
    pipe.hdel(keys.state, REWOUND)
    wound = pipe.execute()[0]
    print(f"train_step set to {train_step}: a trainer started now goes on at step {train_step + 1}")
    if wound is not None:  # the operator's decision to go on from a rewound run
        print(f"cleared the run's rewound mark: {rewind.marked(wound)}")
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
    buffer = open_buffer(connect(settings.redis), settings, default_consumer_name("operator"))
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
