"""Redis connections from the settings, with errors that name the URL (never the password).

A client rides out a Redis outage (a restart, a failover, a network blip) in place:
every command that fails to connect or times out is retried with exponential
back-off and jitter for up to ``redis.outage_limit_s``, with one warning when the
outage starts and one line with its length when Redis answers again. Retrying is
safe for what rollstream sends: settles and commits are fenced scripts that change
nothing the second time, WATCHed transactions are never retried blindly (redis-py
raises instead), feeds are idempotent by uid, and a weight-sync event sent twice
is ignored by producers already on its step.

A failover is an outage too. With a ``redis+sentinel://`` URL every connection asks the
Sentinels for the primary when it (re)connects, and a READONLY reply (a primary demoted to
a replica while a connection to it stayed open) closes the connection and is retried on
the new primary; with a plain URL whose name moves to the new primary (a managed Redis),
READONLY is retried the same way. A command refused with READONLY wrote nothing.

A primary cut off from its replicas and Sentinels (a partition) is failed over by the
majority while clients may still reach it; with ``min-replicas-to-write`` (deploy/redis.conf)
it refuses writes with NOREPLICAS once its replicas have been silent for
``min-replicas-max-lag``. That too wrote nothing, and is retried like READONLY: the
connection is dropped, and the reconnect asks the Sentinels, whose newest answer names the
new primary (shared/redis_sentinel.py); without a failover it is the same primary, until
its replicas are back or the outage limit.

With ``redis.wait_replicas`` N > 0, ``wait_for_replicas`` (consumer/replication.py) makes
what a connection wrote durable on N replicas (WAIT) before the caller goes on: the
trainer's read and commit use it (README "Redis high availability").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError

from rollstream.shared import redisurl, telemetry
from rollstream.shared.errors import RedisTooOld, RedisUnavailable, SettingsError
from rollstream.shared.redis_cluster import cluster_client
from rollstream.shared.redis_sentinel import sentinel_client
from rollstream.shared.settings import RedisSettings
from rollstream.shared.settings_errors import ENV_PREFIX, redact_url
from rollstream.shared.waiting import NotYet, wait_until


class NoReplicasError(redis.ResponseError):
    """NOREPLICAS: a primary with ``min-replicas-to-write`` refused a write for want of
    replicas in sync. It wrote nothing (a script is refused at its first write, and
    rollstream's scripts check everything before their first write)."""


def _parse_noreplicas() -> None:
    """redis-py parses NOREPLICAS as a plain ResponseError: give it a class of its own (for
    both its parsers, which share this table), so that the outage retry can take it."""
    from redis._parsers.base import BaseParser

    BaseParser.EXCEPTION_CLASSES.setdefault("NOREPLICAS", NoReplicasError)


_parse_noreplicas()

MIN_VERSION = (6, 2)  # XAUTOCLAIM and XPENDING ... IDLE
# Once a process is stopping, an outage is not ridden out for minutes: the process
# manager may have stopped Redis with everything else.
STOPPING = threading.Event()
STOPPING_LIMIT_S = 0.5
# Redis servers (as shown in the log) that a stopping process found gone: each later call
# to them while it stops fails at once instead of waiting STOPPING_LIMIT_S again, so
# that a stop's few last writes (heartbeat keys, counts) cannot add up past a process
# manager's grace (honcho's 5 s) once Redis itself was stopped first
_GONE_WHILE_STOPPING: set[str] = set()


def stop_over() -> None:
    """This process's stop is over (a test, the demo's next part go on in it): outages
    are ridden out again."""
    _GONE_WHILE_STOPPING.clear()
    STOPPING.clear()


T = TypeVar("T")
log = logging.getLogger(__name__)


class OutageRetry(Retry):
    """redis-py's retry policy, bounded by time instead of a count, and telling the log
    when an outage starts and how long it lasted."""

    def __init__(self, shown_url: str, limit_s: float, base_s: float = 0.05, cap_s: float = 1.0) -> None:
        # the count is only what redis-py reports in its metrics: the limit is limit_s
        super().__init__(ExponentialWithJitterBackoff(base=base_s, cap=cap_s), retries=1_000_000)
        # a primary demoted by a failover answers writes with READONLY: nothing was written
        # one cut off from its replicas (min-replicas-to-write) with NOREPLICAS: nor here
        self.update_supported_errors([redis.ReadOnlyError, NoReplicasError])
        self.shown_url = shown_url
        self.limit_s = limit_s

    def _limit(self) -> float:
        return min(self.limit_s, STOPPING_LIMIT_S) if STOPPING.is_set() else self.limit_s

    def _gone(self) -> bool:
        """Whether this process, stopping, already gave up on this Redis."""
        return STOPPING.is_set() and self.shown_url in _GONE_WHILE_STOPPING

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        self._backoff.reset()  # type: ignore[no-untyped-call]
        failures = 0
        started = 0.0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                if self._gone():
                    raise  # said once already: "gone ... while stopping"
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                now = time.monotonic()
                if failures == 1:
                    started = now
                    log.warning(
                        "Redis at %s does not answer (%s): retrying for up to %g s",
                        self.shown_url, reason(error), self._limit(),
                    )  # fmt: skip
                elif now - started >= self._limit():
                    log.error("Redis at %s gone for %.1f s: giving up", self.shown_url, now - started)
                    telemetry.outage(now - started)
                    if STOPPING.is_set():
                        _GONE_WHILE_STOPPING.add(self.shown_url)
                        log.warning("Redis at %s gone while this process stops: its last writes to it "
                                    "fail at once from now", self.shown_url)  # fmt: skip
                    raise
                time.sleep(self._backoff.compute(failures))
            else:
                if _GONE_WHILE_STOPPING:
                    _GONE_WHILE_STOPPING.discard(self.shown_url)
                if failures:
                    log.info(
                        "Redis at %s answers again after %.1f s", self.shown_url, time.monotonic() - started
                    )
                    telemetry.outage(time.monotonic() - started)
                return result


def connect(settings: RedisSettings, *, check: bool = True, ride_out: bool = True) -> redis.Redis:
    """A client for the configured Redis; with ``check``, ping it (once, without
    retrying) and check its version; with ``ride_out``, one that retries through an
    outage of up to redis.outage_limit_s.

    Replies stay bytes: stream payloads are binary, and decoding every field
    as text would cost more than the rest of a read.
    """
    if check:
        probe = _client(settings, retry=None)
        try:
            check_server(probe, settings.url)
        finally:
            probe.close()
    limit = settings.outage_limit_s if ride_out else 0.0
    return _client(settings, OutageRetry(redact_url(settings.url), limit) if limit > 0 else None)


def _client(settings: RedisSettings, retry: Retry | None) -> redis.Redis:
    options: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": min(settings.socket_timeout_s, 10.0),
        "health_check_interval": 30,
        "retry": retry if retry is not None else Retry(ExponentialWithJitterBackoff(), 0),
    }
    if redisurl.scheme_of(settings.url) in redisurl.SENTINELS:
        return _naming_refusals(sentinel_client(redisurl.parse(settings.url), options))
    if redisurl.scheme_of(settings.url) == redisurl.CLUSTER:
        outage = retry if isinstance(retry, OutageRetry) else None
        return cluster_client(redisurl.parse(settings.url), options, outage)
    return _naming_refusals(redis.Redis.from_url(settings.url, **options))


def _naming_refusals(client: redis.Redis) -> redis.Redis:
    """The client, whose NOPERM errors name the command and key refused: Redis's reply
    (``no permissions to access one of the keys used as arguments``) names neither, and an
    ACL user's refusal is fixed in its role's rules (deploy/redis/acl.sh)."""
    inner = client.execute_command

    def execute_command(*args: Any, **options: Any) -> Any:
        try:
            return inner(*args, **options)  # type: ignore[no-untyped-call]
        except redis.exceptions.NoPermissionError as exc:
            raise redis.exceptions.NoPermissionError(f"{exc} [{refused_call(args)}]") from exc

    client.execute_command = execute_command  # type: ignore[method-assign]
    return client


def refused_call(args: tuple[Any, ...]) -> str:
    """``COMMAND key`` of a refused call: its name and first key, never its values."""

    def text(value: Any) -> str:
        shown = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        return shown if len(shown) <= 120 else shown[:117] + "..."

    if not args:
        return "?"
    command = text(args[0]).upper()
    if command in ("EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO", "FCALL", "FCALL_RO") and len(args) > 3:
        return f"{command} (a script) on {text(args[3])}"
    return f"{command} {text(args[1])}" if len(args) > 1 else command


def refuse_on_cluster(settings: RedisSettings, what: str) -> None:
    """SettingsError when redis.url is a Redis Cluster and ``what`` cannot run there."""
    if redisurl.scheme_of(settings.url) == redisurl.CLUSTER:
        raise SettingsError(
            f"invalid setting redis.url ({ENV_PREFIX}REDIS__URL): {redact_url(settings.url)} is a Redis "
            f"Cluster, where {what} does not run"
        )


def reason(error: BaseException) -> str:
    """One short line for a connection error. redis-py's MasterNotFoundError repeats the
    whole configuration of every Sentinel's client; this names the service instead."""
    if isinstance(error, MasterNotFoundError):
        service = str(error).split("'")[1] if str(error).count("'") >= 2 else "?"
        _, _, detail = str(error).partition(" : ")  # NewestSentinel's: which did not answer, why
        return (
            f"no Sentinel answered with a primary for service {service!r} (are the Sentinels of "
            "redis.url up, do they take its ?sentinel_password=, and is that the name in their "
            "`sentinel monitor` line?)" + (f"; {detail}" if detail else "")
        )
    if isinstance(error, NoReplicasError):
        return (
            "NOREPLICAS: the primary refuses writes with no replica in sync (min-replicas-to-write): "
            "cut off from its replicas, or they are down"
        )
    return str(error) or type(error).__name__


def check_server(client: redis.Redis, url: str) -> str:
    """Ping Redis and return its version, or raise RedisUnavailable / RedisTooOld."""
    shown = redact_url(url)
    try:
        client.ping()
        version = _server_version(client)
    except redis.AuthenticationError as exc:
        raise RedisUnavailable(shown, f"authentication failed ({exc})", retryable=False) from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise RedisUnavailable(shown, reason(exc)) from None
    except redis.ResponseError as exc:
        if str(exc).startswith("LOADING"):  # a restarted server still reading its AOF
            raise RedisUnavailable(shown, "loading its data set") from None
        if "DB index is out of range" in str(exc):  # the SELECT of the URL's /N
            raise SettingsError(
                f"invalid setting redis.url ({ENV_PREFIX}REDIS__URL): {shown} names database "
                f"{client.connection_pool.connection_kwargs.get('db')}, which the server does not have "
                "(its `databases` setting, 16 by default, numbers them from 0)"
            ) from None
        raise RedisUnavailable(shown, f"the server refused: {exc}", retryable=False) from None
    parsed = tuple(int(p) for p in version.split(".")[:2])
    if parsed < MIN_VERSION:
        raise RedisTooOld(
            f"Redis at {shown} is {version}; rollstream needs >= "
            f"{'.'.join(map(str, MIN_VERSION))} (XAUTOCLAIM)"
        )
    risk = eviction_risk(client)
    if risk is not None and shown not in _EVICTION_WARNED:
        _EVICTION_WARNED.add(shown)  # once per process and server, not per client
        log.warning("Redis at %s: %s", shown, risk)
    return version


_EVICTION_WARNED: set[str] = set()


def eviction_risk(client: redis.Redis) -> str | None:
    """What the server's maxmemory-policy risks for a run, or None: noeviction (a full
    Redis refuses writes, rollstream says so and loses nothing), or INFO refused (a
    least-privilege ACL user)."""
    try:
        memory: dict[str, Any] = client.info("memory")
    except redis.ResponseError:
        return None
    if "maxmemory_policy" in memory:
        policies = {str(memory["maxmemory_policy"])}
    else:  # a Redis Cluster client: each node's
        policies = {
            str(v["maxmemory_policy"])
            for v in memory.values()
            if isinstance(v, dict) and "maxmemory_policy" in v
        }
    risky = sorted(policies - {"noeviction"})
    if not risky:
        return None
    fix = (
        "Set maxmemory-policy noeviction (a full Redis then refuses writes, which rollstream "
        "reports, losing nothing)"
    )
    if all(policy.startswith("volatile") for policy in risky):
        return (
            f"maxmemory-policy {', '.join(risky)} evicts keys with a TTL when memory runs out: the "
            f"processes' liveness keys, so that live producers look dead and their claims go to others. {fix}"
        )
    return (
        f"maxmemory-policy {', '.join(risky)} evicts any key when memory runs out: a run's streams, "
        f"counters and state can vanish without an error. {fix}"
    )


def _server_version(client: redis.Redis) -> str:
    """INFO's redis_version, or HELLO's for a least-privilege ACL user without INFO."""
    try:
        return str(client.info("server")["redis_version"])
    except redis.exceptions.NoPermissionError:
        hello: Any = client.execute_command("HELLO")  # type: ignore[no-untyped-call]
        version = hello.get(b"version", hello.get("version")) if isinstance(hello, dict) else None
        if version is None:
            raise
        return version.decode() if isinstance(version, bytes) else str(version)


def wait_for_redis(
    settings: RedisSettings, timeout_s: float, stop: threading.Event | None = None
) -> redis.Redis | None:
    """A checked client once Redis answers, waiting with back-off and a warning every
    few seconds (a process may start before Redis does); None when ``stop`` is set
    first. A wrong password or a server that is too old fails at once."""
    prober = connect(settings, check=False, ride_out=False)  # this loop does the waiting

    def probe() -> redis.Redis:
        try:
            check_server(prober, settings.url)
        except RedisUnavailable as exc:
            if not exc.retryable:
                raise
            raise NotYet(exc.reason) from None
        return connect(settings, check=False)

    try:
        return wait_until(probe, f"Redis at {redact_url(settings.url)}", timeout_s, stop)
    finally:
        prober.close()
