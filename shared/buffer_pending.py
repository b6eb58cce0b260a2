"""The entries pending for one consumer of a run's streams: what this process holds
(handed out and not settled yet), the heartbeat that keeps them its own, the reclaim
that takes back what a dead or slow consumer left idle, and the dead letters where an
entry goes that no reader can use. The base of ReplayBuffer (shared/buffer.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import redis

from rollstream.shared.errors import CorruptValueError, ReplayBufferError
from rollstream.shared.keys import (
    EVALS,
    GROUP_OF_KIND,
    GROUPS,
    POOLS,
    PRODUCERS,
    Count,
    Keys,
    Role,
    progress_field,
)
from rollstream.shared.scripts import DEAD_HEADER, Scripts
from rollstream.shared.scripts_stranded import HAND_BACK, UNCHARGE
from rollstream.shared.settings import BufferSettings
from rollstream.shared.streams import ConsumerStreams, Entry, pairs, text

_log = logging.getLogger(__name__)
HAND_BACK_PAGE = 256  # stranded claims looked at per pool and call: the rest at the next


class PendingEntries:
    """The pending entries of one consumer name, and the settles every kind of entry shares."""

    def __init__(self, client: redis.Redis, keys: Keys, settings: BufferSettings, consumer: str) -> None:
        self.client = client
        self.keys = keys
        self.buffer_settings = settings
        self.consumer = consumer
        self.scripts = Scripts(client)
        self._hand_back = client.register_script(HAND_BACK)
        self._uncharge = client.register_script(UNCHARGE)
        self.streams = ConsumerStreams(client, keys, consumer)
        self.streams.caps = {keys.dead: settings.dead_maxlen, keys.filtered: settings.filtered_maxlen}
        self._last_reclaim: dict[str, float] = {}
        # What this process holds: entries it handed out (claims, batch items) and has not
        # settled yet, by stream and id. An entry pending under this consumer name that is
        # not here (a settle that failed, a reply lost and the command sent again) is taken
        # back by reclaim once idle claim_idle_ms, like a dead consumer's.
        self._held: dict[str, dict[str, Entry]] = {}
        self._held_lock = threading.Lock()

    def ensure(self, task: str) -> None:
        """Create the task's streams and consumer groups."""
        self.streams.ensure(task)

    def _settle(
        self,
        entry: Entry,
        dest: str | None,
        fields: dict[str, Any] | None,
        counter: Count,
        more: dict[str, float] | None = None,
        log: tuple[str, dict[str, Any]] | None = None,
    ) -> str | None:
        try:
            return self.streams.settle(entry, dest, fields, progress_field(entry.task, counter), more, log)
        except CorruptValueError:
            self.uncharge([entry])  # the run's fault, not the entry's: no delivery charged
            raise
        finally:  # settled, not ours any more, or failed: then reclaim takes it back
            self.release([entry])

    # --- what this process holds -----------------------------------------------------

    def hold(self, entries: Iterable[Entry]) -> None:
        """Record entries as held by this process (what claim and read_batch hand out):
        reclaim never takes them back from it."""
        with self._held_lock:
            for entry in entries:
                self._held.setdefault(entry.stream, {})[entry.id] = entry

    def release(self, entries: Iterable[Entry]) -> None:
        """Forget entries this process no longer holds (settled, or given up without a
        settle): one still pending under this consumer is taken back by :meth:`reclaim`
        once idle claim_idle_ms."""
        with self._held_lock:
            for entry in entries:
                ids = self._held.get(entry.stream)
                if ids is not None:
                    ids.pop(entry.id, None)

    def held(self, kind: str | None = None) -> list[Entry]:
        """The entries this process holds (of one stream kind), for :meth:`touch`."""
        with self._held_lock:
            return [e for ids in self._held.values() for e in ids.values() if kind is None or e.kind == kind]

    def _held_ids(self, stream: str) -> list[str]:
        with self._held_lock:
            return list(self._held.get(stream, ()))

    # --- taking back, keeping, giving up ---------------------------------------------

    def reclaim(self, kind: str, task: str, count: int, *, force: bool = False) -> list[Entry]:
        """Take over entries that other consumers of the kind's group left idle longer
        than claim_idle_ms (dead, or too slow to heartbeat with :meth:`touch`), and
        entries pending under this consumer that this process does not hold (see
        :meth:`release`): a settle that failed, a claim or read sent again after a
        lost reply. Each counts as a delivery.

        Entries delivered more than max_attempts times go to the dead letters
        instead. Without ``force`` a stream is scanned at most twice per
        claim_idle_ms: nothing can become reclaimable faster than that.
        """
        stream = self.keys.stream(kind, task)
        idle_ms = self.buffer_settings.claim_idle_ms
        now = time.monotonic()
        if not force and now - self._last_reclaim.get(stream, -1e18) < idle_ms / 2000:
            return []
        self._last_reclaim[stream] = now
        out: list[Entry] = []
        start = "-"
        while len(out) < count:
            keys = [stream, self.keys.dead, self.keys.progress, self.keys.fence(stream)]
            args: list[Any] = [
                GROUP_OF_KIND[kind], self.consumer, idle_ms, start, count - len(out),
                self.buffer_settings.max_attempts, progress_field(task, Count.DEAD),
                progress_field(task, Count.GROUPS_DEAD) if kind == GROUPS else "",
                "1", f"maxlen={self.buffer_settings.dead_maxlen}", *self._held_ids(stream),
            ]  # fmt: skip
            cursor, claimed = self.scripts.reclaim(keys=keys, args=args)
            for entry_id, flat, deliveries in claimed:
                out.append(Entry(stream, kind, task, text(entry_id), pairs(flat), int(deliveries)))
            start = text(cursor)
            if start == "0-0":
                break
        return out

    def hand_back_stranded(self, task: str, *, force: bool = False) -> tuple[int, int]:
        """Hand back to their pools the claims of producers that are gone: pending under a
        producer with no liveness key, idle at least claim_idle_ms. Producers are named by
        pid, so a restarted one never sees its own claims, and while no producer runs
        nobody reclaims them: they would count as running in the admission bound and stay
        "in pools" for good. Each is appended again (claimed afresh, its deliveries so far
        kept in its ``attempts`` field); one that has had max_attempts deliveries already is
        dead-lettered. The bundled trainer calls this while it waits for groups; any
        process of the run may. At most twice per claim_idle_ms without ``force``.
        Returns (handed back, dead-lettered)."""
        idle_ms = self.buffer_settings.claim_idle_ms
        now = time.monotonic()
        mark = f"hand-back:{task}"
        if not force and now - self._last_reclaim.get(mark, -1e18) < idle_ms / 2000:
            return 0, 0
        self._last_reclaim[mark] = now
        handed = dead = 0
        for kind in (EVALS, *POOLS):
            stream = self.keys.stream(kind, task)
            try:
                rows = self.client.xpending_range(stream, PRODUCERS, "-", "+", HAND_BACK_PAGE, idle=idle_ms)
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    continue
                raise
            owners = sorted({text(row["consumer"]) for row in rows})
            if not owners:
                continue
            pipe = self.client.pipeline(transaction=False)
            for owner in owners:
                pipe.exists(self.keys.alive(Role.PRODUCER, owner))
            gone = {owner for owner, alive in zip(owners, pipe.execute(), strict=True) if not alive}
            pairs_: list[str] = []
            for row in rows:
                if text(row["consumer"]) in gone:
                    pairs_ += [text(row["consumer"]), text(row["message_id"])]
            if not pairs_:
                continue
            keys = [stream, self.keys.dead, self.keys.progress, self.keys.fence(stream)]
            args: list[Any] = [
                PRODUCERS, idle_ms, self.buffer_settings.max_attempts, progress_field(task, Count.DEAD),
                self.buffer_settings.dead_maxlen, *pairs_,
            ]  # fmt: skip
            back, lost = self._hand_back(keys=keys, args=args)
            handed, dead = handed + int(back), dead + int(lost)
        if handed or dead:
            _log.warning(
                "handed back %d claims of task %s held by producers that are gone (%d dead-lettered "
                "after max_attempts deliveries)", handed, task, dead,
            )  # fmt: skip
        return handed, dead

    def uncharge(self, entries: Iterable[Entry]) -> int:
        """Give back the delivery of claims whose settle Redis refused for the run's fault
        (a corrupt progress counter): the restart after the repair does not charge them."""
        by_stream: dict[tuple[str, str], list[str]] = {}
        for entry in entries:
            by_stream.setdefault((entry.stream, entry.kind), []).append(entry.id)
        done = 0
        for (stream, kind), ids in by_stream.items():
            done += int(self._uncharge(keys=[stream], args=[GROUP_OF_KIND[kind], self.consumer, *ids]))
        return done

    def touch(self, entries: Iterable[Entry]) -> list[str]:
        """Heartbeat of work in progress: reset the idle time of entries this consumer
        still holds, so that nobody reclaims them while a long generation or train step
        runs. Call it more often than claim_idle_ms. Returns the ids it no longer holds."""
        by_stream: dict[tuple[str, str], list[str]] = {}
        for entry in entries:
            by_stream.setdefault((entry.stream, entry.kind), []).append(entry.id)
        lost: list[str] = []
        for (stream, kind), ids in by_stream.items():
            reply = self.scripts.touch(keys=[stream], args=[GROUP_OF_KIND[kind], self.consumer, *ids])
            lost += [text(i) for i in reply]
        return lost

    def dead_letter(self, entry: Entry, reason: str) -> bool:
        """Move an entry to the dead-letter stream with the reason, its fields and the
        number of deliveries, and ack + delete it. The next entries keep flowing."""
        header = (reason, entry.deliveries, entry.stream, entry.id)
        fields: dict[str, Any] = dict(zip(DEAD_HEADER, header, strict=True))
        for name, value in entry.fields.items():
            key = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
            fields[f"orig.{key}" if key in fields else key] = value
        untrained = {progress_field(entry.task, Count.GROUPS_DEAD): 1.0} if entry.kind == GROUPS else None
        return self._settle(entry, self.keys.dead, fields, Count.DEAD, untrained) is not None

    def dead_letter_by_hand(self, kind: str, task: str, entry_id: str, reason: str) -> tuple[str, str, int]:
        """An operator's move of one entry of a task's stream to the dead letters (an entry
        no reader of this version can read, a group that crashes the trainer), pending or
        not, whoever holds it: counted in ``dead`` (and ``groups_dead`` for a group) like
        every dead letter, its holder's settle fenced off. Returns the dead letter's id,
        the consumer that held the entry ('' when none) and its deliveries (-1: it was
        moved already, by an earlier call); ReplayBufferError when the stream has no such
        entry."""
        if kind not in GROUP_OF_KIND:
            raise ReplayBufferError(
                f"{kind!r} is not a stream kind with entries to dead-letter ({', '.join(GROUP_OF_KIND)})"
            )
        self.ensure(task)
        stream = self.keys.stream(kind, task)
        keys = [stream, self.keys.dead, self.keys.progress, self.keys.fence(stream)]
        args = [
            GROUP_OF_KIND[kind], entry_id, f"by hand: {reason}", progress_field(task, Count.DEAD),
            progress_field(task, Count.GROUPS_DEAD) if kind == GROUPS else "",
            str(self.buffer_settings.dead_maxlen),
        ]  # fmt: skip
        try:
            dead, owner, deliveries = self.scripts.dead_letter_by_hand(keys=keys, args=args)
        except redis.ResponseError as exc:
            if not str(exc).startswith("NOENTRY"):
                raise
            raise ReplayBufferError(str(exc).removeprefix("NOENTRY ")) from None
        return text(dead), text(owner), int(deliveries)
