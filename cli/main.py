"""The ``rollstream`` command. It parses arguments (cli.parser), calls the command's function
(cli.dispatch, which calls the library) and turns errors into exit statuses; nothing more."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence

import redis

from rollstream.cli.dispatch import _LOADED
from rollstream.cli.parser import build_parser
from rollstream.shared.errors import (
    InputError,
    RedisTooOld,
    RedisUnavailable,
    RollstreamError,
    RunLost,
    SettingsError,
    WaitTimeout,
)
from rollstream.shared.keys import Keys

RET_OK = 0
RET_ERROR = 1  # an operation failed
RET_INPUT = 2  # bad arguments, settings or input files
RET_CONNECT = 3  # Redis unreachable or too old
RET_WAIT = 4  # what the process needs (Redis, engines, a Ray address) did not come in time
RET_PIPE = 141  # the reader of the output went away: what a Unix tool killed by SIGPIPE exits with
RET_LOST = 5  # Redis lost the run's data (emptied, restarted empty): the run is not started again


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
        print(
            f"rollstream: Redis refused a command: {exc}{_wrong_types(exc)}{_acl_user(exc)}", file=sys.stderr
        )
        return RET_ERROR
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # an outage longer than redis.outage_limit_s (the client retried until then)
        print(f"rollstream: Redis gone for longer than redis.outage_limit_s: {exc}", file=sys.stderr)
        return RET_CONNECT
    except RollstreamError as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return RET_ERROR


def _acl_user(exc: redis.ResponseError) -> str:
    """For a NOPERM reply (or a script's refused key), which ACL user was refused: the
    fix is that user's rules or the process's URL, not the data."""
    text = str(exc)
    if not (isinstance(exc, redis.exceptions.NoPermissionError) or "can't access" in text):
        return ""
    user = ""
    if _LOADED:
        from urllib.parse import unquote, urlsplit

        from rollstream.shared import redisurl

        url = _LOADED[0].redis.url
        try:
            multi = redisurl.is_multi_host(url)
            user = (redisurl.parse(url).username if multi else unquote(urlsplit(url).username or "")) or ""
        except ValueError:
            user = ""
    who = f"Redis user {user!r}" if user else "the Redis user of redis.url (default: 'default')"
    return (
        f" ({who} may not do this: its ACL rules do not allow it. Give each process the user of its "
        "role, deploy/redis/acl.sh, or widen that role's rules there)"
    )


def _wrong_types(exc: redis.ResponseError) -> str:
    """For a WRONGTYPE reply, which keys of the run hold another type than rollstream keeps
    there (the reply does not name the key); '' when that cannot be told."""
    if "WRONGTYPE" not in str(exc) or not _LOADED:
        return ""
    from rollstream.cli.status import wrong_types
    from rollstream.shared.connection import connect

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
