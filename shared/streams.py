"""Consumer-group mechanics under the replay buffer: creating streams and groups,
reading entries, and the fenced settle that ends an entry's time as pending.

A settle acks and deletes entries this consumer holds in one stream, first
appending a new entry for each (a group, a pool entry, a dead letter)
somewhere else, and writes nothing for an entry that is no longer this
consumer's. However many entries, it is one round trip:

    WATCH fence      the source stream's fence counter: every reclaim bumps it
    EVAL gate        all still pending for me, and the writes below cannot fail?
                     if not, the gate bumps the fence itself and names the
                     entries that are not mine (see scripts.py)
    MULTI
    XADD dest ...    each payload, never passed through Lua
    XACK / XDEL      the source entries
    HINCRBY ...      the progress counters, summed
    EXEC             runs only if the fence did not move since WATCH

Only a reclaim moves an entry to another owner, so an EXEC that runs saw no
change of owner since its gate checked; a reclaim between gate and EXEC
aborts it, and the settle checks again; entries the gate named are dropped
and the rest settled again. A settle whose connection drops is sent again only
when an entry is still pending for this consumer (EXEC acks all or none, so the
transaction did not run); EXECABORT (a write Redis refused, e.g. out of memory)
wrote nothing and is raised as such. One claim is settled by one thread: two
concurrent settles of the same entry by the same consumer are not fenced
against each other.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from rollstream.shared import codec
from rollstream.shared.errors import CorruptValueError, RedisOutOfMemory, ReplayBufferError
from rollstream.shared.keys import GROUP_OF_KIND, Count, Keys
from rollstream.shared.records import MAX_STEP
from rollstream.shared.redis_cluster import follow_slot_said, pool_for
from rollstream.shared.resp import CommandWriter
from rollstream.shared.scripts import SETTLE_GATE

_log = logging.getLogger(__name__)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


INT64_MAX = 2**63 - 1
SETTLE_RESENDS = 3  # a settle sent again after a dropped connection, when it did not run
ROUND_TRIP_REDIRECTS = 3  # a round trip sent again after MOVED (in a cluster: nothing ran)
_INTEGER = re.compile(r"-?[0-9]{1,19}")  # what Redis writes for an integer: no "+", "_" or spaces


def stored_int(value: Any, key: str, field: str, expected: str, low: int = 0, high: int = INT64_MAX) -> int:
    """An integer field read from Redis (an HGET, a stream entry's field), 0 when absent;
    anything else raises CorruptValueError naming the key, the field and the value, where
    int() would raise a bare ValueError far from what holds it."""
    if value is None:
        return 0
    shown = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if _INTEGER.fullmatch(shown) and low <= (number := int(shown)) <= high:
        return number
    raise CorruptValueError(key, field, shown, expected)


def stored_step(value: Any, key: str, field: str) -> int:
    """A train or model step (0 when absent): 0 ... MAX_STEP (see shared/records.py)."""
    return stored_int(value, key, field, "a step number", 0, MAX_STEP)


def stored_float(value: Any, key: str, field: str, expected: str = "a number") -> float:
    """A finite float field read from Redis (HINCRBYFLOAT writes them), 0.0 when absent."""
    if value is None:
        return 0.0
    shown = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    try:
        number = float(shown)
    except ValueError:
        number = math.nan
    if math.isfinite(number):
        return number
    raise CorruptValueError(key, field, shown, expected)


def pairs(flat: list[Any]) -> dict[bytes, bytes]:
    """An entry's fields from the flat [name, value, ...] list a script returns."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


OOM_ADVICE = (
    "Redis is out of memory: its used memory is above its maxmemory setting and its "
    "maxmemory-policy (noeviction) refuses writes"
)


def refused(error: Exception, replies: Sequence[Any], what: str) -> Exception:
    """The error to raise for a transaction Redis refused (EXECABORT) or a failed gate:
    one that names the cause. Nothing of the transaction was written, so the entries stay
    pending for this consumer and are settled again later (or reclaimed)."""
    causes = [
        r
        for r in replies
        if isinstance(r, redis.ResponseError) and not isinstance(r, redis.exceptions.ExecAbortError)
    ]
    if any(
        isinstance(r, redis.exceptions.OutOfMemoryError) or str(r).startswith("OOM") for r in (error, *causes)
    ):
        return RedisOutOfMemory(
            f"{OOM_ADVICE}: {what} wrote nothing (raise maxmemory, or free memory: "
            "a trainer that commits frees the groups it trained on)"
        )
    if isinstance(error, redis.exceptions.ExecAbortError):
        cause = causes[0] if causes else error
        return ReplayBufferError(f"Redis refused {what}, nothing written: {cause}")
    return error


_CORRUPT_COUNTER = re.compile(r"progress field (\S+) is not a number: (.*)", re.S)


def corrupt_counter(error: Exception, progress: str) -> CorruptValueError | None:
    """A script's refusal of a progress counter that is not a number, as the error that
    names the key (every settle would fail on it again: a process stops on it)."""
    match = _CORRUPT_COUNTER.search(str(error))
    if match is None:
        return None
    field = match.group(1)
    return CorruptValueError(progress, field, match.group(2), counter_expected(progress, field))


def counter_expected(progress: str, field: str) -> str:
    """What a progress counter must hold, with the repair: the run's fault, not its
    entries', so every process that settles stops on it until a person sets it."""
    kind = "a number" if field.rpartition(":")[2] == Count.REWARD_SUM else "a count"
    return (
        f"{kind}: every settle that counts in it fails until it is repaired, with "
        f"`redis-cli HSET {progress} {field} <its value>` (`rollstream status` shows the task's "
        "other counters to work it out from; 0 only if nothing was counted in it yet)"
    )


@dataclass(slots=True)
class Entry:
    """One stream entry as read through a consumer group."""

    stream: str
    kind: str
    task: str
    id: str
    fields: codec.RawFields
    deliveries: int = 1


@dataclass(slots=True)
class Settle:
    """What one settle writes: ``fields`` appended to ``dest`` (none: nothing appended),
    the entry counted in ``progress_field``, and ``more`` added to other counters;
    ``log``: a (stream, fields) record appended too (the archive's trained log)."""

    entry: Entry
    dest: str | None
    fields: dict[str, Any] | None
    progress_field: str
    more: dict[str, float] | None = None
    log: tuple[str, dict[str, Any]] | None = None


class ConsumerStreams:
    """The streams of one run, seen by one consumer name."""

    def __init__(self, client: redis.Redis, keys: Keys, consumer: str) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.caps: dict[str, int] = {}  # stream -> MAXLEN ~ of each XADD a settle makes to it
        self._ensured: set[str] = set()
        self._local = threading.local()  # a CommandWriter per thread

    def ensure(self, task: str) -> None:
        """Create the task's streams and consumer groups (id 0: earlier entries count).
        A stream this process's ACL user may not write (a feeder's user and the groups
        stream: deploy/redis/acl.sh) is left to the processes that write it, which
        create it the same way."""
        if task in self._ensured:
            return
        for kind, group in GROUP_OF_KIND.items():
            try:
                self.client.xgroup_create(self.keys.stream(kind, task), group, id="0", mkstream=True)
            except redis.exceptions.NoPermissionError:
                continue
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._ensured.add(task)

    def read(
        self, kinds: Sequence[str], task: str, count: int, *, block_ms: int = 0, start: str = ">"
    ) -> list[Entry]:
        """XREADGROUP from the task's streams of ``kinds`` (one consumer group between
        them): new entries with ``start`` ">", this consumer's own pending ones after
        ``start`` otherwise (then ``deliveries`` is left 0: the caller looks it up)."""
        kind_of = {self.keys.stream(kind, task): kind for kind in kinds}
        streams: dict[Any, Any] = dict.fromkeys(kind_of, start)
        groups = {GROUP_OF_KIND[kind] for kind in kinds}
        if len(groups) != 1:
            raise ValueError(f"stream kinds {kinds} are not read by one consumer group")
        group = groups.pop()
        try:
            reply = self._xreadgroup(group, streams, count, block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The streams were deleted under us (FLUSHALL, DEL): create them again, once.
            self._ensured.discard(task)
            self.ensure(task)
            reply = self._xreadgroup(group, streams, count, block_ms)
        deliveries = 1 if start == ">" else 0
        out = []
        for stream_name, items in reply or []:
            stream = text(stream_name)
            for entry_id, fields in items:
                out.append(Entry(stream, kind_of[stream], task, text(entry_id), fields or {}, deliveries))
        return out

    def _xreadgroup(self, group: str, streams: dict[Any, Any], count: int, block_ms: int) -> Any:
        return self.client.xreadgroup(group, self.consumer, streams, count=count, block=block_ms or None)

    def settle(
        self,
        entry: Entry,
        dest: str | None,
        fields: dict[str, Any] | None,
        progress_field: str,
        more: dict[str, float] | None = None,
        log: tuple[str, dict[str, Any]] | None = None,
    ) -> str | None:
        """Ack + delete a held entry, first appending ``fields`` to ``dest`` if given (and
        ``log``'s record to its stream); count it in ``progress_field`` (and add ``more``
        to other progress fields). Returns the new entry's id ("OK" without a
        destination), or None, with nothing written, when the entry is not ours."""
        return self.settle_many([Settle(entry, dest, fields, progress_field, more, log)])[0]

    def settle_many(self, settles: Sequence[Settle]) -> list[str | None]:
        """Settle entries of one stream in one round trip (one gate, one MULTI ... EXEC);
        a result per settle, as ``settle`` returns it. The entries that are no longer
        this consumer's are left out and the rest settled again."""
        results: list[str | None] = [None] * len(settles)
        todo = list(range(len(settles)))
        resent = 0
        while todo:
            commands = self._settle_commands([settles[i] for i in todo])
            try:
                replies = self.round_trip(commands)
            except (redis.ConnectionError, redis.TimeoutError):
                # The connection dropped: did the transaction run? EXEC acks every entry or
                # none, so one still pending for us means it did not, and sending it again is
                # safe. Otherwise (it ran and its reply was lost, or another consumer took the
                # entries) the error stands; nothing is pending for us either way.
                if resent >= SETTLE_RESENDS or not self._any_pending([settles[i].entry for i in todo]):
                    raise
                resent += 1
                continue
            verdict, done = replies[1], replies[-1]
            if isinstance(done, Exception):  # EXECABORT: Redis refused a queued write
                raise refused(done, replies, f"a settle of {len(todo)} entries of {settles[0].entry.stream}")
            if isinstance(verdict, Exception):
                raise corrupt_counter(verdict, self.keys.progress) or refused(
                    verdict, replies, f"the gate of a settle of {settles[0].entry.stream}"
                )
            if verdict != 1:  # the positions (1-based) of entries reclaimed by another
                if done is not None:  # pragma: no cover - only if WATCH were not honoured
                    raise ReplayBufferError(f"settle of {len(todo)} entries ran although its gate refused")
                lost = {todo[position - 1] for position in verdict}
                todo = [i for i in todo if i not in lost]
                continue
            if done is None:
                continue  # a reclaim of this stream came between gate and EXEC
            for reply in done:
                if isinstance(reply, Exception):
                    raise reply
            added = iter(done)
            for i in todo:
                results[i] = text(next(added)) if settles[i].dest else "OK"
                if settles[i].log:
                    next(added)  # the log record's id
            todo = []
        return results

    def _any_pending(self, entries: Sequence[Entry]) -> bool:
        """Whether any of the entries (of one stream) is pending for this consumer, asked
        through the client's outage retry: it waits for Redis to answer again."""
        group = GROUP_OF_KIND[entries[0].kind]
        for entry in entries:
            mine = self.client.xpending_range(
                entry.stream, group, min=entry.id, max=entry.id, count=1, consumername=self.consumer
            )
            if mine:
                return True
        return False

    def _settle_commands(self, settles: Sequence[Settle]) -> list[tuple[Any, ...]]:
        """WATCH fence, the gate, MULTI, the appends, one XACK + XDEL, the progress
        counters summed, EXEC."""
        stream, kind = settles[0].entry.stream, settles[0].entry.kind
        if any(s.entry.stream != stream for s in settles):
            raise ValueError("settle_many settles entries of one stream")
        group = GROUP_OF_KIND[kind]
        fence = self.keys.fence(stream)
        ids = [s.entry.id for s in settles]
        if len(set(ids)) != len(ids):
            raise ValueError("settle_many got one entry twice")
        counts: dict[str, float] = {}
        for s in settles:
            counts[s.progress_field] = counts.get(s.progress_field, 0) + 1
            for name, amount in (s.more or {}).items():
                counts[name] = counts.get(name, 0) + amount
        logs = [s.log[0] for s in settles if s.log]
        dests = list(dict.fromkeys([*(s.dest for s in settles if s.dest), *logs]))
        integers = [name for name, amount in counts.items() if isinstance(amount, int)]
        floats = [name for name, amount in counts.items() if not isinstance(amount, int)]
        gate = (
            "EVAL", SETTLE_GATE, 3 + len(dests), stream, self.keys.progress, fence, *dests,
            group, self.consumer, len(ids), *ids, len(integers), *integers, *floats,
        )  # fmt: skip
        writes: list[tuple[Any, ...]] = []
        for s in settles:
            if s.dest:
                flat: list[Any] = []
                for name, value in (s.fields or {}).items():
                    flat += (name, value)
                cap = ("MAXLEN", "~", self.caps[s.dest]) if s.dest in self.caps else ()
                writes.append(("XADD", s.dest, *cap, "*", *flat))
            if s.log:
                flat = []
                for name, value in s.log[1].items():
                    flat += (name, value)
                writes.append(("XADD", s.log[0], "*", *flat))
        writes += [("XACK", stream, group, *ids), ("XDEL", stream, *ids)]
        for name, amount in counts.items():
            command = "HINCRBY" if isinstance(amount, int) else "HINCRBYFLOAT"
            writes.append((command, self.keys.progress, name, amount))
        return [("WATCH", fence), gate, ("MULTI",), *writes, ("EXEC",)]

    def round_trip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send commands on one connection, written straight into one reusable buffer
        (shared/resp.py), and read every reply; error replies come back as exceptions
        in place. In a Redis Cluster, on the master of the run's slot (every key of a run
        shares its hash tag); after a failover there, a dropped connection refreshes the
        cluster's slot map before it is raised (the caller sends again when nothing ran:
        see settle_many), and a MOVED reply (the slot's master moved: nothing ran) refreshes
        it and the commands are sent again to the slot's master now."""
        moved = 0
        while True:
            try:
                replies = self._send(commands)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._follow_slot(exc)
                raise
            redirect = next((r for r in replies if isinstance(r, redis.exceptions.MovedError)), None)
            if redirect is None or moved >= ROUND_TRIP_REDIRECTS:
                return replies
            moved += 1
            self._follow_slot(redirect)

    def _follow_slot(self, error: Exception) -> None:
        """The cluster's slot map asked for again after ``error`` (a no-op for one server),
        said once per change of the slot's master."""
        follow_slot_said(self.client, self.keys.state, error, "settles")

    def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        pool = pool_for(self.client, self.keys.state)
        conn = pool.get_connection()
        try:
            writer = getattr(self._local, "writer", None)
            if writer is None:
                writer = self._local.writer = CommandWriter()
            sent = writer.write(commands, lambda data: conn.send_packed_command([data]))  # type: ignore[no-untyped-call]
            replies: list[Any] = []
            for _ in range(sent):
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:
                    replies.append(exc)
            return replies
        except BaseException:
            # a half-read connection, or one with a WATCH pending, must not be reused
            conn.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            pool.release(conn)
