"""Writes made durable on replicas before the caller goes on (``redis.wait_replicas``).

Redis replicates asynchronously: a primary that dies (kill -9, a lost machine) and is
replaced by its replica (a Sentinel failover) may take its last acknowledged writes with
it. ``WAIT N timeout`` returns once N replicas hold everything the connection wrote, and
since the replication stream is one ordered log, everything every client wrote before.

:func:`wait_for_replicas` sends, on one connection, a small write of its own (the state
hash's ``replicated`` counter, bumped by a script that first checks that the run's
train_step is at least the step the caller committed) and WAIT behind it. So it works
whichever pooled connection carried the caller's own writes, it can be sent again after
a timeout or a reconnect, and a primary that answers after a failover without the
caller's commit is told apart from a slow replica: that is :class:`ReplicasBehind`, not
a success.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import MovedError

from rollstream.shared import telemetry
from rollstream.shared.connection import OutageRetry
from rollstream.shared.errors import ReplicasBehind
from rollstream.shared.keys import REPLICATED, TRAIN_STEP, Keys
from rollstream.shared.redis_cluster import follow_slot_said, server_for
from rollstream.shared.settings import RedisSettings
from rollstream.shared.settings_errors import redact_url
from rollstream.shared.streams import ROUND_TRIP_REDIRECTS

log = logging.getLogger(__name__)

# KEYS: state hash. ARGV: train_step field, the least train_step the caller committed,
# the replicated field. Returns the train_step, or -1 - train_step (writing nothing) when
# it is below the caller's.
_BARRIER = """
local step = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') or 0
if step < tonumber(ARGV[2]) then return -1 - step end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
return step
"""


def wait_for_replicas(
    client: redis.Redis, keys: Keys, settings: RedisSettings, what: str, committed_step: int = 0
) -> int:
    """Return once ``settings.wait_replicas`` replicas hold everything written to the
    primary so far (the number that did; at once, 0, when the setting is 0). Retries the
    WAIT until ``settings.outage_limit_s``, then raises ReplicasBehind naming ``what``;
    raises it at once when the primary lacks train_step ``committed_step`` (a failover
    lost the commit: the caller's step is not committed)."""
    wanted = settings.wait_replicas
    if wanted <= 0:
        return 0
    shown = redact_url(settings.url)
    started = time.monotonic()
    warned = False
    barrier = _barrier_on_cluster if isinstance(client, RedisCluster) else _barrier
    while True:
        step, acked = barrier(client, keys, settings, committed_step)
        if step < 0:
            telemetry.replicas_failed("lost_commit")
            raise ReplicasBehind(
                shown,
                f"{what}: the primary holds train_step {-1 - step}, not {committed_step}: a failover "
                "lost the commit before a replica had it, so that step is not committed (its groups "
                "are pending again and the step is redone)",
            )
        if acked >= wanted:
            telemetry.replicas_waited(time.monotonic() - started)
            if warned:
                log.info("%s: %d replicas hold it after %.1f s", what, acked, time.monotonic() - started)
            return acked
        waited = time.monotonic() - started
        if waited >= settings.outage_limit_s:
            telemetry.replicas_failed("behind")
            raise ReplicasBehind(
                shown,
                f"{what}: {acked} replicas acknowledged it within {waited:.1f} s, fewer than "
                f"redis.wait_replicas {wanted} (is a replica down or lagging? "
                "redis.outage_limit_s bounds this wait)",
            )
        if not warned:
            log.warning(
                "%s: %d of redis.wait_replicas %d replicas acknowledged it within %d ms; waiting "
                "for up to redis.outage_limit_s %g s", what, acked, wanted, settings.wait_timeout_ms,
                settings.outage_limit_s,
            )  # fmt: skip
            warned = True


def _barrier(
    client: redis.Redis, keys: Keys, settings: RedisSettings, committed_step: int
) -> tuple[int, int]:
    """The barrier script and WAIT behind it on one connection of the server of the run's
    state (in a Redis Cluster, its master as the slot map names it): (the barrier's
    reply, the replicas that acknowledged)."""
    pipe = server_for(client, keys.state).pipeline(transaction=False)
    pipe.eval(_BARRIER, 1, keys.state, TRAIN_STEP, committed_step, REPLICATED)
    pipe.execute_command("WAIT", settings.wait_replicas, settings.wait_timeout_ms)  # type: ignore[no-untyped-call]
    replies: list[Any] = pipe.execute()
    return int(replies[0]), int(replies[1])


def _barrier_on_cluster(
    client: redis.Redis, keys: Keys, settings: RedisSettings, committed_step: int
) -> tuple[int, int]:
    """:func:`_barrier` following the run's slot: after a dropped connection, a timeout
    or MOVED (nothing ran: the script's write is refused, and WAIT stays unsent) the
    cluster's slot map is asked for again and both are sent again to the slot's master
    now, with the outage retry. Sending the barrier twice only bumps its counter twice."""
    if settings.outage_limit_s <= 0:
        return _barrier(client, keys, settings, committed_step)
    retry = OutageRetry(redact_url(settings.url), settings.outage_limit_s)
    retry.update_supported_errors([MovedError])  # MOVED again and again: the retry waits

    def follow(error: Exception) -> None:
        follow_slot_said(client, keys.state, error, "the barrier and WAIT")

    def attempt() -> tuple[int, int]:
        # MOVED: the slot has another master (a failover ended) and nothing ran there; not
        # an outage: the map is asked again and the barrier sent at once to the master now
        for _ in range(ROUND_TRIP_REDIRECTS):
            try:
                return _barrier(client, keys, settings, committed_step)
            except MovedError as moved:
                follow(moved)
        return _barrier(client, keys, settings, committed_step)

    return retry.call_with_retry(attempt, follow)
