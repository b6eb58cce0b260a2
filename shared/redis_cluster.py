"""Redis Cluster clients: every command to the master of its key's slot, a failover inside
the cluster ridden out as an outage (commands and pipelines), and the raw round trips'
server for a run's keys (shared/connection.py builds the client from the settings)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from copy import copy
from typing import Any, cast

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from rollstream.shared import redisurl

log = logging.getLogger("rollstream.shared.connection")  # one logger for what connections say


# what a cluster answers while a master fails over: its node gone (ConnectionError,
# TimeoutError), CLUSTERDOWN until the replica is promoted, a slot no node serves yet
CLUSTER_OUTAGE_ERRORS = (ClusterDownError, SlotNotCoveredError)


class OutageCluster(RedisCluster):
    """RedisCluster whose commands ride out a failover inside the cluster (its master of
    a slot killed, the replica promoted) with the outage retry: backed off, bounded by
    redis.outage_limit_s, said once in the log.

    redis-py's own loop retries a failed command at once, refreshing the slot map each
    time, and counts attempts: with OutageRetry's count it spun a core for the seconds of
    a failover, silently, and was bounded by nothing but a million tries. Each try here
    still refreshes the map (redis-py does that before it raises), so the command goes to
    the promoted replica once the cluster names it. Pipelines too (OutagePipeline)."""

    def __init__(self, *, outage: Retry | None, **kwargs: Any) -> None:
        self.outage = outage  # before redis-py's __init__, which sends COMMAND
        if outage is not None:
            outage.update_supported_errors(list(CLUSTER_OUTAGE_ERRORS))
        # redis-py's own loop (and a pipeline's) tries once: the outage retry is ours
        kwargs["retry"] = Retry(ExponentialWithJitterBackoff(), 0)
        super().__init__(**kwargs)

    def _internal_execute_command(self, *args: Any, **kwargs: Any) -> Any:
        run: Callable[..., Any] = super()._internal_execute_command
        targets = kwargs.get("target_nodes")
        if self.outage is None or (targets is not None and not self._is_nodes_flag(targets)):  # type: ignore[no-untyped-call]
            return run(*args, **kwargs)  # named nodes may be gone after a refresh: redis-py's way
        return self.outage.call_with_retry(lambda: run(*args, **kwargs), lambda _error: None)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        # as RedisCluster.pipeline builds it (redis-py 8.1), the outage retry besides
        return OutagePipeline(
            outage=self.outage,
            nodes_manager=self.nodes_manager,
            commands_parser=self.commands_parser,
            startup_nodes=self.nodes_manager.startup_nodes,
            result_callbacks=self.result_callbacks,
            cluster_response_callbacks=self.cluster_response_callbacks,
            read_from_replicas=self.read_from_replicas,
            load_balancing_strategy=self.load_balancing_strategy,
            reinitialize_steps=self.reinitialize_steps,
            retry=self.retry,  # tries once: redis-py's loop over its count does not back off
            lock=self._lock,
            transaction=transaction,
            event_dispatcher=self._event_dispatcher,
        )


# replies after which nothing of a command ran: its slot moved (MOVED, ASK), the cluster is
# down or has no master for the slot yet (in a MULTI they make EXEC abort: nothing ran)
NOTHING_RAN_ERRORS = (AskError, TryAgainError, *CLUSTER_OUTAGE_ERRORS)  # MovedError is an AskError
_PIPELINE_RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError, *NOTHING_RAN_ERRORS)
# commands without the server's readonly flag that write nothing either
_READS = {"time", "ping", "echo"}


class OutagePipeline(ClusterPipeline):
    """A cluster pipeline that rides out a failover like the client's commands: sent
    again with the outage retry (backed off, bounded by redis.outage_limit_s, one warning,
    the slot map asked for again after each failure) where that is safe.

    redis-py's ClusterPipeline loops over its retry's count without a pause (with the
    outage retry's million, a core spun through a failover) and a transaction copies the
    retry it was built with. Here redis-py tries once, and the whole pipeline is sent again:

    * a pipeline or transaction of reads (every command readonly for the server): after
      any failure;
    * any other pipeline: only when it failed before it wrote anything (no connection to
      the slot's master, no master for the slot); a command that failed after it was
      written was sent once more by redis-py itself, as a single command, and its error
      stands (resending the whole pipeline would write the others twice);
    * any other transaction (MULTI ... EXEC): when no connection to the slot's master
      could be made (nothing sent), or a reply says nothing ran (MOVED, ASK, CLUSTERDOWN,
      TRYAGAIN: EXEC aborts); never after a dropped connection or a timeout once it was
      sent, since its EXEC may have run: that error is the caller's, as on one server."""

    def __init__(self, *, outage: Retry | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.in_transaction = bool(kwargs.get("transaction"))
        self.outage: Retry | None = None
        if outage is not None:
            self.outage = copy(outage)  # its supported errors its own
            self.outage.update_supported_errors(list(NOTHING_RAN_ERRORS))

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        strategy = getattr(self, "_execution_strategy", None)
        queued = [(c.args, c.options) for c in strategy.command_queue] if strategy is not None else []
        known = not self.in_transaction or hasattr(strategy, "_get_client_and_connection_for_transaction")
        if self.outage is None or not queued or getattr(strategy, "_watching", False) or not known:
            # WATCHed keys are watched once, on one connection: redis-py's own way then (and
            # on a redis-py whose transactions are not built as 8.1's are)
            return super().execute(raise_on_error)
        reads = reads_only(self.commands_parser, [args for args, _ in queued])
        assert strategy is not None
        sent = False

        def attempt() -> list[Any]:
            nonlocal sent
            sent = False
            self.reset()  # type: ignore[no-untyped-call]
            for args, options in queued:
                strategy.execute_command(*args, **dict(options))
            if self.in_transaction:
                # its connection first: failing here, nothing was sent
                strategy._get_client_and_connection_for_transaction()
            try:
                replies = ClusterPipeline.execute(self, raise_on_error=False)
            except _PIPELINE_RETRY_ERRORS:
                # a pipeline raises only what failed before it wrote; a transaction may
                # have sent its EXEC
                sent = self.in_transaction
                raise
            failed = next((r for r in replies if isinstance(r, _PIPELINE_RETRY_ERRORS)), None)
            if failed is not None and (
                reads or (self.in_transaction and isinstance(failed, NOTHING_RAN_ERRORS))
            ):
                sent = True
                raise failed
            return replies  # any error in them is the caller's (raise_on_error)

        def retryable(error: Exception) -> bool:
            return reads or not sent or (self.in_transaction and isinstance(error, NOTHING_RAN_ERRORS))

        try:
            replies = self.outage.call_with_retry(attempt, self._follow, is_retryable=retryable)
        finally:
            self.reset()  # type: ignore[no-untyped-call]
        if raise_on_error:
            for position, reply in enumerate(replies):
                if isinstance(reply, Exception):
                    self.annotate_exception(reply, position + 1, queued[position][0])  # type: ignore[no-untyped-call]
                    raise reply
        return replies

    def _follow(self, error: Exception) -> None:
        try:
            follow_slot(self, error)  # type: ignore[arg-type]
        except (redis.RedisError, RedisClusterException) as exc:  # no node answers: the retry waits
            log.debug("the slot map could not be refreshed: %s", exc)


def reads_only(parser: Any, commands: Sequence[tuple[Any, ...]]) -> bool:
    """Whether every command (its arguments) only reads, by the flags of the server's
    COMMAND (``parser``: redis-py's CommandsParser); an unknown command is not."""
    known: dict[str, Any] = getattr(parser, "commands", None) or {}
    for args in commands:
        words = _text(args[0]).lower().split()
        entry = known.get(words[0])
        if entry is None:
            return False
        flags = [_text(f) for f in entry.get("flags", [])]
        if entry.get("subcommands"):  # XINFO GROUPS: the subcommand's flags
            name = "|".join(
                [words[0], words[1] if len(words) > 1 else _text(args[1]).lower() if len(args) > 1 else ""]
            )
            sub = next((s for s in entry["subcommands"] if _text(s[0]).lower() == name), None)
            if sub is None:
                return False
            flags = [_text(f) for f in sub[2]]
        if "readonly" not in flags and words[0] not in _READS:
            return False
    return True


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cluster_client(
    target: redisurl.MultiHostUrl, options: dict[str, Any], outage: Retry | None
) -> redis.Redis:
    """A Redis Cluster client: each command goes to the master of its key's slot. Every key
    of a run shares the ``{run}`` hash tag, so a run lives on one master and its scripts,
    transactions and multi-stream reads are legal there. A failover inside the cluster is
    an outage ridden out (OutageCluster) with ``outage``, the client's outage retry."""
    nodes = [ClusterNode(host, port) for host, port in target.hosts]  # type: ignore[no-untyped-call]
    client = OutageCluster(
        startup_nodes=nodes,
        username=target.username,
        password=target.password,
        socket_timeout=options["socket_timeout"],
        socket_connect_timeout=options["socket_connect_timeout"],
        health_check_interval=options["health_check_interval"],
        outage=outage,
    )
    return cast(redis.Redis, client)


def server_for(client: redis.Redis, key: str) -> redis.Redis:
    """A client of the one server that holds ``key``: the client itself, or in a Redis
    Cluster a client of the master of the key's slot (for what must go over one
    connection to it: a WATCH ... EXEC round trip, a write and the WAIT behind it), as the
    cluster client's slot map names it (see :func:`follow_slot`)."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)
        return node.redis_connection or client.get_redis_connection(node)
    return client


def pool_for(client: redis.Redis, key: str) -> redis.ConnectionPool:
    """The connection pool of the server that holds ``key`` (see :func:`server_for`)."""
    return server_for(client, key).connection_pool


def follow_slot(client: redis.Redis, error: BaseException) -> None:
    """After a raw round trip to :func:`server_for`'s server failed with ``error`` (its
    connection dropped, or MOVED: the slot has another master, a failover's promoted
    replica), ask the cluster for its slot map again, so that the next
    :func:`server_for` names the slot's master now. Nothing for one server (a Sentinel's
    or a plain client follows its primary by itself)."""
    if isinstance(client, RedisCluster):
        if isinstance(error, redis.exceptions.AskError):  # MOVED too: where the slot went
            client.nodes_manager.initialize(additional_startup_nodes_info=[(error.host, error.port)])
        else:
            client.nodes_manager.initialize()


def follow_slot_said(client: redis.Redis, key: str, error: BaseException, what: str) -> None:
    """:func:`follow_slot` after ``error`` on a round trip to ``key``'s server, said once per
    change of the slot's master ("... now (after MOVED ...): ``what`` go there"). A
    cluster that answers no one is left to the caller's retry, which waits."""
    before = pool_for(client, key)
    try:
        follow_slot(client, error)
    except (redis.RedisError, RedisClusterException) as exc:
        log.debug("the slot map of %s could not be refreshed: %s", key, exc)
        return
    after = pool_for(client, key)
    if after is not before:
        where = after.connection_kwargs
        cause = (
            f"MOVED {error}"
            if isinstance(error, redis.exceptions.MovedError)
            else str(error) or type(error).__name__
        )
        log.warning("the run's slot is served by %s:%s now (after %s): %s go there",
                    where.get("host"), where.get("port"), cause, what)  # fmt: skip


def scan_run(client: redis.Redis, key: str, match: str, count: int, kind: str | None = None) -> list[bytes]:
    """The keys matching ``match`` on the server that holds ``key`` (every key of a run
    shares its ``{run}`` hash tag: one server holds them all), ``kind`` their type if given.

    In a Redis Cluster it scans the master of ``key``'s slot only, not every master; a
    failover of that master met half-way (its connection gone, MOVED) is ridden out as
    an outage, the slot followed, and the scan begun again on the promoted replica. One
    server: its own SCAN, with its client's outage retry."""
    if not isinstance(client, RedisCluster):
        return list(client.scan_iter(match=match, count=count, _type=kind))

    def once() -> list[bytes]:
        server = server_for(client, key)
        try:
            return list(server.scan_iter(match=match, count=count, _type=kind))
        except (redis.ConnectionError, redis.TimeoutError, AskError, ClusterDownError, TryAgainError) as exc:
            follow_slot_said(client, key, exc, "scans")
            raise redis.ConnectionError(f"the scan of {key}'s server: {exc}") from exc

    outage = getattr(client, "outage", None)
    if outage is None:
        return once()
    return cast(list[bytes], outage.call_with_retry(once, lambda _error: None))
