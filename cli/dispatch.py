"""What each `rollstream` command does with its arguments: the settings they make (flags
over the environment and the file), then the library call (cli.feed, cli.ops, cli.engines,
cli.produce, cli.train, ...), imported when the command runs so that `--help` stays quick."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from rollstream.cli.logs import setup_logging
from rollstream.cli.process import stop_on_signals
from rollstream.shared.errors import InputError
from rollstream.shared.keys import Keys
from rollstream.shared.settings import ProducerSettings, Settings, load_settings

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
    from rollstream.cli.feed import feed, run_feeder

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
    from rollstream.cli.ops import status

    if args.watch:
        from rollstream.cli.watch import watch

        return watch(_settings(args), stop_on_signals(), interval_s=args.interval)
    return status(_settings(args), as_json=args.json)


def cmd_check(args: argparse.Namespace) -> int:
    from rollstream.cli.ops import check

    return check(_settings(args), engines=args.engines)


def cmd_control(args: argparse.Namespace) -> int:
    from rollstream.cli.ops import control

    return control(_settings(args), args.command)


def cmd_steps(args: argparse.Namespace) -> int:
    from rollstream.cli.ops import steps

    return steps(_settings(args), train_step=args.train_step, yes=args.yes, model_step=args.model_step)


def cmd_dead_letter(args: argparse.Namespace) -> int:
    from rollstream.cli.ops import dead_letter

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
    from rollstream.cli.ops import redis_server

    return redis_server(_settings(args), args.config, args.dir)


def cmd_engines(args: argparse.Namespace) -> int:
    from rollstream.cli.engines import engines, engines_scale

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
    from rollstream.cli.produce import produce

    return produce(
        _settings(args),
        burst=args.burst,
        local_engines=args.local_engines,
        address=args.address,
        stop=stop_on_signals(),
    )


def cmd_proxy(args: argparse.Namespace) -> int:
    from rollstream.cli.produce import produce

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
    from rollstream.cli.train import train

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
    from rollstream.cli.produce import judge

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
