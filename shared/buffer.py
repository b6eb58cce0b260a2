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

The buffer takes the sections of the settings it uses, not the whole tree
(shared/runconfig.py's open_buffer picks them out of it). Its other parts live
beside it: feeding (buffer_feed.py), the entries this consumer holds, reclaims and
dead-letters (buffer_pending.py), the archive's trained log (buffer_trained_log.py)
and what it hands out (buffer_types.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis

from rollstream.shared import codec
from rollstream.shared.buffer_feed import Feeding
from rollstream.shared.buffer_pending import PendingEntries
from rollstream.shared.buffer_trained_log import TrainedLog
from rollstream.shared.buffer_types import (
    DROPPED_COUNT,
    Batch,
    BatchItem,
    Claim,
    default_consumer_name,
    eval_batch,
    refused_format,
)
from rollstream.shared.errors import CorruptValueError, DecodeError, FormatError, ReplayBufferError
from rollstream.shared.keys import (
    ABORTED,
    EVALS,
    EXPIRED,
    GROUPS,
    POOLS,
    PRODUCERS,
    TRAINER,
    UNTRAINABLE,
    Count,
    Keys,
    progress_field,
)
from rollstream.shared.records import Group, Sample, Status
from rollstream.shared.scripts import PRIOR_ATTEMPTS
from rollstream.shared.settings import ArchiveSettings, BufferSettings
from rollstream.shared.streams import Entry, Settle, counter_expected, pairs, stored_float, stored_int, text

__all__ = [
    "RECOVERED",
    "ReplayBuffer",
]

log = logging.getLogger(__name__)
RECOVERED = "done"
# The counters a producer's settles touch (complete, eval result, hand back, filter, dead
# letter), checked before it claims anything
SETTLE_COUNTERS = (
    Count.COMPLETED, Count.PRODUCED_SAMPLES, Count.PRODUCED_TOKENS, Count.REWARD_COUNT, Count.REWARD_SUM,
    Count.EVAL_COMPLETED, Count.ABORTED, Count.FILTERED, Count.DEAD,
)  # fmt: skip


class ReplayBuffer(Feeding, PendingEntries):
    """Stream operations of one run, for one consumer name.

    A producer process uses one name per process (a dead one's claims are
    reclaimed by the others); a trainer uses a stable name, so that after a
    restart it re-reads its own pending groups first.

    ``archive`` with keep > 0 gives commits and expiries a trained log for the
    archiver; its expiry records name ``stale_threshold`` (the rollout's), which it
    then needs.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        buffer: BufferSettings,
        consumer: str | None = None,
        *,
        archive: ArchiveSettings | None = None,
        stale_threshold: int | None = None,
    ) -> None:
        super().__init__(client, keys, buffer, consumer or default_consumer_name("worker"))
        self.trained_log = TrainedLog(keys, archive, stale_threshold)
        self._recover_from: dict[str, str] = {}  # task -> last own pending id re-read

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
            claims += self._claims(_prior(self.streams.read([EVALS], task, count - len(claims))))
        if len(claims) < count:
            claims += self._claims(_prior(self._claim_new(task, count - len(claims), kinds, limit)))
        if not claims and block_ms > 0:
            if limit is None:
                # Wake on whichever pool gets work first, take it, then fill up in pool order.
                claims = self._claims(_prior(self.streams.read(kinds, task, 1, block_ms=block_ms)))
            elif self.admitted(task) < limit:
                # Wait for new work without taking it, then claim through the bound check.
                self.client.xread({self.keys.stream(k, task): "$" for k in kinds}, count=1, block=block_ms)
                claims = self._claims(_prior(self._claim_new(task, 1, kinds, limit)))
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

    def check_settle_counters(self, task: str) -> None:
        """Raise CorruptValueError, naming the repair, when a progress counter that a
        producer's settle of the task would touch is not a number: checked before claiming
        (at a producer's start), so that no valid prompt is claimed, generated and charged
        a delivery for a settle that cannot land (the run's fault, not the prompt's)."""
        names = [progress_field(task, c) for c in SETTLE_COUNTERS]
        key = self.keys.progress
        for name, value in zip(names, self.client.hmget(key, names), strict=True):
            if name.endswith(f":{Count.REWARD_SUM.value}"):
                stored_float(value, key, name, counter_expected(key, name))
            else:
                stored_int(value, key, name, counter_expected(key, name))

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
        """Work of the task claimed by producers and not yet settled: the producers group's
        pending total from XINFO GROUPS, O(groups of the stream); XPENDING's summary also
        lists every consumer, O(consumers), on every look of every producer (issue 26)."""
        streams = [self.keys.stream(kind, task) for kind in POOLS]
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        total = 0
        for stream, groups in zip(streams, pipe.execute(raise_on_error=False), strict=True):
            found = None
            if not isinstance(groups, Exception):
                found = next((g["pending"] for g in groups if text(g["name"]) == PRODUCERS), None)
            if found is None:  # no such stream or group: the error XPENDING always gave
                found = self.client.xpending(stream, PRODUCERS)["pending"]
            total += int(found)
        return total

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
        except CorruptValueError:
            # a counter the settle touches is not a number: the run's fault, not the claims',
            # so none is charged the delivery it used (the restart after the repair reclaims
            # them at the count they had)
            self.uncharge(claim.entry for claim, _ in done)
            raise
        finally:  # settled, fenced or failed: this process holds none of them any more
            self.release(claim.entry for claim, _ in done)
        return results

    def _completion(self, claim: Claim, group: Group) -> Settle:
        status = group.status or Status.COMPLETED
        if status is not Status.COMPLETED:
            raise ReplayBufferError(f"only a completed group enters the buffer, not {status.value}")
        fields = codec.encode_group_parts(group, summary=self.buffer_settings.summary)
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
        fields = codec.encode_group(group, summary=self.buffer_settings.summary)
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
            held = set(self._held_ids(self.keys.groups(task)))
            # a group this reader holds already, delivered again as new: Redis lost the read
            # that gave it (a crash or failover, shared/rewind.py); it is in a batch already
            entries += [
                e
                for e in self.streams.read([GROUPS], task, count - len(entries), block_ms=block_ms)
                if e.id not in held
            ]
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
        keep = self.trained_log.keep
        try:
            if keep > 0:
                args[3:3] = [str(train_step), repr(time.time()), str(keep)]
                foreign, length, trimmed = self.scripts.commit_logged(
                    keys=[*keys, self.keys.trained(batch.task)], args=args
                )
                self.trained_log.lag(batch.task, int(length), int(trimmed))
            else:
                foreign = self.scripts.commit(keys=keys, args=args)
        finally:
            self.release(item.entry for item in batch.items)
        return [text(i) for i in foreign]

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
        fields = codec.encode_group(entry, summary=self.buffer_settings.summary)
        log = self.trained_log.expired_record(item, train_step, self.consumer)
        return self._settle(item.entry, self.keys.expired(group.task), fields, Count.EXPIRED, log=log)

    def discard(self, item: BatchItem, status: Status = Status.EXPIRED, train_step: int = -1) -> bool:
        """Ack + delete a group without re-queueing it (expired groups when tail batch is -1,
        late results of a finished coordinator batch as aborted)."""
        log = (
            self.trained_log.expired_record(item, train_step, self.consumer)
            if status == Status.EXPIRED
            else None
        )
        return self._settle(item.entry, None, None, DROPPED_COUNT[status], log=log) is not None

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


def _prior(entries: list[Entry]) -> list[Entry]:
    """Fresh reads of pool entries, their delivery counted with the deliveries an entry
    had before it was handed back (its ``attempts`` field, scripts.HAND_BACK)."""
    for entry in entries:
        prior = entry.fields.get(PRIOR_ATTEMPTS.encode())
        if prior is not None and prior.isdigit():
            entry.deliveries += int(prior)
    return entries
