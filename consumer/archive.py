"""The rollout archive: every group a run trained, and every prompt it did not, in Parquet.

``rollstream archive`` is a consumer of its own, beside the trainer, that never holds it
back. With ``archive.keep`` > 0 the trainer's commit copies each group it trained, with
the train step, into the trained log ``rs:{run}:trained`` in the script that acks and
deletes it (shared/scripts.py ``COMMIT_LOGGED``); the log is capped at ``keep`` entries
(MAXLEN ~), so an archiver that lags or is stopped costs Redis at most that much and
never makes the trainer or producers wait: past the cap the oldest unarchived groups are
trimmed, and the trainer warns. The archiver reads the log through the consumer group
``archive``, and the run's dead letters (``rs:{run}:dead``) and filtered records
(``rs:{run}:filtered``) through groups of the same name, which it only acknowledges.

Files (docs/stream-format.md §13)::

    {dir}/trained/{run}/{task}/step-{train_step:08d}/part-trained-{first id}-{last id}.parquet
    {dir}/untrained/{run}/{task}/{fate}/part-{source}-{first id}-{last id}.parquet

one row per sample, the whole lineage in every row (:data:`SCHEMA`). Exactly once: a
file is written under a hidden temporary name (``.part-…tmp``, which pyarrow, pandas,
DuckDB and ``datasets`` globs of ``*.parquet`` skip), fsynced, renamed into place and its
folder fsynced; only then are its entries acknowledged. Entries read again after a crash
(pending for the archiver) are first looked up in the files of their partition whose id
range holds them, by the ``entry_id`` column: one found there is acknowledged, not
written again. A name is derived from the entries in the file, so nothing depends on a
restart reading the same batches.

This module is the reading side: the sources, their consumer group, what is held until
its files are in place, the acks, the lag. What an entry becomes is consumer/archive_rows.py;
the Parquet files are consumer/archive_files.py. The archiver takes a client and an
ArchivePlan of what it uses; consumer/assembly.py builds both from the settings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from rollstream.consumer.archive_files import PartFiles
from rollstream.consumer.archive_rows import (
    SOURCE_DEAD,
    SOURCE_FILTERED,
    SOURCE_TRAINED,
    TRAINED,
    UNTRAINED,
    Partition,
    Rows,
    entry_rows,
    original_fields,
    undecodable_row,
)
from rollstream.shared import telemetry
from rollstream.shared.errors import DecodeError, FormatError
from rollstream.shared.keys import ARCHIVE, Count, Keys, progress_field
from rollstream.shared.scripts import Scripts
from rollstream.shared.settings import ArchiveSettings
from rollstream.shared.streams import text

__all__ = [
    "ARCHIVER_CONSUMER",
    "EXPIRED_HEADER",
    "LAG_CHECK_S",
    "ArchivePlan",
    "Archiver",
    "Read",
    "Source",
    "archive_run",
]

log = logging.getLogger(__name__)

ARCHIVER_CONSUMER = "archiver"  # stable: a restarted archiver re-reads its own pending entries
LAG_CHECK_S = 5.0
# the header of an expired group's record in the trained log (shared/buffer.py)
EXPIRED_HEADER = ("fate", "source_id", "train_step", "trained_at", "trained_by", "reason")


@dataclass(frozen=True, slots=True)
class ArchivePlan:
    """What the archiver and its loop use (consumer/assembly.py's ``archive_plan`` takes it
    from the settings)."""

    run: str
    tasks: tuple[str, ...]  # the run's tasks: one trained log each
    archive: ArchiveSettings
    dead_maxlen: int  # buffer.dead_maxlen, named when its cap trimmed an entry unarchived
    filtered_maxlen: int  # buffer.filtered_maxlen, likewise
    block_ms: int  # buffer.block_ms: archive_run's reads block at most min(this, 1000 ms)
    progress_s: float  # process.progress_s: archive_run's progress line
    stop_timeout_s: float  # process.stop_timeout_s: archive_run's last writes take half of it


@dataclass(slots=True)
class Read:
    """One entry read from a source: its rows, its partition, and its size."""

    entry_id: str
    source_id: str  # a trained log's entry: the group's id in the groups stream
    partition: tuple[str, ...]
    rows: list[dict[str, Any]]
    size: int
    recovered: bool  # read again after a restart: look for it in the files first


@dataclass
class Source:
    kind: str  # SOURCE_TRAINED, SOURCE_DEAD, SOURCE_FILTERED
    key: str
    file_set: str
    groups: str = ""  # a trained log's: its task's groups stream, where the groups are
    recovering: bool = True
    after: str = "0"  # where the re-read of own pending entries goes on
    held: list[Read] = field(default_factory=list)
    size: int = 0
    since: float = 0.0  # monotonic time of the oldest held entry
    task: str = ""  # a trained log's task
    taken: int = 0  # entries read, for the lag check
    consumed: int | None = None  # the task's consumed count at the last lag check


class Archiver:
    """Reads the run's trained log, dead letters and filtered records through the consumer
    group ``archive`` and writes them to Parquet under ``archive.dir``, exactly once."""

    def __init__(self, client: redis.Redis, plan: ArchivePlan, consumer: str = ARCHIVER_CONSUMER) -> None:
        self.parts = PartFiles(Path(plan.archive.dir), consumer)
        self.pa = self.parts.pa
        self.schema = self.parts.schema
        self.client = client
        self.plan = plan
        self.archive = plan.archive
        self.keys = Keys(plan.run)
        self.consumer = consumer
        self.root = self.parts.root
        self.scripts = Scripts(client)
        self.sources = [
            *(
                Source(SOURCE_TRAINED, self.keys.trained(task), TRAINED, self.keys.groups(task), task=task)
                for task in plan.tasks
            ),
            Source(SOURCE_DEAD, self.keys.dead, UNTRAINED),
            Source(SOURCE_FILTERED, self.keys.filtered, UNTRAINED),
        ]
        self.written = {TRAINED: 0, UNTRAINED: 0}  # rows
        self.files = 0
        self.skipped = 0  # entries found already archived when read again
        self.missing = 0  # entries read again after a restart and found trimmed meanwhile
        self._lag_checked = 0.0
        self._lag_warned = -60.0

    # --- Redis ---------------------------------------------------------------------

    def ensure(self) -> None:
        for source in self.sources:
            try:
                self.client.xgroup_create(source.key, ARCHIVE, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def step(self, block_ms: int) -> int:
        """Read what is there (own pending entries first), write what is due; returns the
        number of entries read."""
        self._check_lag()  # before this read: what waits for the archiver
        read = 0
        for source in self.sources:
            if source.recovering:
                read += self._recover(source)
        streams: dict[Any, Any] = {s.key: ">" for s in self.sources if not s.recovering}
        if streams:
            replies: Any = self.client.xreadgroup(
                ARCHIVE, self.consumer, streams, count=self.archive.read_count, block=block_ms or None
            )
            for key, entries in replies or []:
                source = next(s for s in self.sources if s.key == text(key))
                self._take(source, entries, recovered=False)
                read += len(entries)
        self.flush(due_only=True)
        return read

    def _recover(self, source: Source) -> int:
        """One page of this consumer's pending entries (from before a restart)."""
        replies: Any = self.client.xreadgroup(
            ARCHIVE, self.consumer, {source.key: source.after}, count=self.archive.read_count
        )
        entries = replies[0][1] if replies else []
        if not entries:
            source.recovering = False
            return 0
        source.after = text(entries[-1][0])
        self._take(source, entries, recovered=True)
        if len(entries) < self.archive.read_count:
            source.recovering = False
        return len(entries)

    def _cap(self, kind: str) -> str:
        """The setting, with its value, whose cap trims the stream of ``kind``."""
        if kind == SOURCE_DEAD:
            return f"buffer.dead_maxlen {self.plan.dead_maxlen}"
        if kind == SOURCE_FILTERED:
            return f"buffer.filtered_maxlen {self.plan.filtered_maxlen}"
        return f"archive.keep {self.archive.keep}"

    def _take(self, source: Source, entries: list[Any], *, recovered: bool) -> None:
        """Entries read from ``source``; a trained log's name groups, read here at once from
        the groups stream (where the archiver alone deletes them, but for the log's cap)."""
        groups: list[Any] = []
        source.taken += len(entries)
        if source.kind == SOURCE_TRAINED:
            pipe = self.client.pipeline(transaction=False)
            for _, fields in entries:
                gid = (fields or {}).get(b"source_id", b"0-0")
                pipe.xrange(source.groups, gid, gid)
            groups = [rows[0][1] if rows else None for rows in pipe.execute()]
        for i, (raw_id, fields) in enumerate(entries):
            entry_id = text(raw_id)
            source_id = text((fields or {}).get(b"source_id", b""))
            payload = groups[i] if source.kind == SOURCE_TRAINED else fields
            if fields and fields.get(b"fate") == b"expired":  # the expired group's copy itself
                payload = original_fields(fields, EXPIRED_HEADER)
            if not fields or not payload:  # trimmed by the log's cap before it was read
                self.missing += 1
                log.warning(
                    "archive: entry %s of %s (group %s) was deleted by the cap %s before it was "
                    "archived; acknowledged, not archived",
                    entry_id, source.key, source_id or "?", self._cap(source.kind),
                )  # fmt: skip
                self._ack(source, [Read(entry_id, source_id, (), [], 0, recovered)])
                continue
            try:
                partition, rows = entry_rows(
                    self.plan.run, self.keys, source.kind, source.groups, entry_id, fields, payload
                )
            except (DecodeError, FormatError) as exc:
                partition, rows = self._undecodable(source, entry_id, payload, str(exc))
            size = sum(len(v) for v in payload.values())
            if not source.held:
                source.since = time.monotonic()
            source.held.append(Read(entry_id, source_id, partition, rows, size, recovered))
            source.size += size

    def _ack(self, source: Source, reads: list[Read]) -> None:
        """Acknowledge entries whose files are in place; a trained log's entries and their
        groups are deleted as well (ARCHIVE_ACK), the dead letters and filtered records kept."""
        if not reads:
            return
        ids = [r.entry_id for r in reads]
        if source.kind == SOURCE_TRAINED:
            self.scripts.archive_ack(
                keys=[source.key, source.groups],
                args=[ARCHIVE, len(reads), *ids, *(r.source_id for r in reads)],
            )
        else:
            self.client.xack(source.key, ARCHIVE, *ids)

    # --- rows ----------------------------------------------------------------------

    def _undecodable(
        self, source: Source, entry_id: str, fields: Mapping[bytes, bytes], why: str
    ) -> tuple[Partition, Rows]:
        """An entry that does not decode is kept as one row naming why, in the untrained set."""
        log.warning(
            "archive: entry %s of %s does not decode (%s); archived as a row naming why",
            entry_id,
            source.key,
            why,
        )
        return undecodable_row(self.plan.run, self.keys, source.kind, source.key, entry_id, fields, why)

    # --- files ---------------------------------------------------------------------

    def flush(self, *, due_only: bool = False) -> None:
        limit = self.archive.file_mb * 2**20
        now = time.monotonic()
        for source in self.sources:
            if not source.held:
                continue
            if due_only and source.size < limit and now - source.since < self.archive.flush_s:
                continue
            self._flush(source)

    def _flush(self, source: Source) -> None:
        by_partition: dict[tuple[str, ...], list[Read]] = {}
        for read in source.held:
            by_partition.setdefault(read.partition, []).append(read)
        for partition, reads in by_partition.items():
            folder = self.root.joinpath(*partition)
            recovered = [r.entry_id for r in reads if r.recovered]
            done = self.parts.archived(folder, source.kind, recovered) if recovered else set()
            if done:
                self.skipped += len(done)
                log.info(
                    "archive: %d entries of %s read again after a restart are in %s already: "
                    "not written twice",
                    len(done), source.key, folder,
                )  # fmt: skip
            todo = [r for r in reads if r.entry_id not in done]
            if todo:
                self._write(folder, source.kind, todo, partition[0])
        # every file of these entries is in place: now they are archived
        self._ack(source, source.held)
        source.held, source.size = [], 0

    def _write(self, folder: Path, kind: str, reads: list[Read], file_set: str) -> None:
        rows = [row for r in reads for row in r.rows]
        path = self.parts.write(folder, kind, [r.entry_id for r in reads], rows)
        self.files += 1
        self.written[file_set] += len(rows)
        telemetry.archive_written(file_set, len(rows))
        log.debug("archive: wrote %s (%d rows)", path, len(rows))

    def check_dir(self) -> None:
        """SettingsError naming archive.dir unless files can be written there."""
        self.parts.check_dir()

    def clean(self) -> int:
        """Remove this consumer's temporary files left by a crash (never visible: hidden)."""
        return self.parts.clean()

    # --- lag -----------------------------------------------------------------------

    def _check_lag(self) -> None:
        """The unarchived groups of the trained logs, as a metric, and a warning once they
        near archive.keep, where the trainer deletes the oldest unarchived."""
        now = time.monotonic()
        if now - self._lag_checked < LAG_CHECK_S:
            return
        self._lag_checked = now
        logs = [s for s in self.sources if s.kind == SOURCE_TRAINED]
        pipe = self.client.pipeline(transaction=False)
        for source in logs:
            pipe.xlen(source.key)
            pipe.hget(self.keys.progress, progress_field(source.task, Count.CONSUMED))
        replies = pipe.execute()
        lengths = [int(n) for n in replies[::2]]
        telemetry.archive_lag(sum(lengths))
        keep = self.archive.keep
        for source, length, raw in zip(logs, lengths, replies[1::2], strict=True):
            consumed = int(raw or 0)
            if source.consumed is not None and consumed > source.consumed and not source.taken and not length:
                log.warning(
                    "archive: the trainer committed %d groups of task %s that did not come to the trained "
                    "log %s: it runs without an archive (archive.keep 0); set ROLLSTREAM_ARCHIVE__KEEP for "
                    "the trainer too",
                    consumed - source.consumed, source.task, source.key,
                )  # fmt: skip
            source.consumed, source.taken = consumed, 0
            if keep and length >= self.archive.warn_at * keep and now - self._lag_warned >= 60:
                self._lag_warned = now
                log.warning(
                    "archive: %d trained groups in %s are not archived yet, of archive.keep %d: beyond "
                    "it the trainer deletes the oldest, never archived (a larger archive.keep, a faster "
                    "disk, a larger archive.read_count)",
                    length, source.key, keep,
                )  # fmt: skip


def archive_run(
    client: redis.Redis,
    plan: ArchivePlan,
    stop: threading.Event,
    consumer: str = ARCHIVER_CONSUMER,
    on_start: Callable[[Archiver], None] | None = None,
) -> Archiver:
    """The archiver's loop until ``stop``; then what the sources hold is read and written
    (the run's last step, when the run stopped), and the files closed."""
    archiver = Archiver(client, plan, consumer)
    archiver.check_dir()
    if on_start is not None:
        on_start(archiver)
    removed = archiver.clean()
    if removed:
        log.info("archive: removed %d temporary files of a write that did not finish", removed)
    archiver.ensure()
    block_ms = min(plan.block_ms, 1000)
    shown = time.monotonic()
    while not stop.is_set():
        archiver.step(block_ms)
        if time.monotonic() - shown >= plan.progress_s:
            shown = time.monotonic()
            log.info(
                "archive: %d trained rows, %d untrained rows in %d files under %s",
                archiver.written[TRAINED], archiver.written[UNTRAINED], archiver.files, archiver.root,
            )  # fmt: skip
    # what the sources hold now is read and written before the exit (the run's last step,
    # when the run stopped), for at most half of process.stop_timeout_s
    deadline = time.monotonic() + plan.stop_timeout_s / 2
    while archiver.step(0) and time.monotonic() < deadline:
        pass
    archiver.flush()
    log.info(
        "archive: stopped; %d trained rows, %d untrained rows in %d files under %s (%d found written "
        "already, %d trimmed before they were archived)",
        archiver.written[TRAINED], archiver.written[UNTRAINED], archiver.files, archiver.root,
        archiver.skipped, archiver.missing,
    )  # fmt: skip
    return archiver
