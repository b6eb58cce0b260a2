"""Redis connections from the settings, with errors that name the URL (never the password)."""

from __future__ import annotations

import redis

from shared.errors import RedisTooOld, RedisUnavailable
from shared.settings import RedisSettings, redact_url

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
        raise RedisUnavailable(shown, f"authentication failed ({exc})") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise RedisUnavailable(shown, str(exc) or type(exc).__name__) from None
    except redis.ResponseError as exc:
        raise RedisUnavailable(shown, f"the server refused: {exc}") from None
    parsed = tuple(int(p) for p in version.split(".")[:2])
    if parsed < MIN_VERSION:
        raise RedisTooOld(
            f"Redis at {shown} is {version}; rollstream needs >= "
            f"{'.'.join(map(str, MIN_VERSION))} (XAUTOCLAIM)"
        )
    return version
