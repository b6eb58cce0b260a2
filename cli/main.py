"""The ``rollstream`` command. It parses arguments and calls the library; nothing more."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import redis

from rollstream.cli.process import stop_on_signals
from rollstream.cli.show import KINDS
from rollstream.shared.errors import (
    InputError,
    RedisTooOld,
    RedisUnavailable,
    RollstreamError,
    RunLost,
    SettingsError,
    WaitTimeout,
)
from rollstream.shared.events import PAUSE, RESUME, STOP
from rollstream.shared.keys import TRAINER_CONSUMER, Keys
from rollstream.shared.logs import setup_logging
from rollstream.shared.settings import ProducerSettings, Settings, load_settings

RET_OK = 0
RET_ERROR = 1  # an operation failed
RET_INPUT = 2  # bad arguments, settings or input files
RET_CONNECT = 3  # Redis unreachable or too old
RET_WAIT = 4  # what the process needs (Redis, engines, a Ray address) did not come in time
RET_PIPE = 141  # the reader of the output went away: what a Unix tool killed by SIGPIPE exits with
RET_LOST = 5  # Redis lost the run's data (emptied, restarted empty): the run is not started again
# the demo's recipes: rollstream.recipes.learning.RECIPES, named here to keep this import light
RECIPE_NAMES = ("sync", "async", "async_tis", "async_decoupled")
# rollstream proxy judges with the agents' reported rewards unless producer.judge is set
DEFAULT_JUDGE = ProducerSettings.model_fields["judge"].default
ENV_RETURN = "rollstream.producer.agents.rewards:env_return"


_LOADED: list[Settings] = []


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    if args.run:
        overrides["run"] = args.run
    if args.redis_url:
        overrides["redis"] = {"url": args.redis_url}
    # Flags win over the environment and the file, field by field (sources merge deeply),
    # and a bad value in the environment that a flag replaces is never looked at.
    settings = load_settings(**overrides)
    _LOADED[:] = [settings]  # for an error's diagnosis in main()
    # before anything imports rq, which reads it once: the judge queue is the run's own
    os.environ["RQ_KEY_PREFIX"] = Keys(settings.run).rq_prefix
    level = logging.getLevelName(settings.log.level) - 10 * (args.verbose - args.quiet)
    setup_logging(min(max(level, logging.DEBUG), logging.CRITICAL), settings.log.format)
    return settings


def cmd_feed(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import feed, run_feeder

    settings = _settings(args)
    stop = stop_on_signals()
    if args.epochs is None and args.keep_ahead is None and not args.shuffle and not args.until_stopped:
        return feed(settings, args.path, args.task, stop, first_uid_wins=args.first_uid_wins, wait=args.wait)
    return run_feeder(
        settings,
        args.path,
        args.task,
        epochs=args.epochs or 1,
        shuffle=args.shuffle,
        seed=args.seed,
        keep_ahead=args.keep_ahead or 1024,
        stop=stop,
        until_stopped=args.until_stopped,
    )


def cmd_status(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import status

    if args.watch:
        from rollstream.cli.watch import watch

        return watch(_settings(args), stop_on_signals(), interval_s=args.interval)
    return status(_settings(args), as_json=args.json)


def cmd_check(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import check

    return check(_settings(args), engines=args.engines)


def cmd_control(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import control

    return control(_settings(args), args.command)


def cmd_steps(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import steps

    return steps(_settings(args), train_step=args.train_step, yes=args.yes, model_step=args.model_step)


def cmd_dead_letter(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import dead_letter

    return dead_letter(_settings(args), args.stream, args.entry_id, args.reason)


def cmd_show(args: argparse.Namespace) -> int:
    from rollstream.cli.show import show

    return show(
        _settings(args),
        args.kind,
        task=args.task,
        count=args.count,
        last=args.last,
        entry_id=args.id,
        as_json=args.json,
    )


def cmd_redis(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import redis_server

    return redis_server(_settings(args), args.config, args.dir)


def cmd_engines(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import engines, engines_scale

    if args.action == "scale" or args.count is not None or args.min is not None or args.max is not None:
        rule = (args.min, args.max) if args.min is not None or args.max is not None else None
        if (
            args.action != "scale"
            or (args.count is None) == (rule is None)
            or (rule is not None and (None in rule or args.min > args.max or args.wait))
            or args.foreground
            or args.stop
        ):
            raise InputError(
                "usage: rollstream engines scale N [--wait] (N: the number of engines, >= 1), or "
                "rollstream engines scale --min A --max B (autoscale, 1 <= A <= B)"
            )
        autoscale = (args.min, args.max) if rule is not None else None
        return engines_scale(
            _settings(args), args.count, wait=args.wait, stop=stop_on_signals(), autoscale=autoscale
        )
    return engines(
        _settings(args),
        address=args.address,
        foreground=args.foreground,
        stop_engines=args.stop,
        stop=stop_on_signals(),
    )


def cmd_produce(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import produce

    return produce(
        _settings(args),
        burst=args.burst,
        local_engines=args.local_engines,
        address=args.address,
        stop=stop_on_signals(),
    )


def cmd_proxy(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import produce

    options: dict[str, Any] = {"host": args.host, "port": args.port}
    if args.public_url:
        options["public_url"] = args.public_url
    if args.episode_timeout is not None:
        options["episode_timeout_s"] = args.episode_timeout
    settings = _settings(args, producer={"agent": "proxy", "agent_options": options})
    if settings.producer.judge == DEFAULT_JUDGE:  # the reward is the agent's, unless a judge is set
        producer = settings.producer.model_copy(update={"judge": ENV_RETURN})
        settings = settings.model_copy(update={"producer": producer})
    return produce(
        settings,
        burst=False,
        local_engines=args.local_engines,
        address=args.address,
        stop=stop_on_signals(),
    )


def cmd_train(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import train

    return train(
        _settings(args),
        steps=args.steps,
        step_time_s=args.step_time,
        consumer=args.consumer,
        stop=stop_on_signals(),
        hf_model=args.hf_model,
        weights_dir=args.weights_dir,
        lr=args.lr,
        stop_run=args.stop_run,
        record=args.record,
        eval_file=args.eval_file,
        eval_every=args.eval_every,
        eval_task=args.eval_task,
        state_file=args.state_file,
        log_to=args.log_to,
        log_dir=args.log_dir,
    )


def cmd_judge(args: argparse.Namespace) -> int:
    from rollstream.cli.commands import judge

    return judge(_settings(args), stop=stop_on_signals(), burst=args.burst)


def cmd_metrics(args: argparse.Namespace) -> int:
    from rollstream.cli.metrics import serve_run_metrics

    return serve_run_metrics(_settings(args), stop_on_signals())


def cmd_archive(args: argparse.Namespace) -> int:
    from rollstream.cli.archive import archive

    return archive(_settings(args), stop_on_signals())


def cmd_export(args: argparse.Namespace) -> int:
    from rollstream.cli.archive import export

    settings = _settings(args)
    return export(
        args.archive or settings.archive.dir, args.out, kind=args.format, run=args.run, task=args.task,
        min_reward=args.min_reward, best_of=args.best_of,
    )  # fmt: skip


def cmd_plot(args: argparse.Namespace) -> int:
    from rollstream.cli.plot import plot

    settings = _settings(args)
    logdir = args.log_dir or f"runs/{settings.run}"
    path = plot(logdir, args.out or f"{logdir}/run.png", stale_threshold=settings.rollout.stale_threshold)
    print(f"{path}: reward, staleness and throughput of {logdir}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rollstream.cli.demo import demo

    return demo(
        prompts=args.prompts, steps=args.steps, step_time_s=args.step_time, as_json=args.json, sim=args.sim,
        recipe=args.recipe, seed=args.seed, plot=args.plot or None, eval_every=args.eval_every,
    )  # fmt: skip


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
    p.add_argument("--hf-model", help="train this Hugging Face model for real (policy gradient, hf extra)")
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


def _load_env_file(path: str) -> None:
    """The variables of a dotenv file (KEY=VALUE lines, # comments, quoted values: the
    Procfile's .env) into this process's environment, replacing those already set, so
    that a command sees the settings the formation's processes see."""
    from dotenv import dotenv_values

    if not os.path.isfile(path):
        raise InputError(f"--env-file {path}: no such file")
    try:
        values = dotenv_values(path, encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--env-file {path}: cannot be read ({exc})") from None
    os.environ.update({name: value for name, value in values.items() if value is not None})


def _reader_gone() -> int:
    """The reader of the output went away (`rollstream show ... | head -1`): stop quietly, as
    a Unix tool killed by SIGPIPE does (exit status 128 + 13), with no traceback now nor
    from the flush of stdout at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (an embedding, a test's capture)
        pass
    return RET_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        if args.env_file:
            _load_env_file(args.env_file)
        code = func(args)
        sys.stdout.flush()  # now, where a reader gone is caught below, not at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (SettingsError, InputError) as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return RET_INPUT
    except (RedisUnavailable, RedisTooOld) as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return RET_CONNECT
    except WaitTimeout as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return RET_WAIT
    except RunLost as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return RET_LOST
    except redis.ResponseError as exc:
        # e.g. WRONGTYPE: a key of the run that something else wrote with another type
        print(f"rollstream: Redis refused a command: {exc}{_wrong_types(exc)}", file=sys.stderr)
        return RET_ERROR
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # an outage longer than redis.outage_limit_s (the client retried until then)
        print(f"rollstream: Redis gone for longer than redis.outage_limit_s: {exc}", file=sys.stderr)
        return RET_CONNECT
    except RollstreamError as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return RET_ERROR


def _wrong_types(exc: redis.ResponseError) -> str:
    """For a WRONGTYPE reply, which keys of the run hold another type than rollstream keeps
    there (the reply does not name the key); '' when that cannot be told."""
    if "WRONGTYPE" not in str(exc) or not _LOADED:
        return ""
    from rollstream.shared.connection import connect
    from rollstream.shared.status import wrong_types

    try:
        client = connect(_LOADED[0].redis, check=False, ride_out=False)
        try:
            found = wrong_types(client, Keys(_LOADED[0].run))
        finally:
            client.close()
    except redis.RedisError:
        return ""
    if not found:
        return ""
    return f" ({'; '.join(found)})"


def entry() -> None:
    """The console script: main(), then an exit that a late SIGTERM cannot spoil."""
    code = main()
    # Python resets its signal handlers to the defaults while it shuts down, so a SIGTERM
    # then (a process manager stopping everything) would turn a clean exit into death by
    # signal; handlers set to "ignore" are left alone.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    entry()
