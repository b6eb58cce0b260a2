"""The ``rollstream`` command. It parses arguments and calls the library; nothing more."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from shared.errors import InputError, RedisTooOld, RedisUnavailable, RollstreamError, SettingsError
from shared.settings import Settings, load_settings

RET_OK = 0
RET_ERROR = 1  # an operation failed
RET_INPUT = 2  # bad arguments, settings or input files
RET_CONNECT = 3  # Redis unreachable or too old


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    if args.run:
        overrides["run"] = args.run
    if args.redis_url:
        overrides["redis"] = {"url": args.redis_url}
    settings = load_settings()
    if not overrides:
        return settings
    # Flags win over the environment and the file, field by field.
    merged = settings.model_dump()
    for key, value in overrides.items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
    return load_settings(**merged)


def cmd_feed(args: argparse.Namespace) -> int:
    from cli.commands import feed, run_feeder

    settings = _settings(args)
    if args.epochs is None and args.keep_ahead is None and not args.shuffle:
        return feed(settings, args.path, args.task)
    return run_feeder(
        settings,
        args.path,
        args.task,
        epochs=args.epochs or 1,
        shuffle=args.shuffle,
        seed=args.seed,
        keep_ahead=args.keep_ahead or 1024,
        stop=_stop_on_sigterm(),
    )


def cmd_status(args: argparse.Namespace) -> int:
    from cli.commands import status

    return status(_settings(args), as_json=args.json)


def cmd_check(args: argparse.Namespace) -> int:
    from cli.commands import check

    return check(_settings(args))


def cmd_engines(args: argparse.Namespace) -> int:
    from cli.commands import engines

    return engines(
        _settings(args),
        address=args.address,
        foreground=args.foreground,
        stop_engines=args.stop,
        stop=_stop_on_sigterm(),
    )


def cmd_produce(args: argparse.Namespace) -> int:
    from cli.commands import produce

    return produce(_settings(args), burst=args.burst, local_engines=args.local_engines, address=args.address)


def cmd_train(args: argparse.Namespace) -> int:
    from cli.commands import train

    return train(
        _settings(args),
        steps=args.steps,
        step_time_s=args.step_time,
        consumer=args.consumer,
        hf_model=args.hf_model,
        weights_dir=args.weights_dir,
        lr=args.lr,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from cli.demo import demo

    return demo(prompts=args.prompts, steps=args.steps, step_time_s=args.step_time, as_json=args.json)


def _stop_on_sigterm() -> threading.Event:
    """SIGTERM and SIGINT set the event: a worker finishes its current step and exits."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollstream", description="Rollout pipeline for LLM RL on Redis Streams."
    )
    parser.add_argument("--run", help="run name (setting run, ROLLSTREAM_RUN)")
    parser.add_argument("--redis-url", help="Redis URL (setting redis.url, ROLLSTREAM_REDIS__URL)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("feed", help="add prompts from a JSONL file to a task's stream")
    p.add_argument("path", help="JSONL file: one {prompt | messages, uid?, meta?} per line")
    p.add_argument("--task", required=True, help="task the prompts belong to")
    p.add_argument("--epochs", type=int, help="feeder mode: iterate the file this many times")
    p.add_argument("--shuffle", action="store_true", help="feeder mode: shuffle each epoch")
    p.add_argument("--seed", type=int, default=0, help="feeder mode: shuffle seed")
    p.add_argument("--keep-ahead", type=int, help="feeder mode: unclaimed prompts to keep in the stream")
    p.set_defaults(func=cmd_feed)

    p = sub.add_parser("status", help="streams, pending entries, consumers and steps of the run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("check", help="exit 0 when Redis answers, non-zero otherwise")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("engines", help="start the run's engine actors on Ray (named, detached)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
    p.add_argument("--foreground", action="store_true", help="keep the engines tied to this process")
    p.add_argument("--stop", action="store_true", help="remove the run's engine actors")
    p.set_defaults(func=cmd_engines)

    p = sub.add_parser("produce", help="claim prompts, generate groups on the engines, judge, append")
    p.add_argument("--burst", action="store_true", help="exit when there is no work left")
    p.add_argument("--local-engines", action="store_true", help="engines in this process, no Ray")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("train", help="the reference trainer: read batches, train, publish weights")
    p.add_argument("--steps", type=int, required=True, help="train steps to run")
    p.add_argument("--step-time", type=float, default=0.5, help="seconds a train step takes")
    p.add_argument("--consumer", default="trainer", help="stable consumer name (restarts re-read its groups)")
    p.add_argument("--hf-model", help="train this Hugging Face model for real (policy gradient, hf extra)")
    p.add_argument("--weights-dir", default="weights", help="where each synced step's weights are saved")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate of the real update")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("demo", help="a first try in one process on an embedded Redis")
    p.add_argument("--prompts", type=int, default=512, help="prompts to feed")
    p.add_argument("--steps", type=int, default=8, help="train steps")
    p.add_argument("--step-time", type=float, default=0.3, help="seconds a train step takes")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (SettingsError, InputError) as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return RET_INPUT
    except (RedisUnavailable, RedisTooOld) as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return RET_CONNECT
    except RollstreamError as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return RET_ERROR


if __name__ == "__main__":
    sys.exit(main())
