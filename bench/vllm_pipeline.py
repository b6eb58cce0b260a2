"""P5 — rollstream's pipeline on a vLLM engine against vLLM alone, and the weight-sync
time of each engine kind.

Throughput: the same prompts, n, max_tokens and sampling, two ways, in one run.

  rollstream  ``rollstream engines --foreground`` (engines.kind = vllm: AsyncLLM in a
              Ray engine actor), ``rollstream produce`` attached to it, and in this
              process a trainer that only commits (the reference trainer, step time 0;
              it publishes a weight sync after every step, which the producer applies
              to the engine in partial mode) on an embedded redis-server. A round feeds
              K prompts and ends when the trainer has committed their batch.
  vLLM alone  AsyncLLM in one process (a child of this one), the K requests of n
              samples sent at once, as the producer sends them; a round ends with
              the last. Same engine arguments, same SamplingParams as rollstream's
              engine builds (logprobs of the sampled tokens, final output only).

Both engines stay up for the whole run and idle while the other has its round; each
runs its engine threads on core 0 (VLLM_CPU_OMP_THREADS_BIND), the rest (producer,
Ray, Redis, trainer, vLLM's front-end process) is unbound. Rounds alternate — a
warm-up of each, then A B A B ... — to cancel the drift of a shared machine; the
ratio is of generated tokens/s, pair by pair (median [min..max]). Each round also
records where the CPU went (per process group) and, for rollstream, when the groups
reached the stream and the trainer.

The model is a random tied Llama (hidden 128, 2 heads, 2 layers; a word-level
vocabulary of 1,006 tokens) with no end-of-sequence token: every response runs to
max_tokens on both sides (checked), the producer having no ignore_eos. With hidden
128 the engine's own work per token is small, so whatever rollstream adds per group
weighs as much as it ever will: a worst case for the ratio.

Weight syncs: EngineHost.sync_weights(step, path, "partial") — pause, reload the
safetensors at path, label the weights with the step, resume — per engine kind, in
the process that hosts the engine: sim and hf in this one, vllm in the vLLM-alone
child (the VLLMEngine of the actor, without Ray), openai against a vLLM server
started afterwards. Every reload alternates between two model directories; idle,
and (vllm, openai) while requests decode; also a sync without a path (a new label
only, as this benchmark's trainer publishes). Median [min..max] of several.

    .venv/bin/python bench/vllm_pipeline.py            # ~5 min on 2 cores
    .venv/bin/python bench/vllm_pipeline.py --quick    # ~2 min: small rounds, no server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis
from common import (
    REPO,
    RESULTS,
    TINY_LLAMA,
    VLLM_ENV,
    Spawned,
    show,
    spread,
    start_vllm_server,
    table,
    tiny_llama,
    write_json,
)

from rollstream.consumer.assembly import create_reader
from rollstream.consumer.batches import TrainBatch
from rollstream.consumer.trainer import ReferenceTrainer, StepLog
from rollstream.producer.engines.base import Engine, SamplingParams
from rollstream.producer.fleet.host import EngineHost
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import STOP, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.liveness import live_processes
from rollstream.shared.records import Prompt
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings

TARGET_RATIO = 0.9
ROLLSTREAM, ACTOR, ALONE = "rollstream", "actor", "alone"  # the three ways a round runs
REPLY = "P5> "  # the vLLM-alone child's replies on its stdout, among vLLM's log lines
START_S = 600.0  # longest wait for an engine to start on a loaded 2-core machine
ROUND_S = 600.0


@dataclass(frozen=True)
class Params:
    prompts: int = 16  # K: groups a round
    n: int = 8
    max_tokens: int = 192
    temperature: float = 1.0
    repeats: int = 6  # measured rounds of each way; even: as many forwards as backwards
    producers: int = 1
    syncs: int = 8  # of each kind of sync, per engine kind
    openai: bool = True
    cpu_bind: str = "0"
    model: dict[str, int] = field(default_factory=lambda: dict(TINY_LLAMA))

    @property
    def tokens_a_round(self) -> int:
        return self.prompts * self.n * self.max_tokens


def main() -> dict[str, Any]:
    args = parse_args()
    if args.alone:
        asyncio.run(alone(json.loads(args.alone)))
        return {}
    p = Params(
        prompts=args.prompts,
        n=args.n,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        producers=args.producers,
        syncs=args.syncs,
        openai=not args.no_openai,
    )
    load = os.getloadavg()
    print(
        f"P5 vLLM: K={p.prompts} prompts a round x n={p.n} x {p.max_tokens} tokens "
        f"({p.tokens_a_round:,} tokens), {p.repeats} rounds of each way after a warm-up of each, "
        f"{p.producers} producer process(es); tiny Llama {p.model}; engine threads on core {p.cpu_bind}; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="p5-") as tmp:
        root = Path(args.logs or tmp)  # the models and every process's log
        root.mkdir(parents=True, exist_ok=True)
        models = [tiny_llama(root / name, seed, **p.model) for name, seed in (("a", 1), ("b", 2))]
        throughput, syncs = run_all(p, root, models)
    result = summarize(p, throughput, syncs, load)
    print()
    print_tables(result)
    write_json(result, RESULTS / "vllm_pipeline.json")
    return result


def run_all(p: Params, root: Path, models: list[Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    syncs: dict[str, Any] = {}
    with EmbeddedRedis() as server:
        settings = bench_settings(server.url, p, models[0])
        started = time.monotonic()
        side = Pipeline(settings, p, root)
        child = Alone(settings, p, root / "alone.log")
        try:
            child.wait_ready()
            side.wait_ready()
            print(f"  both engines up in {time.monotonic() - started:.0f} s", flush=True)
            direct = Direct(settings, p, side.client)
            try:
                throughput = alternate(p, side, child, direct, settings)
            finally:
                direct.close()
            side.stop_run()
            syncs["vllm"] = child.syncs([str(m) for m in models], p.syncs)
        finally:
            codes = side.stop()
            child.stop()
        throughput["exit_codes"] = codes
    syncs["sim"] = asyncio.run(sim_syncs(p))
    syncs["hf"] = asyncio.run(hf_syncs(p, models))
    if p.openai:
        syncs["openai"] = openai_syncs(p, models, root / "server.log")
    return throughput, syncs


# --- settings ------------------------------------------------------------------------


def bench_settings(url: str, p: Params, model: Path) -> Settings:
    return load_settings(run="p5-vllm", redis={"url": url}, **sections(p, model))


def sections(p: Params, model: Path) -> dict[str, Any]:
    """The run's settings, as this process loads them and the others get them (one JSON
    environment variable per section: every process of a run has the same)."""
    return {
        "tasks": [{"name": "math", "n": p.n}],
        "engines": {
            "kind": "vllm",
            "count": 1,
            "vllm": {
                "model": str(model),
                "dtype": "float32",
                "max_model_len": 512,
                "enforce_eager": True,
                "kv_cache_memory_bytes": 256 << 20,
                "seed": 0,
                "cpu_threads_bind": [p.cpu_bind],
            },
        },
        "rollout": {
            "mode": "async",
            "batch_size": p.prompts,
            "max_staleness": 1,
            "on_weight_sync": "partial",
        },
        "producer": {
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "max_inflight": -(-p.prompts // p.producers),  # every group of a round at once
            "is_valid": "keep_all",
            "heartbeat_s": 0.5,
        },
        "process": {"liveness_ttl_s": 3.0},
    }


def run_env(settings: Settings, p: Params, model: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS"))}
    env.update(VLLM_ENV)
    env.update({"ROLLSTREAM_REDIS__URL": settings.redis.url, "ROLLSTREAM_RUN": settings.run})
    env.update({f"ROLLSTREAM_{k.upper()}": json.dumps(v) for k, v in sections(p, model).items()})
    env["PYTHONPATH"] = str(REPO)
    return env


def round_prompts(index: int, count: int) -> list[Prompt]:
    """The same K prompts every round, under new uids."""
    return [
        Prompt(
            uid=f"r{index}-{i}",
            task="math",
            prompt=f"What is {i} + {2 * i + 1}?",
            meta={"answer": str(3 * i + 1)},
        )
        for i in range(count)
    ]


# --- rollstream's side ---------------------------------------------------------------


@dataclass(slots=True)
class Round:
    way: str  # ROLLSTREAM, ACTOR or ALONE
    index: int
    seconds: float
    tokens: int
    sequences: int
    short: int  # sequences that ended before max_tokens (none expected)
    # seconds from the start to the first and the last group done (rollstream: in the
    # stream, by Redis time; the trainer's commit ends the round)
    first_done_s: float
    last_done_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process group
    cpu_by_process: dict[str, float] = field(default_factory=dict)  # by process name, >= 0.05 s
    # rollstream: the longest generate_s a producer recorded for a group (claim to the
    # engine's last reply), and the staleness histogram of the trained groups
    generate_s: float | None = None
    staleness: dict[str, int] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(slots=True)
class Trained:
    """What one train step read: its tokens, when its groups reached the stream."""

    tokens: int
    sequences: int
    short: int
    appended_ms: list[int]  # Redis time of each group's entry (its id)
    generate_s: list[float]  # each group's generate time as its producer recorded it
    at: float = 0.0  # when the step was committed (this process's monotonic clock)
    staleness: dict[str, int] = field(default_factory=dict)


class CommittingTrainer(ReferenceTrainer):
    """The reference trainer (step time 0: read, commit, publish), counting what it trained."""

    def __init__(self, client: redis.Redis, settings: Settings, max_tokens: int) -> None:
        reader = create_reader(settings, client=client, consumer="p5-trainer")
        super().__init__(reader, settings.rollout.sync_weights_interval, step_time_s=0.0)
        self.max_tokens = max_tokens
        self.counted: dict[int, Trained] = {}

    def train(self, batch: TrainBatch) -> float:
        lengths = [len(s.response_ids) for g in batch.groups for s in g.samples]
        items = [item for b in batch.batches.values() for item in b.items]
        self.counted[batch.train_step] = Trained(
            tokens=sum(lengths),
            sequences=len(lengths),
            short=sum(n < self.max_tokens for n in lengths),
            appended_ms=[int(item.entry.id.split("-")[0]) for item in items],
            generate_s=[item.group.timings.get("generate_s", float("nan")) for item in items],
        )
        return super().train(batch)


class Pipeline:
    """The rollstream side: the engines process, producer processes, a trainer thread."""

    def __init__(self, settings: Settings, p: Params, root: Path) -> None:
        self.settings, self.p = settings, p
        self.client = connect(settings.redis)
        self.keys = Keys(settings.run)
        self.buffer = open_buffer(self.client, settings, "p5-feeder")
        self.buffer.ensure("math")
        self.env = run_env(settings, p, Path(settings.engines.vllm.model))
        self.engines = Spawned.rollstream(self.env, root / "engines.log", "engines", "--foreground")
        self.producers: list[Spawned] = []
        self.root = root
        self.trained: queue.Queue[Trained] = queue.Queue()
        self.trainer = CommittingTrainer(connect(settings.redis), settings, p.max_tokens)
        self.stop_trainer = threading.Event()
        self.thread = threading.Thread(target=self._train, daemon=True)

    def wait_ready(self) -> None:
        """The engine actor up (the engines process beats once its actors are ready),
        then the producers, attached to it (they beat once attached)."""
        wait(lambda: self._alive("engines") >= 1, "the engines process", [self.engines], START_S)
        self.producers = [
            Spawned.rollstream(self.env, self.root / f"producer-{i}.log", "produce")
            for i in range(self.p.producers)
        ]
        wait(lambda: self._alive("producer") >= self.p.producers, "the producers", self.processes, START_S)
        self.thread.start()

    @property
    def processes(self) -> list[Spawned]:
        return [self.engines, *self.producers]

    def _alive(self, role: str) -> int:
        return sum(b.role == role for b in live_processes(self.client, self.keys))

    def _train(self) -> None:
        def on_step(entry: StepLog) -> None:
            trained = self.trainer.counted.pop(entry.step)
            trained.at = time.monotonic()
            trained.staleness = {str(k): v for k, v in sorted(entry.staleness.items())}
            self.trained.put(trained)

        self.trainer.run(10**6, on_step, self.stop_trainer)

    def round(self, index: int, meter: CpuMeter) -> Round:
        prompts = round_prompts(index, self.p.prompts)
        fed_ms = redis_ms(self.client)
        started = time.monotonic()
        self.buffer.feed(prompts)
        trained = self._next_step()
        seconds = trained.at - started
        stamps = trained.appended_ms
        return meter.fill(
            Round(
                ROLLSTREAM,
                index,
                seconds,
                trained.tokens,
                trained.sequences,
                trained.short,
                first_done_s=(min(stamps) - fed_ms) / 1000,
                last_done_s=(max(stamps) - fed_ms) / 1000,
                generate_s=max(trained.generate_s),
                staleness=trained.staleness,
            )
        )

    def _next_step(self) -> Trained:
        deadline = time.monotonic() + ROUND_S
        while time.monotonic() < deadline:
            try:
                return self.trained.get(timeout=1.0)
            except queue.Empty:
                for process in self.processes:
                    process.check()
                if not self.thread.is_alive():
                    raise RuntimeError("the trainer thread ended") from None
        raise RuntimeError(f"no train step within {ROUND_S:g} s")

    def cpu_groups(self) -> dict[str, list[int]]:
        redis_pid = int(self.client.info("server")["process_id"])
        return {
            "engines (Ray, actor, EngineCore)": [self.engines.process.pid],
            "producers": [s.process.pid for s in self.producers],
            "redis": [redis_pid],
            "trainer (this process)": [os.getpid()],
        }

    def stop_run(self) -> None:
        """The run's stop event: the producers and then the engines process end by themselves."""
        self.stop_trainer.set()
        self.thread.join(timeout=30)
        RunControl(self.client, self.keys).publish(STOP)

    def stop(self) -> dict[str, int]:
        """Exit codes: the processes' own after the stop event, else -9 (killed)."""
        codes = {}
        for process in [*self.producers, self.engines]:
            codes[process.log.stem] = process.wait(60) if self.stop_trainer.is_set() else process.stop()
        return codes


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


# --- vLLM alone (a child process) ------------------------------------------------------


class Alone:
    """The vLLM-alone child: ``python bench/vllm_pipeline.py --alone SPEC``, answering
    one JSON command a line on its stdin with one ``REPLY`` line on its stdout."""

    def __init__(self, settings: Settings, p: Params, log: Path) -> None:
        self.p = p
        spec = {"engines": settings.engines.model_dump(), "bind": p.cpu_bind}
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
        env.update(VLLM_ENV)
        env["VLLM_CPU_OMP_THREADS_BIND"] = p.cpu_bind
        env["PYTHONPATH"] = str(REPO)
        command = [sys.executable, str(Path(__file__).resolve()), "--alone", json.dumps(spec)]
        self.log = log
        self.out = log.open("w")
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.tokenizer: Any = None

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(REPLY):
                self.replies.put(json.loads(line[len(REPLY) :]))
            else:
                self.out.write(line)
                self.out.flush()

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                reply = self.replies.get(timeout=1.0)
            except queue.Empty:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"vLLM alone exited {self.process.returncode}:\n{self.tail()}"
                    ) from None
                continue
            if "error" in reply:
                raise RuntimeError(f"vLLM alone: {reply['error']}")
            return reply
        raise RuntimeError(f"vLLM alone did not answer within {timeout_s:g} s:\n{self.tail()}")

    def ask(self, command: dict[str, Any], timeout_s: float = ROUND_S) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._reply(timeout_s)

    def wait_ready(self) -> None:
        self._reply(START_S)

    def round(self, index: int, prompt_ids: list[list[int]], meter: CpuMeter) -> Round:
        started = time.monotonic()
        reply = self.ask(
            {"op": "generate", "round": index, "prompts": prompt_ids, "n": self.p.n,
             "max_tokens": self.p.max_tokens, "temperature": self.p.temperature}
        )  # fmt: skip
        seconds = time.monotonic() - started
        return meter.fill(
            Round(
                ALONE, index, seconds, reply["tokens"], reply["sequences"], reply["short"],
                first_done_s=reply["first_done_s"], last_done_s=reply["last_done_s"],
            )
        )  # fmt: skip

    def cpu_groups(self) -> dict[str, list[int]]:
        return {"vLLM alone (front end, EngineCore)": [self.process.pid]}

    def syncs(self, paths: list[str], count: int) -> dict[str, Any]:
        syncs: dict[str, Any] = self.ask({"op": "syncs", "paths": paths, "count": count})["syncs"]
        return syncs

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.ask({"op": "quit"}, timeout_s=60)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, 9)  # vLLM's engine processes, if any are left
        self.out.close()

    def tail(self, lines: int = 40) -> str:
        self.out.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


async def alone(spec: dict[str, Any]) -> None:
    """The child: rollstream's VLLMEngine (for the sync timings) whose AsyncLLM the
    generate command drives directly, with no rollstream code on its path."""

    from rollstream.producer.engines.vllm import VLLMEngine
    from rollstream.shared.engine_settings import EngineSettings

    def reply(data: dict[str, Any]) -> None:
        print(REPLY + json.dumps(data), flush=True)

    settings = EngineSettings.model_validate(spec["engines"])
    engine = VLLMEngine(settings.vllm)
    await engine.update_weights(0)  # its start-up label, as the actor's first request does
    reply({"ready": True})
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            break
        command = json.loads(line)
        try:
            if command["op"] == "quit":
                reply({"bye": True})
                break
            if command["op"] == "generate":
                reply(await alone_round(engine, command))
            elif command["op"] == "syncs":
                reply({"syncs": await time_syncs(engine, command["paths"], command["count"], busy=True)})
        except Exception as exc:  # the parent raises it, with the child's log
            reply({"error": f"{type(exc).__name__}: {exc}"})
    engine.llm.shutdown()


async def alone_round(engine: Any, command: dict[str, Any]) -> dict[str, Any]:
    """The round's requests straight to the engine's AsyncLLM, all at once, with the
    SamplingParams rollstream's engine builds for a producer's request."""
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=command["max_tokens"], temperature=command["temperature"])
    sampling = engine._sampling(params, command["n"], command["max_tokens"])
    started = time.monotonic()

    async def one(i: int, ids: list[int]) -> tuple[Any, float]:
        final = None
        request_id = f"alone-{command['round']}-{i}"
        async for output in engine.llm.generate(TokensPrompt(prompt_token_ids=ids), sampling, request_id):
            final = output
        return final, time.monotonic() - started

    done = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(command["prompts"])))
    lengths = [len(o.token_ids) for f, _ in done for o in f.outputs]
    return {
        "tokens": sum(lengths),
        "sequences": len(lengths),
        "short": sum(n < command["max_tokens"] for n in lengths),
        "first_done_s": min(t for _, t in done),
        "last_done_s": max(t for _, t in done),
    }


# --- the throughput rounds -----------------------------------------------------------


class Direct:
    """The engine actor without the rest of rollstream: this process sends a round's K
    requests through EnginePool (one Ray actor call each, as a producer makes them) and
    waits for them. Set beside the other two, it tells the Ray hop (actor / alone) from
    the producer, Redis and the trainer (rollstream / actor)."""

    def __init__(self, settings: Settings, p: Params, client: redis.Redis) -> None:
        from rollstream.producer.fleet.actors import init_ray
        from rollstream.producer.fleet.pool import EnginePool

        self.p = p
        init_ray(RunControl(client, Keys(settings.run)).ray_address())
        pool = EnginePool.attach(settings.run, settings.engines.count, timeout_s=60)
        assert pool is not None
        self.pool = pool

    def round(self, index: int, prompt_ids: list[list[int]], meter: CpuMeter) -> Round:
        params = SamplingParams(max_tokens=self.p.max_tokens, temperature=self.p.temperature)

        async def main() -> list[tuple[list[int], float]]:
            started = time.monotonic()

            async def one(i: int, ids: list[int]) -> tuple[list[int], float]:
                result = await self.pool.generate(ids, params, self.p.n, f"actor-{index}-{i}")
                if result.failed:
                    raise RuntimeError(f"the engine actor failed a request: {result.error}")
                return [len(g.response_ids) for g in result.generations], time.monotonic() - started

            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompt_ids)))

        started = time.monotonic()
        done = asyncio.run(main())
        seconds = time.monotonic() - started
        lengths = [n for group, _ in done for n in group]
        return meter.fill(
            Round(
                ACTOR, index, seconds, sum(lengths), len(lengths),
                sum(n < self.p.max_tokens for n in lengths),
                first_done_s=min(t for _, t in done), last_done_s=max(t for _, t in done),
            )
        )  # fmt: skip

    def close(self) -> None:
        import ray

        ray.shutdown()


def alternate(p: Params, side: Pipeline, child: Alone, direct: Direct, settings: Settings) -> dict[str, Any]:
    """A warm-up round of each way, then ``p.repeats`` sets of one round of each, in turn
    forwards and backwards (a drift over a set then weighs on each way alike)."""
    from rollstream.producer.tokenizer import make_tokenizer

    tokenizer = make_tokenizer(settings.engines)  # the producer's: the same ids

    def ids(index: int) -> list[list[int]]:
        return [tokenizer.encode(q.prompt) for q in round_prompts(index, p.prompts)]

    ways: dict[str, Callable[[int, CpuMeter], Round]] = {
        ROLLSTREAM: side.round,
        ACTOR: lambda i, meter: direct.round(i, ids(i), meter),
        ALONE: lambda i, meter: child.round(i, ids(i), meter),
    }
    # every round meters every process: what the idle sides cost shows too
    groups = side.cpu_groups() | child.cpu_groups()
    indices = itertools.count()

    def run(way: str, label: str) -> Round:
        settle(groups)
        r = ways[way](next(indices), CpuMeter(groups))
        print(f"  {label:<9} {row_text(r)}", flush=True)
        return r

    warmup = [run(way, "warm-up") for way in ways]
    sets = []
    for i in range(p.repeats):
        order = list(ways) if i % 2 == 0 else list(reversed(ways))
        done = {way: run(way, f"set {i + 1}") for way in order}
        sets.append(done)
        print("            " + "   ".join(f"{k} {v:.3f}" for k, v in set_ratios(done).items()), flush=True)
    return {
        "warmup": [asdict(r) for r in warmup],
        "sets": [{way: asdict(r) for way, r in done.items()} for done in sets],
        "ratios": {k: [set_ratios(done)[k] for done in sets] for k in RATIOS},
        "load_after": os.getloadavg(),
    }


def settle(groups: dict[str, list[int]], window_s: float = 0.2, timeout_s: float = 10.0) -> None:
    """Wait until this benchmark's processes are quiet (under 0.1 CPU over a window): an
    engine's worker threads spin a while after its last step, and both engines' threads
    share core 0 — the next round must not start in the last one's wake."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        meter = CpuMeter(groups)
        time.sleep(window_s)
        if sum(meter.fill(Round("", 0, 1.0, 0, 0, 0, 0.0, 0.0)).cpu_s.values()) < 0.1 * window_s:
            return


RATIOS = {  # name: (numerator, denominator), of tokens/s
    f"{ROLLSTREAM}/{ALONE}": (ROLLSTREAM, ALONE),
    f"{ACTOR}/{ALONE}": (ACTOR, ALONE),
    f"{ROLLSTREAM}/{ACTOR}": (ROLLSTREAM, ACTOR),
}


def set_ratios(done: dict[str, Round]) -> dict[str, float]:
    return {k: done[a].tokens_per_s / done[b].tokens_per_s for k, (a, b) in RATIOS.items()}


def row_text(r: Round) -> str:
    extra = f", generate_s up to {r.generate_s:.2f}" if r.generate_s is not None else ""
    cpu = ", ".join(f"{k.split(' ')[0]} {v:.1f}" for k, v in r.cpu_s.items())
    return (
        f"{r.way:<10} {r.tokens_per_s:7,.0f} tokens/s ({r.tokens:,} tokens, {r.sequences} sequences, "
        f"{r.short} short) in {r.seconds:.2f} s; groups done {r.first_done_s:.2f}-{r.last_done_s:.2f} s"
        f"{extra}; CPU s: {cpu}"
    )


class CpuMeter:
    """CPU seconds (user + system) of process trees since its creation, by group and by
    process name; this process counts alone (the others are its children)."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.start = {name: self._total(pids) for name, pids in groups.items()}

    def _total(self, pids: list[int]) -> dict[int, tuple[str, float]]:
        seconds: dict[int, tuple[str, float]] = {}
        for pid in pids:
            try:
                root = psutil.Process(pid)
                tree = [] if pid == os.getpid() else root.children(recursive=True)
                for proc in [root, *tree]:
                    with contextlib.suppress(psutil.Error):
                        t = proc.cpu_times()
                        seconds[proc.pid] = (proc.name(), t.user + t.system)
            except psutil.Error:
                continue
        return seconds

    def fill(self, r: Round) -> Round:
        """The round with the CPU seconds spent since this meter started."""
        for group, pids in self.groups.items():
            now, before = self._total(pids), self.start[group]
            spent: dict[str, float] = {}
            for pid, (name, total) in now.items():
                spent[name] = spent.get(name, 0.0) + total - before.get(pid, (name, 0.0))[1]
            r.cpu_s[group] = round(sum(spent.values()), 3)
            short = group.split(" ")[0]
            r.cpu_by_process |= {f"{short}: {k}": round(v, 3) for k, v in spent.items() if v >= 0.05}
        return r


# --- weight syncs --------------------------------------------------------------------


async def time_syncs(engine: Engine, paths: list[str], count: int, *, busy: bool) -> dict[str, Any]:
    """EngineHost.sync_weights in partial mode, ``count`` times each way: reloading the
    weights of ``paths`` in turn (idle, and with ``busy`` while requests decode), and
    with no path (a new label only); plus the parts of an idle reload timed one by one."""
    host = EngineHost(engine)
    steps = itertools.count(1)  # the engine starts at model step 0
    result: dict[str, Any] = {}

    async def timed(path: str | None) -> float:
        started = time.perf_counter()
        await host.sync_weights(next(steps), path, "partial")
        return time.perf_counter() - started

    result["reload_idle_s"] = spread([await timed(paths[i % len(paths)]) for i in range(count)])
    result["label_idle_s"] = spread([await timed(None) for _ in range(count)])
    parts: dict[str, list[float]] = {"pause": [], "update_weights": [], "resume": []}
    for i in range(count):
        marks = [time.perf_counter()]
        await engine.pause()
        marks.append(time.perf_counter())
        await engine.update_weights(next(steps), paths[i % len(paths)])
        marks.append(time.perf_counter())
        await engine.resume()
        marks.append(time.perf_counter())
        for name, (x, y) in zip(parts, itertools.pairwise(marks), strict=True):
            parts[name].append(y - x)
    result["reload_parts_s"] = {name: spread(values) for name, values in parts.items()}
    if busy:
        params = SamplingParams(max_tokens=400, temperature=1.0)
        prompt = [4, 5, 6, 7]
        requests = [asyncio.create_task(host.generate(prompt, params, 8, f"busy-{i}")) for i in range(4)]
        await _until_decoding(engine)
        times = []
        for i in range(count):
            if all(r.done() for r in requests):
                break
            times.append(await timed(paths[i % len(paths)]))
        await engine.abort(None)
        await asyncio.gather(*requests, return_exceptions=True)
        result["reload_busy_s"] = spread(times)
    return result


async def _until_decoding(engine: Engine, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await engine.health()).running == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def sim_syncs(p: Params) -> dict[str, Any]:
    from rollstream.producer.engines.sim import SimEngine
    from rollstream.shared.engine_settings import SimEngineSettings

    return await time_syncs(SimEngine(SimEngineSettings()), ["ignored-a", "ignored-b"], p.syncs, busy=False)


async def hf_syncs(p: Params, models: list[Path]) -> dict[str, Any]:
    from rollstream.producer.engines.hf import HFEngine
    from rollstream.shared.engine_settings import HFEngineSettings

    engine = HFEngine(HFEngineSettings(model=str(models[0])))
    return await time_syncs(engine, [str(m) for m in models], p.syncs, busy=False)


def openai_syncs(p: Params, models: list[Path], log: Path) -> dict[str, Any]:
    from rollstream.producer.engines.openai import OpenAIEngine
    from rollstream.shared.engine_settings import HTTPEngineSettings

    started = time.monotonic()
    server, url = start_vllm_server(models[0], log, cpu_bind=p.cpu_bind)
    print(f"  vLLM server up in {time.monotonic() - started:.0f} s", flush=True)
    try:
        engine = OpenAIEngine(HTTPEngineSettings(urls=[url], timeout_s=120))
        return asyncio.run(time_syncs(engine, [str(m) for m in models], p.syncs, busy=True))
    finally:
        server.stop()


# --- the summary ---------------------------------------------------------------------


def summarize(
    p: Params, throughput: dict[str, Any], syncs: dict[str, Any], load: tuple[float, ...]
) -> dict[str, Any]:
    ratios = {k: spread(v) for k, v in throughput["ratios"].items()}
    sets = throughput["sets"]
    return {
        "params": asdict(p),
        "machine_load_before": list(load),
        "machine_load_after": list(throughput["load_after"]),
        "ratio": ratios[f"{ROLLSTREAM}/{ALONE}"]["median"],
        "ratios": ratios,
        "tokens_per_s": {
            way: spread([done[way]["tokens"] / done[way]["seconds"] for done in sets]) for way in sets[0]
        },
        "short_sequences": sum(r["short"] for done in sets for r in done.values()),
        "exit_codes": throughput["exit_codes"],
        "throughput": throughput,
        "syncs": syncs,
        "sync_ms": {kind: _ms(s) for kind, s in syncs.items()},
        "targets": {"ratio": TARGET_RATIO},
    }


def _ms(s: dict[str, Any]) -> dict[str, Any]:
    out = {k: v["median"] * 1000 for k, v in s.items() if k.endswith("_s") and "median" in v}
    out["parts"] = {k: v["median"] * 1000 for k, v in s["reload_parts_s"].items()}
    return out


def print_tables(r: dict[str, Any]) -> None:
    names = {
        ROLLSTREAM: "rollstream: engines + produce + trainer",
        ACTOR: "engine actor alone: EnginePool from one process",
        ALONE: "vLLM alone: AsyncLLM in one process",
    }
    rows: list[list[Any]] = [[names[k], show(v, ",.0f"), ""] for k, v in r["tokens_per_s"].items()]
    for k, v in r["ratios"].items():
        rows.append(
            [
                f"ratio {k}, set by set",
                show(v, ".3f"),
                f">= {TARGET_RATIO}" if k.endswith(ALONE) and k.startswith(ROLLSTREAM) else "",
            ]
        )
    print(table(["", "tokens/s", "target"], rows))
    print()
    rows = []
    for kind, s in r["syncs"].items():
        parts = s["reload_parts_s"]
        rows.append(
            [
                kind,
                show(_scaled(s["reload_idle_s"]), ".1f"),
                show(_scaled(s["reload_busy_s"]), ".1f") if "reload_busy_s" in s else "-",
                show(_scaled(s["label_idle_s"]), ".2f"),
                " / ".join(f"{parts[k]['median'] * 1000:.1f}" for k in ("pause", "update_weights", "resume")),
            ]
        )
    print("EngineHost.sync_weights, partial (ms, median [min..max]):")
    print(table(["engine", "reload idle", "reload busy", "label only", "pause / reload / resume"], rows))


def _scaled(s: dict[str, float]) -> dict[str, float]:
    return {k: (v * 1000 if k != "n" else v) for k, v in s.items()}


def wait(predicate: Callable[[], bool], what: str, processes: list[Spawned], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for process in processes:
            process.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout_s:g} s")
        time.sleep(0.2)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke size: small rounds, one pair, no server")
    parser.add_argument("--prompts", type=int, default=Params.prompts, help="K: prompts (groups) a round")
    parser.add_argument("--n", type=int, default=Params.n, help="samples a prompt")
    parser.add_argument("--max-tokens", type=int, default=Params.max_tokens)
    parser.add_argument("--repeats", type=int, default=Params.repeats, help="measured rounds of each way")
    parser.add_argument("--producers", type=int, default=Params.producers)
    parser.add_argument("--syncs", type=int, default=Params.syncs, help="syncs of each kind per engine")
    parser.add_argument("--no-openai", action="store_true", help="no vLLM server for the openai engine")
    parser.add_argument("--logs", help="keep the models and the processes' logs in this folder")
    parser.add_argument("--alone", help=argparse.SUPPRESS)  # the vLLM-alone child
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.n, args.max_tokens, args.repeats, args.syncs = 4, 4, 32, 1, 3
        args.no_openai = True
    return args


if __name__ == "__main__":  # the guard vLLM needs: its processes re-import this file
    main()
