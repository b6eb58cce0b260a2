"""A model learns through rollstream: the reverse task (rollstream.recipes.reverse) trained
through the whole pipeline, as the demo, the learning benchmark and its test run it.

    hf engines in Ray actors -> producers -> Redis streams -> ReferenceTrainer with
    PolicyGradient (consumer.advantages, .losses) -> weights saved and published ->
    the engines load them (in place, mid-generation, with on_weight_sync "partial")

A ``Recipe`` is a way of training: sync (on-policy: producers generate exactly the
batch of the next step, on the weights of the last) or async (producers run ahead up
to ``max_staleness`` weight syncs, and the trainer corrects for the staleness or not).
Everything else is the issue's reference: GRPO, 8 prompts x 8 samples a step, the
advantage (r - mean) / (std + 1e-4), Adam at 1e-3, one update a batch.

``run_learning`` does one run on a Redis the caller names (an embedded one in the
demo and the tests) and the Ray cluster of this process (a local one is started if
there is none, leaving the process's SIGTERM and SIGINT handlers as they were:
producer/ray_signals.py), reporting each step as it goes; steps are numbered from 1
and each carries the wall seconds since the trainer started, so that recipes compare
by steps and by seconds to a reward. The caller's ``stop`` event ends it early, as the
trainer's warm stop (``cold``: its cold stop).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollstream.consumer.assembly import create_coordinator, create_trainer
from rollstream.consumer.evaluation import EvalSet, Evaluator
from rollstream.consumer.losses import AlgorithmConfig
from rollstream.consumer.trainer import ReferenceTrainer, StepLog
from rollstream.recipes import reverse
from rollstream.recipes.tasks import REVERSE, LearningTask
from rollstream.shared.connection import connect
from rollstream.shared.records import Prompt
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings

log = logging.getLogger(__name__)

PROMPTS_PER_STEP = 8
TARGET = 0.9  # the mean reward the recipes are compared at
WINDOW = 10  # steps of the trailing mean that must reach it
ACCURACY_TARGET = 0.9  # the held-out greedy accuracy the demo stops at
CLOSE_EVAL_EVERY = 5  # eval cadence once the training reward has reached TARGET


@dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    mode: Literal["sync", "async"]
    max_staleness: int
    algorithm: AlgorithmConfig
    on_weight_sync: Literal["drain", "abort", "partial"] = "partial"

    def describe(self) -> str:
        a = self.algorithm
        correction: str = a.loss if a.loss != "pg" else "no correction"
        if a.importance != "none":
            correction = f"{a.importance} (cap {a.tis_cap:g})" if a.importance == "tis" else a.importance
        if self.mode == "sync":
            return "sync (on-policy)"
        return f"async, max_staleness {self.max_staleness}, {self.on_weight_sync} sync, {correction}"


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("sync", "sync", 0, reverse.ALGORITHM),
        Recipe("async", "async", 2, reverse.ALGORITHM),
        Recipe("async_tis", "async", 2, AlgorithmConfig(adv_eps=1e-4, importance="tis", tis_cap=2.0)),
        Recipe(
            "async_decoupled",
            "async",
            2,
            AlgorithmConfig(adv_eps=1e-4, loss="decoupled_ppo", behav_imp_weight_cap=5.0),
        ),
    )
}


@dataclass(slots=True)
class StepRecord:
    step: int
    reward: float  # mean reward of the step's batch
    seconds: float  # wall seconds from the trainer's start to the end of this step
    staleness: dict[int, int]  # groups of the batch by staleness
    wait_s: float = 0.0  # the trainer's wait for the batch
    eval: dict[str, float] = field(default_factory=dict)  # at eval steps

    @property
    def mean_staleness(self) -> float:
        groups = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / groups if groups else 0.0

    @property
    def eval_accuracy(self) -> float | None:
        """Greedy accuracy on the held-out prompts (the greedy set's mean exact score)."""
        return _metric(self.eval, "eval/greedy/score/mean@")

    @property
    def eval_reward(self) -> float | None:
        """mean@k of the reward on the held-out prompts, sampled as in training."""
        return _metric(self.eval, "eval/heldout/score/mean@")


def _metric(metrics: dict[str, float], prefix: str) -> float | None:
    return next((v for k, v in metrics.items() if k.startswith(prefix)), None)


@dataclass(slots=True)
class LearnResult:
    recipe: str
    seed: int
    settings: Settings
    steps: list[StepRecord] = field(default_factory=list)
    setup_s: float = 0.0  # model, prompts, engines up: before the trainer starts
    prompts_fed: int = 0  # training prompts fed (eval prompts are the coordinator's)
    engine_busy: float | None = None  # the engines' mean share of wall time in forward passes

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.steps]

    def steps_to(self, target: float = TARGET, window: int = WINDOW) -> int | None:
        return reverse.steps_to(self.rewards, target, window)

    def seconds_to(self, target: float = TARGET, window: int = WINDOW) -> float | None:
        step = self.steps_to(target, window)
        return None if step is None else self.steps[step - 1].seconds

    @property
    def evals(self) -> list[StepRecord]:
        return [s for s in self.steps if s.eval]

    def summary(self) -> dict[str, Any]:
        last = self.evals[-1] if self.evals else None
        return {
            "recipe": self.recipe,
            "seed": self.seed,
            "steps": len(self.steps),
            "steps_to_target": self.steps_to(),
            "seconds_to_target": self.seconds_to(),
            "seconds": self.steps[-1].seconds if self.steps else 0.0,
            "setup_s": self.setup_s,
            "reward_by_step": [round(r, 4) for r in self.rewards],
            "eval_accuracy": None if last is None else last.eval_accuracy,
            "eval_reward": None if last is None else last.eval_reward,
        }


def learning_settings(
    recipe: Recipe,
    redis_url: str,
    run: str,
    model_dir: Path | str,
    *,
    engines: int = 2,
    n: int = 8,
    task: LearningTask = REVERSE,
) -> Settings:
    """The run's settings: ``task`` (the reverse task unless named) on hf engines, the
    recipe's rollout and algorithm (the task's micro-batch size with it)."""
    return load_settings(
        run=run,
        redis={"url": redis_url},
        tasks=[{"name": task.name, "n": n}],
        engines={
            "kind": "hf",
            "count": engines,
            "num_cpus": 1,
            "max_restarts": 0,
            "hf": {"model": str(model_dir), "device": "cpu", "dtype": "float32"},
        },
        rollout={
            "mode": recipe.mode,
            "batch_size": PROMPTS_PER_STEP,
            "max_staleness": recipe.max_staleness,
            "sync_weights_interval": 1,
            "on_weight_sync": recipe.on_weight_sync,
        },
        producer={
            "judge": task.judge,
            "is_valid": "keep_all",  # as the reference: a group without signal stays in the batch
            "max_tokens": task.max_tokens,
            "temperature": 1.0,
            "max_inflight": task.max_inflight,
            "heartbeat_s": 0.5,
            # fixed (the task's): the dynamic one (4 x the mean group time) takes the burst of
            # an eval batch, queued behind the others on the engines, for stragglers to retry
            "group_timeout_s": task.group_timeout_s,
        },
        algorithm=task.algorithm(recipe.algorithm).model_dump(),
    )


def training_prompts(train: list[Prompt], count: int, seed: int) -> list[Prompt]:
    """``count`` training prompts: epochs of the train split, each shuffled by the seed,
    the uid marked with its epoch (a uid is fed once)."""
    rng = random.Random(seed + 1)
    out: list[Prompt] = []
    epoch = 0
    while len(out) < count:
        order = list(train)
        rng.shuffle(order)
        out += [Prompt(f"{p.uid}.{epoch}", p.task, p.prompt, meta=p.meta) for p in order]
        epoch += 1
    return out[:count]


def eval_sets(held_out: list[Prompt], count: int, sampled: bool = True) -> list[EvalSet]:
    """The held-out prompts decoded greedily ("greedy": scored exact, its mean the
    accuracy) and, where ``sampled``, sampled as in training ("heldout": mean@n of the
    partial reward)."""
    held = EvalSet("heldout", held_out[:count])
    greedy = held.greedy("greedy", scoring="exact")
    return [held, greedy] if sampled else [greedy]


def run_learning(
    recipe: Recipe,
    *,
    redis_url: str,
    work_dir: str | Path,
    seed: int = 0,
    steps: int = 450,
    engines: int = 2,
    producers: int = 1,
    eval_every: int = 0,
    eval_prompts: int | None = None,
    stop_at: float | None = None,
    run: str | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    lr: float | None = None,
    stop_at_accuracy: float | None = None,
    stop: threading.Event | None = None,
    cold: threading.Event | None = None,
    task: LearningTask = REVERSE,
    save_to: str | Path | None = None,
) -> LearnResult:
    """One run of ``recipe`` on ``task`` (the reverse task unless named; its learning rate
    and eval size unless ``lr`` and ``eval_prompts`` are given): up to ``steps`` train
    steps (fewer once the trailing mean reward reaches ``stop_at``, or an eval's greedy
    accuracy on the held-out prompts reaches ``stop_at_accuracy``), an eval every
    ``eval_every`` steps (0: none). ``save_to``: where the trained policy goes at the end, a
    Hugging Face directory anyone can load.

    ``stop`` (a SIGTERM's, say) ends the training after the step in progress, which is
    committed, as the reference trainer's warm stop does, and no eval follows; ``cold``
    (set with or after it) ends it at once, the step in progress not committed. The run
    sets ``stop`` itself when the training ends."""
    import torch

    from rollstream.consumer.pg import PolicyGradient
    from rollstream.producer.fleet.pool import EnginePool
    from rollstream.producer.ray_signals import init_ray_keeping_signals

    started = time.monotonic()
    work = Path(work_dir)
    run = run or f"learn-{recipe.name}-{seed}"
    model_dir = task.model(work / run / "model", seed)
    train, held_out = task.prompts(seed)
    settings = learning_settings(recipe, redis_url, run, model_dir, engines=engines, task=task)
    client = connect(settings.redis)
    # enough for every step, what admission lets producers run ahead, and the evals' none
    ahead = (settings.rollout.stale_threshold + 2) * PROMPTS_PER_STEP
    feed = training_prompts(train, steps * PROMPTS_PER_STEP + ahead, seed)
    fed = open_buffer(client, settings, f"{run}-feeder").feed(feed).added
    torch.manual_seed(seed)
    lr = task.lr if lr is None else lr
    policy = PolicyGradient(model_dir, str(work / run / "weights"), lr=lr, algorithm=settings.algorithm)
    evaluator = None
    if eval_every > 0:
        coordinator = create_coordinator(settings, client=client, consumer=f"{run}-eval")
        count = task.eval_prompts if eval_prompts is None else eval_prompts
        sets = eval_sets(held_out, count, task.sampled_eval)
        evaluator = Evaluator(coordinator, sets, eval_every, timeout_s=task.eval_timeout_s)
    trainer = create_trainer(
        settings, client=client, consumer=f"{run}-trainer", policy=policy, evaluator=evaluator
    )
    result = LearnResult(recipe.name, seed, settings, prompts_fed=fed)
    if stop is not None and stop.is_set():
        return result  # stopped before Ray and the engines came up: nothing to train on
    init_ray_keeping_signals(local=True)
    pool = EnginePool.start(settings.run, settings.engines, detached=False)
    try:
        result.setup_s = time.monotonic() - started
        stop = stop or threading.Event()
        asyncio.run(
            _train(pool, trainer, steps, producers, result, on_step, stop_at, stop_at_accuracy, stop, cold)
        )
    finally:
        EnginePool.stop(settings.run, settings.engines.count)
    if save_to is not None:
        policy.save_pretrained(save_to, model_dir)
    return result


def should_stop(
    result: LearnResult, evaluator: Evaluator | None, stop_at: float | None, stop_at_accuracy: float | None
) -> bool:
    """After each step: whether the run has reached what it stops at. ``stop_at``: the
    trailing mean training reward. ``stop_at_accuracy``: the greedy accuracy of the last
    eval on the held-out prompts, which tells a model that has learned the task from one
    that earns its reward on the training prompts' easy cases; once the training reward
    has reached TARGET the evals come every CLOSE_EVAL_EVERY steps, so the run stops soon
    after the accuracy gets there."""
    if stop_at is not None and result.steps_to(stop_at) is not None:
        return True
    if stop_at_accuracy is None or not result.steps:
        return False
    accuracy = result.steps[-1].eval_accuracy
    if accuracy is not None and accuracy >= stop_at_accuracy:
        return True
    if evaluator is not None and result.steps_to(TARGET) is not None:
        evaluator.every = min(evaluator.every, CLOSE_EVAL_EVERY)
    return False


def steps_to_accuracy(result: LearnResult, target: float = ACCURACY_TARGET) -> int | None:
    """The first step whose eval's greedy accuracy on the held-out prompts reached ``target``."""
    return next((s.step for s in result.evals if (s.eval_accuracy or 0.0) >= target), None)


async def _train(
    pool: Any,
    trainer: ReferenceTrainer,
    steps: int,
    producers: int,
    result: LearnResult,
    on_step: Callable[[StepRecord], None] | None,
    stop_at: float | None,
    stop_at_accuracy: float | None,
    stop_training: threading.Event,
    cold: threading.Event | None = None,
) -> None:
    """Producers on this event loop, the trainer in a thread; then, when the last step
    had no eval and the training was not stopped from outside, one on its weights
    (while the producers still serve)."""
    from rollstream.producer.assembly import build_producer

    settings, client = result.settings, trainer.reader.buffer.client
    stop_producers = asyncio.Event()
    workers = [
        build_producer(client, settings, pool=pool, name=f"{settings.run}-producer-{i}")
        for i in range(producers)
    ]
    running = [asyncio.create_task(p.run(stop_producers)) for p in workers]
    ended = threading.Event()  # the run's own reasons to stop: a target reached, a producer gone
    started = time.monotonic()

    def record(entry: StepLog) -> None:
        step = StepRecord(
            entry.step,
            entry.reward_mean if entry.reward_mean is not None else 0.0,
            time.monotonic() - started,
            dict(sorted(entry.staleness.items())),
            entry.wait_s,
            entry.eval,
        )
        result.steps.append(step)
        if on_step is not None:
            on_step(step)
        if should_stop(result, trainer.evaluator, stop_at, stop_at_accuracy):
            ended.set()
            stop_training.set()

    training = asyncio.create_task(asyncio.to_thread(trainer.run, steps, record, stop_training, cold))
    try:
        await asyncio.wait([training, *running], return_when=asyncio.FIRST_COMPLETED)
        if not training.done():  # a producer stopped: the trainer would wait for ever
            ended.set()
            stop_training.set()
        await training
        last = result.steps[-1] if result.steps else None
        stopped = stop_training.is_set() and not ended.is_set()  # by the caller: no eval now
        if trainer.evaluator is not None and last is not None and not last.eval and not stopped:
            last.eval = await asyncio.to_thread(trainer.evaluator, last.step, trainer.reader.control)
        busy = [h.busy_total for h in await pool.health() if h is not None]
        result.engine_busy = sum(busy) / len(busy) if busy else None
    finally:
        stop_training.set()
        stop_producers.set()
        outcomes = await asyncio.gather(*running, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
