"""The `rollstream` command's arguments: every subcommand, its flags and their help; each
subcommand names its function in cli.dispatch."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rollstream.cli.dispatch import (
    cmd_archive,
    cmd_check,
    cmd_control,
    cmd_dead_letter,
    cmd_demo,
    cmd_engines,
    cmd_export,
    cmd_feed,
    cmd_judge,
    cmd_metrics,
    cmd_plot,
    cmd_produce,
    cmd_proxy,
    cmd_redis,
    cmd_show,
    cmd_status,
    cmd_steps,
    cmd_train,
)
from rollstream.cli.show import KINDS
from rollstream.shared.events import PAUSE, RESUME, STOP
from rollstream.shared.keys import TRAINER_CONSUMER

# the demo's recipes: rollstream.recipes.learning.RECIPES, named here to keep this import light
RECIPE_NAMES = ("sync", "async", "async_tis", "async_decoupled")


def _at_least(minimum: float, kind: type = int) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` that is >= ``minimum``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollstream", description="Rollout pipeline for LLM RL on Redis Streams."
    )
    parser.add_argument("--run", help="run name (setting run, ROLLSTREAM_RUN)")
    parser.add_argument("--redis-url", help="Redis URL (setting redis.url, ROLLSTREAM_REDIS__URL)")
    parser.add_argument(
        "--env-file",
        metavar="PATH",
        help="read variables from a dotenv file first, as honcho does for the Procfile's processes "
        "(`rollstream --env-file .env status` after `make run`); its values replace the environment's",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log lines (-vv: debug)")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="fewer log lines")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("feed", help="add prompts from a JSONL file to a task's stream")
    p.add_argument("path", help="JSONL file: one {prompt | messages, uid?, meta?} per line")
    p.add_argument("--task", required=True, help="task the prompts belong to")
    p.add_argument(
        "--first-uid-wins",
        action="store_true",
        help="a uid twice in the file: keep the first, count the rest",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="one-shot: wait for Redis up to process.wait_timeout_s (default: fail at once when it does "
        "not answer; feeder mode always waits)",
    )
    p.add_argument("--epochs", type=_at_least(1), help="feeder mode: iterate the file this many times")
    p.add_argument("--shuffle", action="store_true", help="feeder mode: shuffle each epoch")
    p.add_argument("--seed", type=int, default=0, help="feeder mode: shuffle seed")
    p.add_argument(
        "--keep-ahead", type=_at_least(1), help="feeder mode: unclaimed prompts to keep in the stream"
    )
    p.add_argument(
        "--until-stopped",
        action="store_true",
        help="feeder mode: once every epoch is fed, stay until SIGTERM or `rollstream stop` "
        "(for process managers, which end a formation when one process exits)",
    )
    p.set_defaults(func=cmd_feed)

    p = sub.add_parser("status", help="streams, pending entries, consumers and steps of the run")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print one JSON object")
    shown.add_argument(
        "--watch", action="store_true", help="refresh in place until Ctrl-C (plain lines when not a terminal)"
    )
    p.add_argument("--interval", type=_at_least(0.1, float), default=2.0, help="seconds between refreshes")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("check", help="exit 0 when Redis answers, non-zero otherwise")
    p.add_argument("--engines", action="store_true", help="also probe every engine of the run")
    p.set_defaults(func=cmd_check)

    for action, what in (
        (PAUSE, "producers stop claiming and park in-flight work; engines idle"),
        (RESUME, "producers claim again"),
        (STOP, "every process of the run, on any machine, stops cleanly"),
    ):
        p = sub.add_parser(action, help=f"{action} the run: {what}")
        p.set_defaults(func=cmd_control)

    p = sub.add_parser("steps", help="show the run's step counters (exit 1 when they leave it stuck)")
    p.add_argument("--train-step", type=_at_least(0), help="set the last committed train step (a repair)")
    p.add_argument(
        "--model-step",
        type=_at_least(0),
        help="publish a weight sync to this step even below the run's (a rollback, or a repair)",
    )
    p.add_argument("--yes", action="store_true", help="confirm --train-step or --model-step")
    p.set_defaults(func=cmd_steps)

    p = sub.add_parser(
        "dead-letter", help="move one entry to the run's dead letters, with a reason (an operator's repair)"
    )
    p.add_argument(
        "stream", help="KIND:TASK (groups:math, prompts:math, ...), a stream key, or a task (its groups)"
    )
    p.add_argument("entry_id", help="the entry's id, e.g. 1712345678901-0")
    p.add_argument("--reason", required=True, help="why: stored in the dead letter's reason field")
    p.set_defaults(func=cmd_dead_letter)

    p = sub.add_parser("show", help="decoded entries of one stream of the run (token arrays as counts)")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--task", help="task of a per-task stream (default: the first task of the settings)")
    p.add_argument("--count", type=_at_least(1), default=10, help="entries to show (default 10)")
    p.add_argument("--last", action="store_true", help="the newest entries, newest first")
    p.add_argument("--id", help="only the entry with this id")
    p.add_argument("--json", action="store_true", help="one JSON object per entry")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("redis", help="run redis-server in the foreground for a run on this machine")
    p.add_argument("--config", default="deploy/redis.conf", help="redis.conf to start from")
    p.add_argument("--dir", default="var/redis", help="where the append-only file is kept")
    p.set_defaults(func=cmd_redis)

    p = sub.add_parser("engines", help="start the run's engine actors on Ray (named, detached)")
    p.add_argument("--address", help="Ray cluster address (default: setting ray.address)")
    p.add_argument(
        "--foreground",
        action="store_true",
        help="keep the engines while this process runs (starts a local Ray without an address)",
    )
    p.add_argument("--stop", action="store_true", help="remove the run's engine actors")
    p.add_argument(
        "action",
        nargs="?",
        choices=["scale"],
        help="scale N: grow or shrink the run's engines to N while it runs (drained, then removed)",
    )
    p.add_argument("count", nargs="?", type=_at_least(1), help="scale: the number of engines")
    p.add_argument("--wait", action="store_true", help="scale: wait until the engines process serves N")
    p.add_argument("--min", type=_at_least(1), help="scale: autoscale, at least this many engines")
    p.add_argument("--max", type=_at_least(1), help="scale: autoscale, at most this many engines")
    p.set_defaults(func=cmd_engines)

    p = sub.add_parser("produce", help="claim prompts, generate groups on the engines, judge, append")
    p.add_argument("--burst", action="store_true", help="exit when there is no work left")
    p.add_argument("--local-engines", action="store_true", help="engines in this process, no Ray")
    p.add_argument(
        "--address", help="Ray cluster address (default: setting ray.address, else the run's recorded one)"
    )
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser(
        "proxy", help="a producer whose trajectories an outside agent plays through an OpenAI-compatible API"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=_at_least(0), default=8642, help="port to serve on (0: any free one)")
    p.add_argument("--public-url", help="the URL agents reach this proxy at, when not http://HOST:PORT")
    p.add_argument(
        "--episode-timeout", type=_at_least(1, float), help="seconds a group's episodes get (default 600)"
    )
    p.add_argument("--local-engines", action="store_true", help="engines in this process, no Ray")
    p.add_argument(
        "--address", help="Ray cluster address (default: setting ray.address, else the run's recorded one)"
    )
    p.set_defaults(func=cmd_proxy)

    p = sub.add_parser("judge", help="an rq worker that judges groups (with producer.judge_on_queue)")
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.set_defaults(func=cmd_judge)

    p = sub.add_parser(
        "metrics", help="serve the run's Redis-side figures (depth, lag, pending, steps) to Prometheus"
    )
    p.set_defaults(func=cmd_metrics)

    p = sub.add_parser(
        "archive",
        help="write what the run trains (and what it does not, with why) to Parquet (archive.keep > 0)",
    )
    p.set_defaults(func=cmd_archive)

    p = sub.add_parser("export", help="SFT or preference JSONL from a rollout archive's trained groups")
    p.add_argument("--format", required=True, choices=["sft", "preference"], help="what to write")
    p.add_argument("--out", required=True, metavar="PATH", help="the JSONL file to write")
    p.add_argument("--archive", metavar="DIR", help="the archive's folder (setting archive.dir)")
    p.add_argument("--task", help="only this task's groups")
    p.add_argument("--min-reward", type=float, help="only samples with at least this reward")
    p.add_argument(
        "--best-of", type=_at_least(1), default=1, help="sft: the best N samples of each group (default 1)"
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("train", help="the reference trainer: read batches, train, publish weights")
    p.add_argument("--steps", type=_at_least(1), required=True, help="train steps to run")
    p.add_argument(
        "--log-to",
        default="",
        help="per-step learning figures to: tensorboard, wandb, or both (the extras of those names)",
    )
    p.add_argument("--log-dir", help="where the trackers write (default runs/RUN)")
    p.add_argument("--step-time", type=_at_least(0, float), default=0.5, help="seconds a train step takes")
    p.add_argument(
        "--consumer", default=TRAINER_CONSUMER, help="stable consumer name (restarts re-read its groups)"
    )
    p.add_argument(
        "--hf-model",
        help="train this Hugging Face model for real (policy gradient, hf extra): a directory, or a "
        "known model by name (smollm2-135m)",
    )
    p.add_argument("--weights-dir", default="weights", help="where each synced step's weights are saved")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate of the real update")
    p.add_argument(
        "--stop-run", action="store_true", help="when the steps are done, stop every process of the run"
    )
    p.add_argument("--record", help="append each step's groups (before its commit) and commits to this file")
    p.add_argument(
        "--eval-file", help="held-out prompts, evaluated sampled and greedy through the coordinator"
    )
    p.add_argument("--eval-every", type=_at_least(1), default=10, help="train steps between evals")
    p.add_argument("--eval-task", help="the task of the eval prompts (default: the first task)")
    p.add_argument(
        "--state-file",
        help="the trainer's own record of the run (its id, last committed step), checked at start: "
        "a Redis that lost the run stops the trainer (exit 5) instead of training from step 1 again",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plot", help="a run's reward, staleness and throughput as a PNG (from train --log-to)")
    p.add_argument("--log-dir", help="the trainer's --log-dir (default runs/RUN)")
    p.add_argument("--out", help="the PNG to write (default LOG_DIR/run.png)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("demo", help="a model learns through rollstream, in one process on an embedded Redis")
    p.add_argument(
        "--sim", action="store_true", help="simulated engines and a sleeping trainer: a quick look"
    )
    p.add_argument("--steps", type=_at_least(1), help="train steps (learning: at most; default 700, --sim 8)")
    p.add_argument("--recipe", choices=RECIPE_NAMES, default="async_decoupled", help="how to train")
    p.add_argument(
        "--seed", type=_at_least(0), default=0, help="the model's, the prompts' and the sampling's"
    )
    p.add_argument("--eval-every", type=_at_least(0), default=25, help="train steps between evals (0: none)")
    p.add_argument("--plot", default="rollstream-demo.png", help="the PNG of the curves ('': none)")
    p.add_argument("--prompts", type=_at_least(1), default=512, help="--sim: prompts to feed")
    p.add_argument(
        "--step-time", type=_at_least(0, float), default=0.3, help="--sim: seconds a train step takes"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=cmd_demo)
    return parser
