"""Redis connections from the settings, with errors that name the URL (never the password)."""

from __future__ import annotations

import threading

import redis

from shared.errors import RedisTooOld, RedisUnavailable
from shared.settings import RedisSettings, redact_url
from shared.waiting import NotYet, wait_until

MIN_VERSION = (6, 2)  # XAUTOCLAIM and XPENDING ... IDLE


def connect(settings: RedisSettings, *, check: bool = True) -> redis.Redis:
    """A client for the configured Redis; with ``check``, ping it and check its version.

    Replies stay bytes: stream payloads are binary, and decoding every field
    as text would cost more than the rest of a read.
    """
    client = redis.Redis.from_url(
        settings.url,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=min(settings.socket_timeout_s, 10.0),
        health_check_interval=30,
    )
    if check:
        check_server(client, settings.url)
    return client


def check_server(client: redis.Redis, url: str) -> str:
    """Ping Redis and return its version, or raise RedisUnavailable / RedisTooOld."""
    shown = redact_url(url)
    try:
        client.ping()
        version = str(client.info("server")["redis_version"])
    except redis.AuthenticationError as exc:
        raise RedisUnavailable(shown, f"authentication failed ({exc})", retryable=False) from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise RedisUnavailable(shown, str(exc) or type(exc).__name__) from None
    except redis.ResponseError as exc:
        if str(exc).startswith("LOADING"):  # a restarted server still reading its AOF
            raise RedisUnavailable(shown, "loading its data set") from None
        raise RedisUnavailable(shown, f"the server refused: {exc}", retryable=False) from None
    parsed = tuple(int(p) for p in version.split(".")[:2])
    if parsed < MIN_VERSION:
        raise RedisTooOld(
            f"Redis at {shown} is {version}; rollstream needs >= "
            f"{'.'.join(map(str, MIN_VERSION))} (XAUTOCLAIM)"
        )
    return version


def wait_for_redis(
    settings: RedisSettings, timeout_s: float, stop: threading.Event | None = None
) -> redis.Redis | None:
    """A checked client once Redis answers, waiting with back-off and a warning every
    few seconds (a process may start before Redis does); None when ``stop`` is set
    first. A wrong password or a server that is too old fails at once."""
    client = connect(settings, check=False)

    def probe() -> redis.Redis:
        try:
            check_server(client, settings.url)
        except RedisUnavailable as exc:
            if not exc.retryable:
                raise
            raise NotYet(exc.reason) from None
        return client

    return wait_until(probe, f"Redis at {redact_url(settings.url)}", timeout_s, stop)
