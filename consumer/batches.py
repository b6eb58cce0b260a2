"""Train batches for the trainer: per-task quotas, staleness expiry, commit after the
step.

For train step t a group's staleness is ``t - min(response_versions) - 1``; with
``stale_threshold = (max_staleness + 1) * sync_weights_interval`` a group expires
when its staleness reaches the threshold. tail_batch_trigger_size -1 drops expired
groups; 0 and N > 0 send their prompts to the expired pool (the producers decide
when to re-roll them: at once, or once N wait there).

A batch is acknowledged (and deleted) only by ``commit()``, after the optimizer
step; a trainer that dies before that gets the same groups again after a restart.

With ``redis.wait_replicas`` N > 0 a batch is handed out only once N replicas hold the
reads that made it (a failover can then not forget that this trainer holds them, and
deliver them again to be trained twice), and ``commit()`` returns only once N replicas
hold the commit (consumer/replication.py).

A reader takes its parts (the replay buffer, the run's control) and a ReaderPlan of the
numbers it uses; consumer/assembly.py builds them from the settings (``create_reader``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from rollstream.consumer.replication import wait_for_replicas
from rollstream.shared import rewind
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import Batch, BatchItem
from rollstream.shared.errors import BatchTimeout
from rollstream.shared.events import RunControl
from rollstream.shared.keys import GROUPS, TRAINER, Count, progress_field
from rollstream.shared.records import Group
from rollstream.shared.settings import RedisSettings
from rollstream.shared.settings_errors import redact_url
from rollstream.shared.streams import Entry, text

POLL_MS = 100
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReaderPlan:
    """What a BatchReader reads its batches by (consumer/assembly.py's ``reader_plan``
    takes it from the settings)."""

    quota: Mapping[str, int]  # the groups of each task in one train step
    batch_size: int  # rollout.batch_size: a full batch, what min_wait_num defaults to
    stale_threshold: int  # rollout.stale_threshold: a group this stale expires
    drop_expired: bool  # rollout.tail_batch_trigger_size -1: expired groups dropped, not re-rolled
    claim_idle_ms: int  # buffer.claim_idle_ms: the keeper touches held groups every third of it
    redis: RedisSettings  # its wait_replicas: reads and commits wait for the replicas


@dataclass(slots=True)
class TrainBatch:
    train_step: int
    batches: dict[str, Batch]  # per task
    staleness: Counter[int] = field(default_factory=Counter)
    expired: int = 0
    wait_s: float = 0.0
    _buffer: ReplayBuffer | None = None
    _redis: RedisSettings | None = None  # with wait_replicas: commit waits for the replicas
    _reader: BatchReader | None = None  # the reader's record of its commits (a rewound run)
    _replays: int = 0  # the reader's rewinds replayed when this batch was read

    @classmethod
    def of_groups(cls, step: int, groups: list[Group]) -> TrainBatch:
        """Groups made outside Redis as a batch of train step ``step``, by their tasks, with
        nothing to commit: what a plain in-process loop hands the same loss."""
        tasks: dict[str, list[BatchItem]] = {}
        for group in groups:
            tasks.setdefault(group.task, []).append(
                BatchItem(Entry("", "groups", group.task, "0-0", {}), group)
            )
        return cls(step, {task: Batch(task, items) for task, items in tasks.items()})

    @property
    def groups(self) -> list[Group]:
        return [g for batch in self.batches.values() for g in batch.groups]

    def __len__(self) -> int:
        return sum(len(b) for b in self.batches.values())

    def _lost_reads(self, task: str, ids: list[str]) -> list[str]:
        """After a rewind: the groups of this batch that no consumer holds any more were
        read before Redis lost the reads; settled here as the commit would have (not with
        an archive, whose trained log the commit writes: left to the reclaim, and said)."""
        assert self._buffer is not None
        if self._buffer.trained_log.keep > 0:
            log.warning("train step %d: %d groups whose reads Redis lost stay in the stream (archive on)",
                        self.train_step, len(ids))  # fmt: skip
            return ids
        field_ = progress_field(task, Count.CONSUMED)
        settled = rewind.settle_lost_reads(self._buffer.client, self._buffer.keys, task, field_, ids)
        if settled:
            log.warning("train step %d: %d groups whose reads Redis lost were committed",
                        self.train_step, settled)  # fmt: skip
        return ids if settled < len(ids) else []

    def commit(self) -> list[str]:
        """Ack + delete the groups once the train step has succeeded, then record the step
        as the run's train_step (the last committed one); returns ids that another
        trainer consumer had taken over (and so were not committed here)."""
        assert self._buffer is not None
        if self._reader is not None:
            self._reader.check_rewind()  # never commit on a state behind this trainer's commits
        foreign: list[str] = []
        for batch in self.batches.values():
            lost = self._buffer.commit(batch, self.train_step)
            if lost and self._reader is not None and self._reader.commits.replays > self._replays:
                lost = self._lost_reads(batch.task, lost)
            foreign += lost
        who, url = _who(self._buffer, self._redis)
        RunControl(self._buffer.client, self._buffer.keys).advance_train_step(self.train_step, who, url)
        if self._reader is not None:
            owned = set(foreign)
            self._reader.commits.add(
                self.train_step,
                {
                    t: [i.entry.id for i in b.items if i.entry.id not in owned]
                    for t, b in self.batches.items()
                },
            )
        if self._redis is not None:
            wait_for_replicas(
                self._buffer.client, self._buffer.keys, self._redis,
                f"the commit of train step {self.train_step}", committed_step=self.train_step,
            )  # fmt: skip
        return foreign


class BatchReader:
    """The trainer's side of the replay buffer. One per trainer process, with a stable
    consumer name, the buffer's (a restarted trainer re-reads its own uncommitted groups).
    Built from the settings by ``rollstream.consumer.create_reader``."""

    def __init__(self, buffer: ReplayBuffer, control: RunControl, plan: ReaderPlan) -> None:
        self.buffer = buffer
        self.control = control
        self.plan = plan
        self.quota = dict(plan.quota)
        self._carry: dict[str, list[BatchItem]] = {}
        self._keeper: threading.Thread | None = None
        self._keeper_lock = threading.Lock()
        self._closed = threading.Event()
        self.commits = rewind.Commits()  # its last commits: replayed when Redis lost them

    def check_rewind(self) -> None:
        """RunRewound when Redis's train_step is behind a step this trainer committed and
        the lost commits cannot be replayed exactly (shared/rewind.py)."""
        buffer = self.buffer
        who, url = _who(buffer, self.plan.redis)

        def replay(commit: rewind.Commit) -> None:
            for task, ids in commit.ids.items():
                items = [BatchItem(Entry(buffer.keys.groups(task), GROUPS, task, i, {}), None) for i in ids]  # type: ignore[arg-type]
                buffer.commit(Batch(task, items), commit.step)

        rewind.check(buffer.client, buffer.keys, url, who, buffer.consumer, self.commits, replay)

    def keep_fresh(self) -> None:
        """Keep the groups this reader holds (read, not yet committed, expired or
        dead-lettered) from being reclaimed by another trainer-group consumer while a
        batch fills or a train step runs longer than claim_idle_ms: a thread touches
        them every claim_idle_ms / 3, as producers touch their claims (no command while
        nothing is held). get_batch starts it; close() stops it."""
        with self._keeper_lock:
            if self._keeper is not None and self._keeper.is_alive():
                return
            self._closed.clear()
            self._keeper = threading.Thread(
                target=self._touch_held, name="rollstream-keep-fresh", daemon=True
            )
            self._keeper.start()

    def _touch_held(self) -> None:
        interval_s = self.plan.claim_idle_ms / 3000
        while not self._closed.wait(interval_s):
            held = self.buffer.held(GROUPS)
            if not held:
                continue
            try:
                lost = set(self.buffer.touch(held))
                lost &= {e.id for e in self.buffer.held(GROUPS)}  # not those committed meanwhile
            except redis.RedisError as exc:  # an outage past redis.outage_limit_s: try again
                log.warning("could not refresh the %d groups this trainer holds: %s", len(held), exc)
                continue
            except Exception:  # said, and tried again: a keeper that died would say nothing
                log.exception("could not refresh the %d groups this trainer holds", len(held))
                continue
            if lost:
                taken = self._held_elsewhere([e for e in held if e.id in lost])
                if taken:
                    log.warning(
                        "%d groups read by %s were taken over by another trainer consumer: %s",
                        len(taken), self.buffer.consumer, ", ".join(sorted(taken)[:8]),
                    )  # fmt: skip
                self.buffer.release(e for e in held if e.id in lost)

    def _held_elsewhere(self, entries: list[Entry]) -> list[str]:
        """The ids of ``entries`` that another trainer-group consumer holds now. The rest
        are acked: most often by a commit of this trainer that ended between the keeper's
        look at what it holds and its touch (the commit forgets them a moment later)."""
        taken = []
        for entry in entries:
            try:
                pending = self.buffer.client.xpending_range(entry.stream, TRAINER, entry.id, entry.id, 1)
            except redis.RedisError:
                taken.append(entry.id)  # cannot tell: said, as before
                continue
            if pending and text(pending[0]["consumer"]) != self.buffer.consumer:
                taken.append(entry.id)
        return taken

    def close(self) -> None:
        """Stop refreshing the held groups (they become reclaimable after claim_idle_ms)."""
        self._closed.set()
        keeper = self._keeper
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(timeout=5.0)

    def get_batch(
        self, train_step: int, timeout_s: float | None = None, min_wait_num: int | None = None
    ) -> TrainBatch:
        """The groups of train step ``train_step``: each task's quota of fresh-enough
        groups. Without a timeout it waits until the batch is full; with one it returns
        what it has at the deadline if that is at least ``min_wait_num`` groups, and
        raises BatchTimeout naming the counts otherwise."""
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        batches = {task: Batch(task) for task in self.quota}
        self.check_rewind()
        result = TrainBatch(
            train_step, batches, _buffer=self.buffer, _redis=self.plan.redis, _reader=self,
            _replays=self.commits.replays,
        )  # fmt: skip
        threshold = self.plan.stale_threshold
        self.keep_fresh()

        def take(task: str, item: BatchItem) -> None:
            staleness = train_step - item.group.model_step - 1
            if staleness >= threshold:
                self._expire(item, train_step)
                result.expired += 1
            else:
                result.batches[task].items.append(item)
                result.staleness[staleness] += 1

        for task, held in self._carry.items():  # read by a call that timed out: still ours
            for item in held:
                take(task, item)
        self._carry = {}
        while True:
            missing = {task: q - len(result.batches[task]) for task, q in self.quota.items()}
            if all(m <= 0 for m in missing.values()):
                if self._forgotten(result, train_step):
                    continue  # read again what a failover made Redis forget
                break
            remaining_ms = POLL_MS if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000)
            got_any = False
            for task, count in missing.items():
                if count <= 0:
                    continue
                block = min(POLL_MS, remaining_ms) if not got_any else 0
                for item in self.buffer.read_batch(task, count, block_ms=block).items:
                    got_any = True
                    take(task, item)
                if not got_any:
                    # waiting: claims of producers that died with no producer left to
                    # reclaim them go back to their pools (at most twice per claim_idle_ms)
                    self.buffer.hand_back_stranded(task)
            if deadline is not None and time.monotonic() >= deadline:
                wanted = self.plan.batch_size if min_wait_num is None else min_wait_num
                if len(result) >= wanted and not self._forgotten(result, train_step):
                    break
                got = ", ".join(f"{t} {len(b)}/{self.quota[t]}" for t, b in result.batches.items())
                # what was read stays pending for this trainer: the next call starts from it
                self._carry = {t: b.items for t, b in result.batches.items() if b.items}
                raise BatchTimeout(
                    f"train step {train_step}: {len(result)} groups after {timeout_s} s, "
                    f"fewer than min_wait_num {wanted} ({got}; {result.expired} expired)"
                )
        for batch in result.batches.values():  # the stalest first, as the bound expects them used
            batch.items.sort(key=lambda item: item.group.model_step)
        result.wait_s = time.monotonic() - started
        return result

    def _forgotten(self, result: TrainBatch, train_step: int) -> bool:
        """With redis.wait_replicas: make the reads of the batch durable on the replicas,
        then take out of the batch the groups that Redis no longer has pending for this
        trainer (a failover between a read and its replication forgot the read: another
        consumer would be given them again). True when some were taken out."""
        if self.plan.redis.wait_replicas <= 0 or not len(result):
            return False
        buffer = self.buffer
        wait_for_replicas(
            buffer.client, buffer.keys, self.plan.redis, f"the reads of train step {train_step}"
        )
        forgotten = 0
        for task, batch in result.batches.items():
            if not batch.items:
                continue
            pipe = buffer.client.pipeline(transaction=False)
            for item in batch.items:
                pipe.xpending_range(
                    buffer.keys.groups(task), TRAINER, min=item.entry.id, max=item.entry.id, count=1,
                    consumername=buffer.consumer,
                )  # fmt: skip
            pending = pipe.execute()
            gone = [item for item, mine in zip(batch.items, pending, strict=True) if not mine]
            if gone:
                forgotten += len(gone)
                buffer.release(item.entry for item in gone)
                result.staleness.subtract(train_step - item.group.model_step - 1 for item in gone)
                batch.items = [item for item, mine in zip(batch.items, pending, strict=True) if mine]
                log.warning(
                    "train step %d: Redis no longer has %d groups of %s pending for %s (a failover "
                    "lost their read): left out, read again (ids %s)", train_step, len(gone),
                    buffer.keys.groups(task), buffer.consumer, ", ".join(i.entry.id for i in gone[:8]),
                )  # fmt: skip
        return forgotten > 0

    def _expire(self, item: BatchItem, train_step: int = -1) -> None:
        if self.plan.drop_expired:
            self.buffer.discard(item, train_step=train_step)
        else:
            self.buffer.expire(item, train_step=train_step)


def _who(buffer: ReplayBuffer, settings: RedisSettings | None) -> tuple[str, str]:
    """(trainer <consumer>, the Redis URL without its password): a rewind's message."""
    url = redact_url(settings.url) if settings is not None else "Redis"
    return f"trainer {buffer.consumer}", url
