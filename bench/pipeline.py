"""B2 — the pipeline on the simulated engine: sync against async (max_staleness 0, 1, 2,
4, 8), partial rollout on and off, in steady state, against the engine-capacity bound.

One process, like ``rollstream demo``: E sim engines (in-process), two producers and the
reference trainer (its step a sleep of S), on an embedded redis-server. Response
lengths are lognormal (median m, sigma 1) capped at max_tokens; each sequence decodes
at most v tokens/s and an engine at most T tokens/s in all, T/v = 40, so a few long
stragglers leave a synchronous generation phase mostly idle. An engine decodes at
most 48 sequences at once (1.2 x T/v: its knee, as one sets vLLM's max_num_seqs);
one more row runs the best-known async setting on engines with 256 slots, where
every sequence crawls at T/256 and stragglers go stale. All times are simulated
seconds; the engines run ``time_compression`` times faster than the wall clock and the
trainer's sleep is S / compression. The best async and the best sync configuration
run twice more: the headline ratios are the median [min..max] of the three.

Per configuration: W warm-up steps are skipped, then over the next M steps

  samples/s      samples delivered to the trainer per simulated second
  engine busy    decode tokens produced / (E x T x elapsed), aborted work included
  trainer idle   the trainer's time waiting for its batch / elapsed
  staleness      histogram of t - min(response_versions) - 1 of the trained groups,
                 recomputed from every sample's token versions (violations: >= the bound)
  expired        groups expired by the trainer / (trained + expired)
  /bound         samples/s against the bound: E x T / the mean length of the samples
                 delivered, the samples/s if every engine ran at capacity all the time
                 (= response tokens trained per second / (E x T))
  /dist bound    the same against E x T / the capped lognormal's mean, which flatters:
                 a few thousand heavy-tailed draws mostly average below that mean

    .venv/bin/python bench/pipeline.py            # ~3 min on 2 cores
    .venv/bin/python bench/pipeline.py --quick    # ~20 s
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, cast

import redis
from common import RESULTS, feed_prompts, pyplot, save_figure, show, spread, table, write_json

from rollstream.consumer.assembly import create_reader
from rollstream.consumer.batches import TrainBatch
from rollstream.consumer.trainer import ReferenceTrainer, StepLog
from rollstream.producer.assembly import build_producer
from rollstream.producer.engines.sim import SimEngine
from rollstream.producer.fleet.pool import LocalPool
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.settings import Settings, load_settings


@dataclass(frozen=True, slots=True)
class Params:
    engines: int = 2  # E
    capacity_tps: float = 4_000.0  # T
    speed_tps: float = 100.0  # v: T / v = 40 sequences to fill an engine
    median_tokens: float = 200.0
    sigma: float = 1.0
    max_tokens: int = 2_048
    n: int = 8
    batch: int = 32  # B groups per train step
    step_time_s: float = 7.0  # S, simulated
    producers: int = 2
    max_inflight: int = 32  # groups per producer
    # sequences an engine decodes at once (its KV slots, vLLM's max_num_seqs); more queue.
    # Past T / v a sequence only slows the others down: 1.2 x T / v keeps the engine
    # saturated and each sequence near v, as one tunes a real engine to its knee.
    max_concurrency: int = 48
    compression: float = 20.0
    warmup: int = 2
    steps: int = 6

    @property
    def mean_tokens(self) -> float:
        """Mean of min(X, max_tokens) for X lognormal(ln median, sigma)."""
        mu, s, cap = math.log(self.median_tokens), self.sigma, self.max_tokens

        def phi(x: float) -> float:
            return 0.5 * (1 + math.erf(x / math.sqrt(2)))

        z = (math.log(cap) - mu) / s
        return math.exp(mu + s * s / 2) * phi(z - s) + cap * (1 - phi(z))

    @property
    def bound_samples_per_s(self) -> float:
        return self.engines * self.capacity_tps / self.mean_tokens

    @property
    def capacity_batch_s(self) -> float:
        """Simulated seconds one batch takes with every engine at capacity."""
        return self.batch * self.n / self.bound_samples_per_s


@dataclass(frozen=True, slots=True)
class Config:
    mode: str
    max_staleness: int
    on_weight_sync: str
    max_concurrency: int | None = None  # another engine slot count than the parameters'

    @property
    def name(self) -> str:
        way = "partial" if self.on_weight_sync == "partial" else "no-partial"
        head = "sync" if self.mode == "sync" else f"async k={self.max_staleness}"
        slots = f" {self.max_concurrency} slots" if self.max_concurrency else ""
        return f"{head} {way}{slots}"


CONFIGS = [
    Config("sync", 0, "partial"),
    Config("sync", 0, "abort"),
    *(Config("async", k, way) for k in (0, 1, 2, 4, 8) for way in ("partial", "abort")),
    # the same engines oversubscribed: every sequence slows down, stragglers go stale
    Config("async", 4, "partial", max_concurrency=256),
]


def main() -> dict[str, Any]:
    args = parse_args()
    params = Params(
        compression=args.compression,
        warmup=args.warmup,
        steps=args.steps,
        max_concurrency=args.max_concurrency,
        max_inflight=args.max_inflight,
    )
    print_parameters(params)
    with EmbeddedRedis() as server:
        runs = []
        for config in [c for c in CONFIGS if args.only in c.name]:
            runs.append(run_config(server.url, config, params))
            print(f"  {config.name:<28} {row_text(runs[-1], params)}", flush=True)
        # the headline pair again, for the median and spread of its ratios
        repeats = {r["name"]: [r] for r in headline_runs(runs)}
        for again in range(1, args.repeats):
            for name, done in repeats.items():
                config = next(c for c in CONFIGS if c.name == name)
                done.append(run_config(server.url, config, params))
                print(f"  {name:<28} repeat {again + 1}: {row_text(done[-1], params)}", flush=True)
    summary = summarize(params, runs, list(repeats.values()))
    print()
    print_table(summary)
    plot(summary, RESULTS / "pipeline.png")
    write_json(summary, RESULTS / "pipeline.json")
    return summary


def headline_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best async run at the benchmark's engine parameters, and the best sync run."""
    mine = [r for r in runs if r["config"]["max_concurrency"] is None]
    syncs = [r for r in mine if r["config"]["mode"] == "sync"] or mine
    asyncs = [r for r in mine if r["config"]["mode"] == "async"] or mine
    return [max(asyncs, key=lambda r: r["tokens_per_s"]), max(syncs, key=lambda r: r["tokens_per_s"])]


# --- one configuration ---------------------------------------------------------------


def bench_settings(url: str, config: Config, p: Params) -> Settings:
    slots = config.max_concurrency or p.max_concurrency
    return load_settings(
        run=f"b2-{config.mode}-{config.max_staleness}-{config.on_weight_sync}-{slots}",
        redis={"url": url},
        tasks=[{"name": "math", "n": p.n}],
        engines={
            "count": p.engines,
            "sim": {
                "capacity_tps": p.capacity_tps,
                "speed_tps": p.speed_tps,
                "median_tokens": p.median_tokens,
                "sigma": p.sigma,
                "time_compression": p.compression,
                "max_concurrency": slots,
            },
        },
        rollout={
            "mode": config.mode,
            "batch_size": p.batch,
            "max_staleness": config.max_staleness,
            "on_weight_sync": config.on_weight_sync,
        },
        producer={
            "max_tokens": p.max_tokens,
            "max_inflight": p.max_inflight,
            "is_valid": "keep_all",
            "heartbeat_s": 0.5,
        },
    )


def run_config(url: str, config: Config, p: Params) -> dict[str, Any]:
    settings = bench_settings(url, config, p)
    client = connect(settings.redis)
    client.flushdb()
    feed_prompts(client, settings, (p.warmup + p.steps + 4) * p.batch * 3)
    measured = asyncio.run(_run(settings, client, p))
    client.close()
    return {"config": asdict(config), "name": config.name, **measured}


@dataclass(slots=True)
class Mark:
    """The wall clock and the engines' busy seconds (simulated) at a step's end."""

    t: float
    busy_s: float


@dataclass(slots=True)
class TrainedStep:
    samples: int = 0
    tokens: int = 0
    violations: int = 0  # groups at or past the staleness bound, from their token versions
    mixed: int = 0  # samples whose tokens come from more than one model step (partial rollout)


class BusyMeter:
    """Busy seconds of the sim engines since the start, whoever else calls health()
    (each call resets the engine's own window: producers call it at every weight sync)."""

    def __init__(self, pool: LocalPool) -> None:
        self.engines = [cast(SimEngine, host.engine) for host in pool.hosts]
        self.flushed = [0.0] * len(self.engines)
        for i, engine in enumerate(self.engines):
            engine.health = self._wrap(i, engine)  # type: ignore[method-assign]

    def _wrap(self, index: int, engine: SimEngine) -> Any:
        original = engine.health

        async def health() -> Any:
            engine._advance()
            self.flushed[index] += engine._used / engine.settings.capacity_tps
            return await original()

        return health

    def busy_s(self) -> float:
        return sum(
            flushed + engine._used / engine.settings.capacity_tps
            for flushed, engine in zip(self.flushed, self.engines, strict=True)
        )


class MeasuringTrainer(ReferenceTrainer):
    """The reference trainer, recording what each batch held before it trains on it."""

    def __init__(self, client: redis.Redis, settings: Settings, step_time_s: float) -> None:
        reader = create_reader(settings, client=client, consumer="b2-trainer")
        super().__init__(reader, settings.rollout.sync_weights_interval, step_time_s)
        self.trained: list[TrainedStep] = []

    def train(self, batch: TrainBatch) -> float:
        step = TrainedStep()
        bound = self.reader.plan.stale_threshold
        for group in batch.groups:
            oldest = min(int(s.response_versions.min()) for s in group.samples if len(s.response_versions))
            step.violations += batch.train_step - oldest - 1 >= bound
            for sample in group.samples:
                step.samples += 1
                step.tokens += len(sample.response_ids)
                step.mixed += len(set(sample.response_versions.tolist())) > 1
        self.trained.append(step)
        return super().train(batch)


async def _run(settings: Settings, client: redis.Redis, p: Params) -> dict[str, Any]:
    pool = LocalPool.start(settings.engines)
    meter = BusyMeter(pool)
    producers = [
        build_producer(client, settings, pool=pool, name=f"b2-producer-{i}") for i in range(p.producers)
    ]
    trainer = MeasuringTrainer(client, settings, p.step_time_s / p.compression)
    marks = [Mark(time.monotonic(), meter.busy_s())]

    def on_step(_: StepLog) -> None:
        marks.append(Mark(time.monotonic(), meter.busy_s()))

    stop = asyncio.Event()
    running = [asyncio.create_task(producer.run(stop)) for producer in producers]
    log = await asyncio.to_thread(trainer.run, p.warmup + p.steps, on_step, threading.Event())
    stop.set()
    await asyncio.sleep(0)
    await pool.abort()  # the measurement is over: do not wait for the stragglers
    stats = await asyncio.gather(*running)
    outcomes: Counter[str] = Counter()
    for s in stats:
        outcomes.update(s.outcomes)
    return measure(settings, p, log.steps[p.warmup :], trainer.trained[p.warmup :], marks[p.warmup :]) | {
        "producer_outcomes": dict(outcomes)
    }


def measure(
    settings: Settings, p: Params, steps: list[StepLog], trained: list[TrainedStep], marks: list[Mark]
) -> dict[str, Any]:
    """Steady state over the measured steps: marks[0] ends the last warm-up step."""
    c = p.compression
    elapsed = (marks[-1].t - marks[0].t) * c
    samples = sum(t.samples for t in trained)
    groups = sum(s.groups for s in steps)
    expired = sum(s.expired for s in steps)
    staleness: Counter[int] = Counter()
    for s in steps:
        staleness.update(s.staleness)
    step_s = [(b.t - a.t) * c for a, b in itertools.pairwise(marks)]
    return {
        "samples_per_s": samples / elapsed,
        "tokens_per_s": sum(t.tokens for t in trained) / elapsed,
        "samples_per_s_per_step": spread([p.batch * p.n / s for s in step_s]),
        "step_s": spread(step_s),
        "engine_busy": (marks[-1].busy_s - marks[0].busy_s) / (p.engines * elapsed),
        "trainer_idle": sum(s.wait_s for s in steps) * c / elapsed,
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "staleness_bound": settings.rollout.stale_threshold,
        "staleness_violations": sum(t.violations for t in trained),
        "expired_share": expired / (groups + expired) if groups + expired else 0.0,
        "expired": expired,
        "groups": groups,
        "samples": samples,
        "mean_response_tokens": sum(t.tokens for t in trained) / samples if samples else 0.0,
        "mixed_version_samples": sum(t.mixed for t in trained),
        "elapsed_s": elapsed,
    }


# --- the summary ---------------------------------------------------------------------


def summarize(p: Params, runs: list[dict[str, Any]], repeats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The table of every configuration, and the headline ratios from the repeated
    best async and best sync runs (median and spread; repeat i of one against repeat
    i of the other)."""
    bound = p.bound_samples_per_s
    best, sync = repeats[0], repeats[-1]
    capacity = p.engines * p.capacity_tps
    # The bound for the samples a run delivered: E x T over their mean length. The
    # distribution's mean (``bound``) flatters a run: the mean of a few thousand capped
    # lognormal draws falls below it more often than not (the tail is rare).
    over_bound = spread([r["samples_per_s"] * r["mean_response_tokens"] / capacity for r in best])
    over_sync = spread([a["samples_per_s"] / s["samples_per_s"] for a, s in zip(best, sync, strict=False)])
    return {
        "params": asdict(p)
        | {
            "T_over_v": p.capacity_tps / p.speed_tps,
            "mean_response_tokens": p.mean_tokens,
            "capacity_batch_s": p.capacity_batch_s,
            "time_units": "simulated seconds",
        },
        "bound_samples_per_s": bound,
        "bound_samples_per_s_measured": spread([capacity / r["mean_response_tokens"] for r in best]),
        "async_over_distribution_bound": spread([r["samples_per_s"] / bound for r in best])["median"],
        "runs": runs,
        "best_async": best[0]["name"],
        "best_sync": sync[0]["name"],
        "async_samples_per_s": spread([r["samples_per_s"] for r in best]),
        "sync_samples_per_s": spread([r["samples_per_s"] for r in sync]),
        "async_over_bound": over_bound["median"],
        "async_over_bound_spread": over_bound,
        # the same in tokens: trained samples are shorter than the distribution's mean when
        # expiry drops the groups holding the longest ones
        "async_tokens_over_capacity": spread([r["tokens_per_s"] / capacity for r in best])["median"],
        "sync_tokens_over_capacity": spread([r["tokens_per_s"] / capacity for r in sync])["median"],
        "async_over_sync": over_sync["median"],
        "async_over_sync_spread": over_sync,
        "repeats": {group[0]["name"]: group for group in repeats},
        "staleness_violations": sum(r["staleness_violations"] for r in runs)
        + sum(r["staleness_violations"] for group in repeats for r in group[1:]),
        "targets": {"async_over_bound": 0.95, "async_over_sync": 2.5, "staleness_violations": 0},
    }


def row_text(r: dict[str, Any], p: Params) -> str:
    hist = " ".join(f"{k}:{v}" for k, v in r["staleness"].items())
    of_bound = r["tokens_per_s"] / (p.engines * p.capacity_tps)
    return (
        f"{r['samples_per_s']:6.2f} samples/s ({of_bound:4.0%} of bound), "
        f"step {show(r['step_s'])} s, busy {r['engine_busy']:4.0%}, idle {r['trainer_idle']:4.0%}, "
        f"staleness {hist}, expired {r['expired_share']:.1%}"
    )


def print_parameters(p: Params) -> None:
    print(
        f"B2 pipeline: E={p.engines} sim engines, T={p.capacity_tps:g} tok/s, v={p.speed_tps:g} tok/s "
        f"(T/v={p.capacity_tps / p.speed_tps:g}), lengths lognormal(median {p.median_tokens:g}, "
        f"sigma {p.sigma:g}) capped at {p.max_tokens} (mean {p.mean_tokens:.0f}), n={p.n}, B={p.batch}, "
        f"S={p.step_time_s:g} s, {p.producers} producers x {p.max_inflight} groups in flight, "
        f"{p.max_concurrency} decoding slots an engine"
    )
    print(
        f"  bound E*T/mean = {p.bound_samples_per_s:.2f} samples/s; one batch at capacity "
        f"{p.capacity_batch_s:.1f} s; the longest sequence {p.max_tokens / p.speed_tps:.1f} s"
    )
    print(
        f"  times in simulated seconds, compressed {p.compression:g}x (1 s wall = {p.compression:g} s); "
        f"{p.warmup} warm-up steps skipped, {p.steps} measured"
    )


def print_table(s: dict[str, Any]) -> None:
    bound, p = s["bound_samples_per_s"], s["params"]
    rows = []
    for r in s["runs"]:
        rows.append(
            [
                r["name"],
                f"{r['samples_per_s']:.2f}",
                f"{r['samples_per_s'] / bound:.2f}",
                show(r["step_s"]),
                f"{r['engine_busy']:.0%}",
                f"{r['trainer_idle']:.0%}",
                " ".join(f"{k}:{v}" for k, v in r["staleness"].items()),
                r["staleness_violations"],
                f"{r['expired_share']:.1%}",
                f"{r['mean_response_tokens']:.0f}",
                f"{r['tokens_per_s'] / (p['engines'] * p['capacity_tps']):.2f}",
            ]
        )
    headers = ["config", "samples/s", "/dist bound", "step s [min..max]", "busy", "idle", "staleness", "viol"]
    print(table([*headers, "expired", "mean len", "/bound"], rows))
    n = s["async_over_bound_spread"]["n"]
    print(
        f"bound E*T / mean length of the samples delivered {show(s['bound_samples_per_s_measured'])} "
        f"samples/s (of the distribution: {bound:.2f}); over {n} runs each, median [min..max]: best async "
        f"({s['best_async']}) / bound = {show(s['async_over_bound_spread'])} (target >= 0.95); "
        f"best async / best sync ({s['best_sync']}) = {show(s['async_over_sync_spread'])} "
        f"(target >= 2.5); staleness violations {s['staleness_violations']} (target 0); "
        f"against the distribution's bound: best async {s['async_over_distribution_bound']:.2f}"
    )


def plot(s: dict[str, Any], path: Any) -> None:
    plt = pyplot()
    runs = s["runs"]
    names = [r["name"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    y = range(len(runs))
    left.barh(
        y,
        [r["samples_per_s"] for r in runs],
        color=["tab:gray" if "sync " in n[:5] else "tab:blue" for n in names],
    )
    left.errorbar(
        [r["samples_per_s_per_step"]["median"] for r in runs],
        y,
        xerr=[
            [r["samples_per_s_per_step"]["median"] - r["samples_per_s_per_step"]["min"] for r in runs],
            [r["samples_per_s_per_step"]["max"] - r["samples_per_s_per_step"]["median"] for r in runs],
        ],
        fmt="k.",
        label="per-step median [min..max]",
    )
    left.axvline(s["bound_samples_per_s"], color="tab:red", ls="--", label="engine-capacity bound")
    left.set_yticks(list(y), names)
    left.invert_yaxis()
    left.set_xlabel("samples/s delivered to the trainer (simulated time)")
    left.legend(loc="upper right", fontsize=8)
    width = 0.4
    right.bar([i - width / 2 for i in y], [r["engine_busy"] for r in runs], width, label="engine busy")
    right.bar([i + width / 2 for i in y], [r["trainer_idle"] for r in runs], width, label="trainer idle")
    right.set_xticks(list(y), names, rotation=30, ha="right", fontsize=8)
    right.set_ylim(0, 1)
    right.legend(fontsize=8)
    fig.suptitle("B2: sync vs async on the long-tailed sim engine (steady state)")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    default = Params()
    parser.add_argument("--compression", type=float, default=default.compression)
    parser.add_argument("--warmup", type=int, default=default.warmup, help="steps skipped")
    parser.add_argument("--steps", type=int, default=default.steps, help="steps measured")
    parser.add_argument("--max-concurrency", type=int, default=default.max_concurrency)
    parser.add_argument("--max-inflight", type=int, default=default.max_inflight, help="groups per producer")
    parser.add_argument("--only", default="", help="run the configurations whose name contains this")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the best async and best sync")
    parser.add_argument("--quick", action="store_true", help="2 warm-up + 5 measured steps, 40x, no repeats")
    args = parser.parse_args()
    if args.quick:
        args.compression, args.warmup, args.steps, args.repeats = 40.0, 2, 5, 1
    return args


if __name__ == "__main__":
    main()
