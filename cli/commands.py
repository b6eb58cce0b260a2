"""What each command does, in terms of the library; the parser lives in cli.main."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from producer.feeder import Cursor, Feeder
from producer.prompts import read_prompt_file
from shared.buffer import ReplayBuffer, default_consumer_name
from shared.connection import check_server, connect
from shared.settings import Settings, redact_url
from shared.status import RunStatus, run_status


def _buffer(settings: Settings, role: str) -> ReplayBuffer:
    return ReplayBuffer(connect(settings.redis), settings, default_consumer_name(role))


def feed(settings: Settings, path: str, task: str) -> int:
    settings.task(task)
    prompts = read_prompt_file(path, task)  # every line is checked before anything is written
    result = _buffer(settings, "feed").feed(prompts)
    print(f"{path}: {result.added} prompts added to task {task!r}, {result.existing} already there")
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
) -> int:
    settings.task(task)
    feeder = Feeder(
        _buffer(settings, "feeder"),
        path,
        task,
        epochs=epochs,
        shuffle=shuffle,
        seed=seed,
        keep_ahead=keep_ahead,
    )
    _, cursor = feeder.start_cursor()
    total = len(feeder.offsets) * epochs
    with tqdm(total=total, initial=feeder.done(cursor), unit="prompt", desc=f"feed {task}") as bar:

        def on_fed(n: int, at: Cursor) -> None:
            bar.update(n)
            bar.set_postfix(epoch=at.epoch)

        stats = feeder.run(stop, on_fed)
    state = "stopped" if stats.epoch < epochs else "done"
    print(f"{path}: {state} after {stats.fed} prompts this run, epoch {stats.epoch} of {epochs}")
    return 0


def format_status(status: RunStatus) -> str:
    lines = [
        f"run {status.run}: model_step {status.model_step}, train_step {status.train_step}, "
        f"dead letters {status.dead_letters}, events {status.events}",
        f"{'stream':44} {'length':>7} {'pending':>7} {'lag':>7} {'consumers':>9} {'oldest idle':>11}",
    ]
    for s in status.streams:
        idle = "-" if s.oldest_pending_idle_ms is None else f"{s.oldest_pending_idle_ms / 1000:.1f}s"
        lines.append(f"{s.key:44} {s.length:>7} {s.pending:>7} {s.lag:>7} {s.consumers:>9} {idle:>11}")
    if status.progress:
        lines.append("counts: " + ", ".join(f"{k}={v}" for k, v in status.progress.items()))
    return "\n".join(lines)


def status(settings: Settings, *, as_json: bool) -> int:
    buffer = _buffer(settings, "status")
    result = run_status(buffer.client, buffer.keys)
    if as_json:
        sys.stdout.write(orjson.dumps(result.to_dict()).decode() + "\n")
    else:
        print(format_status(result))
    return 0


def check(settings: Settings) -> int:
    client = connect(settings.redis, check=False)
    version = check_server(client, settings.redis.url)
    print(f"Redis {version} answers at {redact_url(settings.redis.url)}")
    return 0


def engines(
    settings: Settings, *, address: str | None, foreground: bool, stop_engines: bool, stop: threading.Event
) -> int:
    """Start the run's engine actors and exit (they are detached), keep them tied to this
    process (--foreground), or remove them (--stop)."""
    import ray  # slow to import: only the commands that use Ray pay for it

    from producer.pool import EnginePool, actor_name, init_ray, namespace

    init_ray(address, local=foreground)
    if stop_engines:
        killed = EnginePool.stop(settings)
        print(f"stopped {killed} engine actors of run {settings.run!r}")
        return 0
    EnginePool.start(settings, detached=not foreground)
    names = ", ".join(actor_name(settings.run, i) for i in range(settings.engines.count))
    print(
        f"{settings.engines.count} {settings.engines.kind} engines ready: {names} "
        f"(namespace {namespace(settings.run)}, Ray at {ray.get_runtime_context().gcs_address})",
        flush=True,
    )
    if foreground:
        stop.wait()
        EnginePool.stop(settings)
    return 0


def produce(settings: Settings, *, burst: bool, local_engines: bool, address: str | None) -> int:
    """Run a producer until SIGTERM (or, with burst, until no work is left)."""
    import asyncio
    import signal

    from producer.pool import BasePool, EnginePool, LocalPool, init_ray
    from producer.worker import Producer

    client = connect(settings.redis)
    pool: BasePool
    if local_engines:
        pool = LocalPool.start(settings)
    else:
        init_ray(address)
        pool = EnginePool.attach(settings)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        producer = Producer(settings, client, pool)
        print(f"producer {producer.name} on run {settings.run!r} ({settings.rollout.mode})", flush=True)
        progress = asyncio.create_task(show_progress(producer))
        try:
            stats = await producer.run(stop, burst=burst)
        finally:
            progress.cancel()
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(stats.outcomes.items())) or "nothing"
        print(f"producer {producer.name} stopped: {outcomes}; {stats.weight_syncs} weight syncs", flush=True)

    asyncio.run(main())
    return 0


def train(
    settings: Settings,
    *,
    steps: int,
    step_time_s: float,
    consumer: str,
    hf_model: str | None = None,
    weights_dir: str = "weights",
    lr: float = 1e-5,
) -> int:
    """The reference trainer for ``steps`` steps, a line per step and a tqdm bar; with
    ``hf_model`` a real policy-gradient update whose weights the hf engines load."""
    from consumer.trainer import ReferenceTrainer, StepLog

    policy = None
    if hf_model:
        from consumer.pg import PolicyGradient

        policy = PolicyGradient(hf_model, weights_dir, lr=lr, device=settings.engines.hf.device)
    client = connect(settings.redis)
    trainer = ReferenceTrainer(client, settings, step_time_s=step_time_s, consumer=consumer, policy=policy)
    with tqdm(total=steps, unit="step", desc="train") as bar:

        def on_step(entry: StepLog) -> None:
            bar.update(1)
            reward = "-" if entry.reward_mean is None else f"{entry.reward_mean:.3f}"
            staleness = dict(sorted(entry.staleness.items()))
            bar.write(
                f"step {entry.step}: {entry.groups} groups, staleness {staleness}, reward {reward}, "
                f"wait {entry.wait_s:.2f} s, idle {entry.idle_fraction:.0%}, expired {entry.expired}"
            )

        trainer.run(steps, on_step)
    return 0


async def show_progress(producer: Any, every_s: float = 0.5) -> None:
    """A bar per task: accepted groups toward the current admission limit."""
    import asyncio

    bars = {task: tqdm(desc=task, unit="group", leave=False) for task in producer.batch}
    try:
        while True:
            for task, bar in bars.items():
                bar.total = producer.limit(task)
                bar.n = producer.buffer.accepted(task)
                bar.set_postfix(step=producer.model_step, inflight=len(producer.inflight), refresh=False)
                bar.refresh()
            await asyncio.sleep(every_s)
    finally:
        for bar in bars.values():
            bar.close()


def example_prompts(path: Path, count: int) -> Path:
    """A small arithmetic prompt file with answers, for the demo."""
    rows = [
        {"uid": f"add-{i}", "prompt": f"What is {i} + {2 * i + 1}?", "meta": {"answer": str(3 * i + 1)}}
        for i in range(count)
    ]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path
