"""The replay buffer as Redis stream operations.

Producers claim work from three pools of one task — aborted, expired (when
asked), fresh prompts — through the consumer group "producers", and settle
each claim in one fenced step (shared/streams.py): complete (group appended to
the groups stream), abort (back to the aborted pool), or drop (filtered). The trainer reads the
groups stream through the consumer group "trainer" and commits (acks and
deletes) a batch only after its optimizer step, or expires a group into the
expired pool. Every settle is fenced: it writes only while the entry is
still pending for the consumer that settles it.

Acknowledged entries are deleted, so Redis holds what is in flight and no
more; nothing here trims a stream.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from rollstream.shared import codec, telemetry
from rollstream.shared.errors import DecodeError, FeederError, FormatError, ReplayBufferError
from rollstream.shared.keys import (
    ABORTED,
    EVALS,
    EXPIRED,
    GROUP_OF_KIND,
    GROUPS,
    POOLS,
    PRODUCERS,
    PROMPTS,
    TRAINER,
    UNTRAINABLE,
    Count,
    Keys,
    feeder_cursor_field,
    feeder_write_field,
    progress_field,
)
from rollstream.shared.records import Group, Prompt, Sample, Status
from rollstream.shared.scripts import DEAD_HEADER, Scripts
from rollstream.shared.settings import Settings
from rollstream.shared.streams import ConsumerStreams, Entry, Settle, pairs, stored_int, text

FEED_CHUNK = 500
log = logging.getLogger(__name__)
RECOVERED = "done"
ARCHIVE_WARN_S = 30.0  # the trainer's warnings of an archive that lags, at most this often


BATCH_META = "rollstream_batch"  # the coordinator batch a prompt belongs to, in its meta
# The counter of a group dropped by the trainer side without being re-queued, by its status
DROPPED_COUNT = {Status.EXPIRED: Count.EXPIRED_DROPPED, Status.ABORTED: Count.ABORTED_DROPPED}


def eval_batch(prompt: Prompt) -> str:
    batch = prompt.meta.get(BATCH_META)
    if not isinstance(batch, str):
        raise ReplayBufferError(f"eval prompt {prompt.uid!r} names no batch in meta[{BATCH_META!r}]")
    return batch


def refused_format(exc: FormatError, entry: Entry) -> FormatError:
    """The error that stops a reader at an entry of a stream-format major it does not
    read: it names the entry and the operator's two ways on. The entry is not
    dead-lettered (the data is fine, the reader is the wrong one): it stays pending
    under this consumer, and a restart of the same reader stops on it again."""
    kind = entry.kind + ":" + entry.task
    return FormatError(
        f"{entry.stream} entry {entry.id}: {exc}; it stays pending for this consumer. To go on "
        f"without it: rollstream dead-letter {kind} {entry.id} --reason 'format not read'"
    )


def default_consumer_name(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


@dataclass(slots=True)
class Claim:
    """A pool entry a producer holds until it settles it."""

    entry: Entry
    prompt: Prompt
    previous: Group | None = None  # the aborted / expired group, with any kept samples

    @property
    def task(self) -> str:
        return self.entry.task

    @property
    def group_id(self) -> str:
        return self.previous.group_id if self.previous is not None else self.prompt.group_id

    @property
    def source(self) -> str:
        return self.entry.kind

    @property
    def partial(self) -> list[Sample]:
        return [] if self.previous is None else self.previous.samples


@dataclass(slots=True)
class BatchItem:
    entry: Entry
    group: Group


@dataclass(slots=True)
class Batch:
    """Groups read by the trainer; they stay pending until committed."""

    task: str
    items: list[BatchItem] = field(default_factory=list)

    @property
    def groups(self) -> list[Group]:
        return [item.group for item in self.items]

    def __len__(self) -> int:
        return len(self.items)


@dataclass(slots=True)
class FeedResult:
    added: int
    existing: int


class ReplayBuffer:
    """Stream operations of one run, for one consumer name.

    A producer process uses one name per process (a dead one's claims are
    reclaimed by the others); a trainer uses a stable name, so that after a
    restart it re-reads its own pending groups first.
    """

    def __init__(self, client: redis.Redis, settings: Settings, consumer: str | None = None) -> None:
        self.client = client
        self.settings = settings
        self.keys = Keys(settings.run)
        self.consumer = consumer or default_consumer_name("worker")
        self.scripts = Scripts(client)
        self.streams = ConsumerStreams(client, self.keys, self.consumer)
        self._recover_from: dict[str, str] = {}  # task -> last own pending id re-read
        self._last_reclaim: dict[str, float] = {}
        # What this process holds: entries it handed out (claims, batch items) and has not
        # settled yet, by stream and id. An entry pending under this consumer name that is
        # not here (a settle that failed, a reply lost and the command sent again) is taken
        # back by reclaim once idle claim_idle_ms, like a dead consumer's.
        self._held: dict[str, dict[str, Entry]] = {}
        self._held_lock = threading.Lock()
        # when the trainer last warned of the archive's lag, and of groups deleted unarchived
        self._archive_warned = {"lag": -ARCHIVE_WARN_S, "trimmed": -ARCHIVE_WARN_S}
        self._archive_trimmed = 0  # groups the trained log's cap trimmed since that warning

    # --- streams and groups ----------------------------------------------------------

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

    # --- feeding ---------------------------------------------------------------------

    def feed(self, prompts: Iterable[Prompt], pool: str = PROMPTS, batch: str | None = None) -> FeedResult:
        """Append prompts to their tasks' ``pool`` (fresh prompts, or eval prompts with
        "evals"); a uid already fed is not stored again. The prompts of a coordinator
        ``batch`` are remembered in the batch's own fed sets (Keys.batch_fed), which go
        with the batch, not in the run's, which never shrink."""
        added = existing = 0
        by_task: dict[str, list[Prompt]] = {}
        for prompt in prompts:
            by_task.setdefault(prompt.task, []).append(prompt)
        for task, items in by_task.items():
            self.ensure(task)
            for start in range(0, len(items), FEED_CHUNK):
                chunk = items[start : start + FEED_CHUNK]
                args: list[Any] = [progress_field(task, Count.FED)]
                for p in chunk:
                    fields = codec.encode_prompt(p)
                    args += [fields["uid"], fields["task"], fields["data"]]
                fed = self.keys.fed(task) if batch is None else self.keys.batch_fed(batch, task)
                keys = [self.keys.stream(pool, task), fed, self.keys.progress]
                n = int(self.scripts.feed(keys=keys, args=args))
                added += n
                existing += len(chunk) - n
        return FeedResult(added, existing)

    def feed_at_cursor(self, task: str, prompts: Sequence[Prompt], expected: str, new: str) -> int:
        """Append prompts and move the task's feeder cursor from ``expected`` to ``new``
        in one step; FeederError, with nothing written, when the cursor is elsewhere. A
        token of this call, stored with the cursor, makes it safe to send again: the outage
        retry of a call whose reply was lost finds its own write, not another feeder's."""
        self.ensure(task)
        token = os.urandom(8).hex()
        args: list[Any] = [
            feeder_cursor_field(task), expected, new, progress_field(task, Count.FED),
            feeder_write_field(task), token,
        ]  # fmt: skip
        for p in prompts:
            fields = codec.encode_prompt(p)
            args += [fields["uid"], fields["task"], fields["data"]]
        keys = [self.keys.prompts(task), self.keys.state, self.keys.progress]
        try:
            return int(self.scripts.feed_at_cursor(keys=keys, args=args))
        except redis.ResponseError as exc:
            if not str(exc).startswith("CURSOR"):
                raise
            raise FeederError(
                f"the feeder cursor of task {task!r} moved to {str(exc)[7:] or 'nothing'!r} "
                f"while this feeder expected {expected or 'nothing'!r}: is another feeder running?"
            ) from None

    def feeder_cursor(self, task: str) -> str:
        value = self.client.hget(self.keys.state, feeder_cursor_field(task))
        return "" if value is None else text(value)

    def unclaimed(self, task: str) -> int:
        """Fresh prompts not yet delivered to any producer (acked entries are deleted)."""
        self.ensure(task)
        stream = self.keys.prompts(task)
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(stream)
        pipe.xpending(stream, PRODUCERS)
        length, pending = pipe.execute()
        return int(length) - int(pending["pending"])

    # --- producer side ---------------------------------------------------------------

    def claim(
        self,
        task: str,
        count: int = 1,
        *,
        include_expired: bool = False,
        block_ms: int = 0,
        limit: int | None = None,
    ) -> list[Claim]:
        """Claim up to ``count`` work items: idle claims of dead producers, then the
        aborted pool, the expired pool (only with ``include_expired``), fresh prompts.

        ``limit`` is the admission bound: new work is claimed only while the task's
        accepted + running groups stay below it, checked atomically across producers.
        With ``block_ms`` it waits that long for work when every pool is empty (and
        the bound leaves room).
        """
        self.ensure(task)
        kinds = [k for k in POOLS if include_expired or k != EXPIRED]
        claims: list[Claim] = []
        # a dead producer's claims, from every pool whatever this caller's mode (one that
        # claimed from the expired pool in tail-batch mode leaves claims there that a
        # producer out of that mode must take back too); already admitted: not counted twice
        for kind in (EVALS, *POOLS):
            if len(claims) < count:
                claims += self._claims(self.reclaim(kind, task, count - len(claims)))
        if len(claims) < count:  # eval prompts go ahead of training work, outside the bound
            claims += self._claims(self.streams.read([EVALS], task, count - len(claims)))
        if len(claims) < count:
            claims += self._claims(self._claim_new(task, count - len(claims), kinds, limit))
        if not claims and block_ms > 0:
            if limit is None:
                # Wake on whichever pool gets work first, take it, then fill up in pool order.
                claims = self._claims(self.streams.read(kinds, task, 1, block_ms=block_ms))
            elif self.admitted(task) < limit:
                # Wait for new work without taking it, then claim through the bound check.
                self.client.xread({self.keys.stream(k, task): "$" for k in kinds}, count=1, block=block_ms)
                claims = self._claims(self._claim_new(task, 1, kinds, limit))
            if claims:
                claims += self.claim(task, count - 1, include_expired=include_expired, limit=limit)
        return claims

    def _claim_new(self, task: str, count: int, kinds: list[str], limit: int | None) -> list[Entry]:
        if limit is None:
            entries: list[Entry] = []
            for kind in kinds:
                if len(entries) < count:
                    entries += self.streams.read([kind], task, count - len(entries))
            return entries
        keys = [self.keys.aborted(task), self.keys.expired(task), self.keys.prompts(task), self.keys.progress]
        expired = "1" if EXPIRED in kinds else "0"
        args: list[Any] = [PRODUCERS, self.consumer, count, limit, expired, *self._accepted_fields(task)]
        out = []
        for stream, entry_id, flat in self.scripts.claim_bounded(keys=keys, args=args):
            name = text(stream)
            kind = self.keys.parse_stream(name)[0]  # type: ignore[index]
            out.append(Entry(name, kind, task, text(entry_id), pairs(flat)))
        return out

    @staticmethod
    def _accepted_fields(task: str) -> list[str]:
        """The counters of accepted groups: completed, then those subtracted from it."""
        return [progress_field(task, c) for c in (Count.COMPLETED, *UNTRAINABLE)]

    def accepted(self, task: str) -> int:
        """Groups of the task that can still be trained on: completed, less those that left
        the groups stream untrained (expired, dropped, dead-lettered)."""
        names = self._accepted_fields(task)
        counts = self.client.hmget(self.keys.progress, names)
        completed, *gone = (
            stored_int(c, self.keys.progress, name, "a count") for c, name in zip(counts, names, strict=True)
        )
        return completed - sum(gone)

    def running(self, task: str) -> int:
        """Work of the task claimed by producers and not yet settled."""
        pipe = self.client.pipeline(transaction=False)
        for kind in POOLS:
            pipe.xpending(self.keys.stream(kind, task), PRODUCERS)
        return sum(int(p["pending"]) for p in pipe.execute())

    def admitted(self, task: str) -> int:
        """accepted + running of the task, as the admission bound counts them."""
        return self.accepted(task) + self.running(task)

    def _claims(self, entries: list[Entry]) -> list[Claim]:
        """Claims of the entries read; an entry that does not decode is dead-lettered at
        once (a second delivery would fail the same way) and the others are claimed."""
        out: list[Claim] = []
        for entry in entries:
            try:
                if codec.is_group_entry(entry.fields):
                    previous = codec.decode_group(entry.fields)
                    claim = Claim(entry, previous.prompt, previous)
                else:
                    claim = Claim(entry, codec.decode_prompt(entry.fields))
                if entry.kind == EVALS:
                    eval_batch(claim.prompt)  # needed only to settle it: fail now, not after generating
            except (DecodeError, ReplayBufferError) as exc:
                self.dead_letter(entry, str(exc))
            except FormatError as exc:  # the claims decoded so far stay pending: taken back once idle
                raise refused_format(exc, entry) from None
            else:
                out.append(claim)
        self.hold(claim.entry for claim in out)
        return out

    def complete(self, claim: Claim, group: Group) -> str | None:
        """Append the group and ack + delete the claimed entry, atomically.

        Returns the group's entry id, or None when the claim was no longer
        this producer's (reclaimed by another): then nothing was written.
        """
        return self.complete_many([(claim, group)])[0]

    def complete_many(self, done: Sequence[tuple[Claim, Group]]) -> list[str | None]:
        """``complete`` for many claims: one round trip per pool stream they came from
        (a producer with many groups finishing at once writes them together). Each
        claim settles on its own: a reclaimed one gets None and the others land."""
        by_stream: dict[str, list[int]] = {}
        settles = []
        for i, (claim, group) in enumerate(done):
            settles.append(self._completion(claim, group))
            by_stream.setdefault(claim.entry.stream, []).append(i)
        results: list[str | None] = [None] * len(done)
        try:
            for positions in by_stream.values():
                landed = self.streams.settle_many([settles[i] for i in positions])
                for i, result in zip(positions, landed, strict=True):
                    results[i] = result
        finally:  # settled, fenced or failed: this process holds none of them any more
            self.release(claim.entry for claim, _ in done)
        return results

    def _completion(self, claim: Claim, group: Group) -> Settle:
        status = group.status or Status.COMPLETED
        if status is not Status.COMPLETED:
            raise ReplayBufferError(f"only a completed group enters the buffer, not {status.value}")
        fields = codec.encode_group_parts(group, summary=self.settings.buffer.summary)
        if claim.source == EVALS:  # an eval result goes to its batch's stream, not to training
            results = self.keys.eval(eval_batch(claim.prompt))
            return Settle(claim.entry, results, fields, progress_field(claim.task, Count.EVAL_COMPLETED))
        scores = [s.score for s in group.samples if s.score is not None]
        produced: dict[str, float] = {
            progress_field(claim.task, Count.PRODUCED_SAMPLES): group.n,
            progress_field(claim.task, Count.PRODUCED_TOKENS): group.response_tokens,
            progress_field(claim.task, Count.REWARD_COUNT): len(scores),
            progress_field(claim.task, Count.REWARD_SUM): float(sum(scores)),
        }
        return Settle(
            claim.entry,
            self.keys.groups(claim.task),
            fields,
            progress_field(claim.task, Count.COMPLETED),
            produced,
        )

    def abort(self, claim: Claim, partial: Sequence[Sample] = (), *, model_step: int = -1) -> str | None:
        """Send a claim back to the aborted pool (an eval claim to the eval pool), with
        any partial samples to continue."""
        group = Group.for_prompt(
            claim.prompt,
            samples=list(partial),
            model_step=model_step,
            status=Status.ABORTED,
            attempt=claim.previous.attempt if claim.previous else 1,
            producer=self.consumer,
        )
        fields = codec.encode_group(group, summary=self.settings.buffer.summary)
        pool = EVALS if claim.source == EVALS else ABORTED
        return self._settle(claim.entry, self.keys.stream(pool, claim.task), fields, Count.ABORTED)

    def drop(self, claim: Claim, group: Group | None = None) -> bool:
        """Ack + delete a claim without writing the group: the filter rejected it. A small
        record naming the prompt (uid, group id, reward mean) goes to the run's filtered
        stream in the same transaction."""
        if group is None:
            group = Group(claim.group_id, claim.task, claim.prompt, producer=self.consumer)
        record = codec.encode_filtered(group, claim.entry.stream, claim.entry.id)
        return self._settle(claim.entry, self.keys.filtered, record, Count.FILTERED) is not None

    # --- trainer side ----------------------------------------------------------------

    def read_batch(self, task: str, count: int, *, block_ms: int = 0) -> Batch:
        """Read up to ``count`` groups: this consumer's own pending ones first (after a
        restart), then groups idle in a dead trainer consumer, then new ones."""
        self.ensure(task)
        entries: list[Entry] = []
        if count <= 0:
            return Batch(task)
        if self._recover_from.get(task) != RECOVERED:
            held = set(self._held_ids(self.keys.groups(task)))
            entries += [e for e in self._own_pending(task, count) if e.id not in held]
            self.hold(entries)  # before the reclaim below, which takes what is not held
        if len(entries) < count:
            entries += self.reclaim(GROUPS, task, count - len(entries))
        if len(entries) < count:
            entries += self.streams.read([GROUPS], task, count - len(entries), block_ms=block_ms)
        self.hold(entries)
        batch = Batch(task)
        for entry in entries:
            try:
                batch.items.append(BatchItem(entry, codec.decode_group(entry.fields, task, trainable=True)))
            except DecodeError as exc:
                self.dead_letter(entry, str(exc))
            except FormatError as exc:
                # the others stay pending: a reader that goes on takes them back once idle;
                # the refused one stays held, never re-read (nor dead-lettered) by this process
                self.release(e for e in entries if e is not entry)
                raise refused_format(exc, entry) from None
        return batch

    def commit(self, batch: Batch, train_step: int = -1) -> list[str]:
        """Ack + delete the batch's groups after the train step; returns the ids that
        were no longer this trainer's (reclaimed by another consumer). With an archive
        (archive.keep > 0) they are acked but not deleted: an entry per group, with
        ``train_step``, goes to the task's trained log in the same script, and the archiver
        deletes the group once it has written it (consumer/archive.py)."""
        if not batch.items:
            return []
        ids = [item.entry.id for item in batch.items]
        keys = [self.keys.groups(batch.task), self.keys.progress]
        args = [TRAINER, self.consumer, progress_field(batch.task, Count.CONSUMED), *ids]
        keep = self.settings.archive.keep
        try:
            if keep > 0:
                args[3:3] = [str(train_step), repr(time.time()), str(keep)]
                foreign, length, trimmed = self.scripts.commit_logged(
                    keys=[*keys, self.keys.trained(batch.task)], args=args
                )
                self._archive_lag(batch.task, int(length), int(trimmed))
            else:
                foreign = self.scripts.commit(keys=keys, args=args)
        finally:
            self.release(item.entry for item in batch.items)
        return [text(i) for i in foreign]

    def _archive_lag(self, task: str, length: int, trimmed: int) -> None:
        """Warn when the task's trained log nears archive.keep, where the commit deletes its
        oldest unarchived groups, and when it has deleted some (each at most every
        ARCHIVE_WARN_S): the trainer never waits for the archiver, so this is all an archive
        that lags or is stopped costs."""
        settings, warned = self.settings.archive, self._archive_warned
        now = time.monotonic()
        if trimmed > 0:
            self._archive_trimmed += trimmed
            telemetry.archive_trimmed(trimmed)
            if now - self._archive_warned["trimmed"] >= ARCHIVE_WARN_S:
                self._archive_warned["trimmed"] = now
                log.warning(
                    "%d trained groups were deleted unarchived: the trained log %s holds archive.keep "
                    "%d and the archiver (`rollstream archive`) is behind or stopped; they are not "
                    "in the archive",
                    self._archive_trimmed, self.keys.trained(task), settings.keep,
                )  # fmt: skip
                self._archive_trimmed = 0
        elif length >= settings.warn_at * settings.keep and now - warned["lag"] >= ARCHIVE_WARN_S:
            warned["lag"] = now
            log.warning(
                "the archive lags: %d groups in the trained log %s not archived yet, of archive.keep "
                "%d; beyond it the oldest are deleted, never archived (is `rollstream archive` running?)",
                length, self.keys.trained(task), settings.keep,
            )  # fmt: skip

    def expire(self, item: BatchItem, keep: Sequence[Sample] = (), train_step: int = -1) -> str | None:
        """Move a too-stale group to the expired pool as its prompt (plus ``keep``), and
        ack + delete it, atomically. None when it was no longer this trainer's. With an
        archive, a copy of the group goes to the trained log in the same transaction."""
        group = item.group
        entry = Group(
            group_id=group.group_id,
            task=group.task,
            prompt=group.prompt,
            samples=list(keep),
            model_step=group.model_step,
            status=Status.EXPIRED,
            attempt=group.attempt,
            producer=group.producer,
            created_at=group.created_at,
        )
        fields = codec.encode_group(entry, summary=self.settings.buffer.summary)
        log = self._expired_record(item, train_step)
        return self._settle(item.entry, self.keys.expired(group.task), fields, Count.EXPIRED, log=log)

    def discard(self, item: BatchItem, status: Status = Status.EXPIRED, train_step: int = -1) -> bool:
        """Ack + delete a group without re-queueing it (expired groups when tail batch is -1,
        late results of a finished coordinator batch as aborted)."""
        log = self._expired_record(item, train_step) if status == Status.EXPIRED else None
        return self._settle(item.entry, None, None, DROPPED_COUNT[status], log=log) is not None

    def _expired_record(self, item: BatchItem, train_step: int) -> tuple[str, dict[str, Any]] | None:
        """With an archive (archive.keep > 0): the trained-log record of a group that
        expired at ``train_step``, the group's own fields after the header (docs/stream-
        format.md §13). Expiry is rare (admission control comes first): sending the copy
        from here costs the trainer nothing it would notice."""
        if self.settings.archive.keep <= 0:
            return None
        staleness = train_step - item.group.model_step - 1
        header: dict[str, Any] = {
            "fate": "expired",
            "source_id": item.entry.id,
            "train_step": train_step,
            "trained_at": repr(time.time()),
            "trained_by": self.consumer,
            "reason": f"expired at train step {train_step}: staleness {staleness} >= stale_threshold "
            f"{self.settings.rollout.stale_threshold}",
        }
        record = dict(header)
        for name, value in item.entry.fields.items():
            key = name.decode() if isinstance(name, bytes) else str(name)
            record["orig." + key if key in header else key] = value
        return self.keys.trained(item.entry.task), record

    # --- both sides ------------------------------------------------------------------

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
        idle_ms = self.settings.buffer.claim_idle_ms
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
                self.settings.buffer.max_attempts, progress_field(task, Count.DEAD),
                progress_field(task, Count.GROUPS_DEAD) if kind == GROUPS else "",
                "1", *self._held_ids(stream),
            ]  # fmt: skip
            cursor, claimed = self.scripts.reclaim(keys=keys, args=args)
            for entry_id, flat, deliveries in claimed:
                out.append(Entry(stream, kind, task, text(entry_id), pairs(flat), int(deliveries)))
            start = text(cursor)
            if start == "0-0":
                break
        return out

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
        ]  # fmt: skip
        try:
            dead, owner, deliveries = self.scripts.dead_letter_by_hand(keys=keys, args=args)
        except redis.ResponseError as exc:
            if not str(exc).startswith("NOENTRY"):
                raise
            raise ReplayBufferError(str(exc).removeprefix("NOENTRY ")) from None
        return text(dead), text(owner), int(deliveries)

    # --- mechanics -------------------------------------------------------------------

    def _own_pending(self, task: str, count: int) -> list[Entry]:
        """This consumer's pending groups from before a restart, oldest first, a page of
        ``count`` per call. Read with XPENDING + XRANGE, not a history XREADGROUP, which
        Redis would count as one more delivery of each: a restart is not charged against
        the groups. A trainer killed from outside (the OOM killer, a preemption, a person)
        before its commit redoes its step on the same groups however often that happens,
        and another consumer that takes them over later does not find them used up."""
        stream = self.keys.groups(task)
        start = self._recover_from.get(task, "-")
        if start == "-":  # shown in XINFO CONSUMERS from its start, as a history read would
            self.client.xgroup_createconsumer(stream, TRAINER, self.consumer)
        pending = self.client.xpending_range(
            stream, TRAINER, min=start, max="+", count=count, consumername=self.consumer
        )
        self._recover_from[task] = (
            f"({text(pending[-1]['message_id'])}" if len(pending) == count else RECOVERED
        )
        if not pending:
            return []
        pipe = self.client.pipeline(transaction=False)
        for p in pending:
            pipe.xrange(stream, p["message_id"], p["message_id"])
        found = pipe.execute()
        entries = []
        for p, rows in zip(pending, found, strict=True):
            entry = Entry(stream, GROUPS, task, text(p["message_id"]), {}, int(p["times_delivered"]))
            if rows:
                entry.fields = rows[0][1]
                entries.append(entry)
            else:  # deleted while pending: nothing left to train on, but say so
                self.dead_letter(entry, "deleted while pending")
        if entries:
            # what XREADGROUP would have done: reset their idle time (no delivery counted),
            # so that no other consumer takes them before this reader's first touch
            lost = set(self.touch(entries))
            entries = [e for e in entries if e.id not in lost]
            log.info(
                "re-read %d groups of %s pending for %s from before its restart: the step is "
                "redone on them. If one of them crashes the trainer, move it with "
                "`rollstream dead-letter %s:%s <id> --reason ...` (ids %s)",
                len(entries), stream, self.consumer, GROUPS, task,
                ", ".join(e.id for e in entries[:8]) + (" ..." if len(entries) > 8 else ""),
            )  # fmt: skip
        return entries
