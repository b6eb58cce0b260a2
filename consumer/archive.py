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
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from rollstream.shared import codec, telemetry
from rollstream.shared.errors import DecodeError, FormatError, SettingsError
from rollstream.shared.keys import ARCHIVE, Count, Keys, progress_field
from rollstream.shared.records import Group, Prompt
from rollstream.shared.scripts import DEAD_HEADER, Scripts
from rollstream.shared.settings import Settings
from rollstream.shared.streams import text

log = logging.getLogger(__name__)

ARCHIVER_CONSUMER = "archiver"  # stable: a restarted archiver re-reads its own pending entries
TRAINED, UNTRAINED = "trained", "untrained"  # the two file sets
# sources: the stream kind in file names, and whether the archiver deletes what it acked
SOURCE_TRAINED, SOURCE_DEAD, SOURCE_FILTERED = "trained", "dead", "filtered"
FILE_RE = re.compile(r"^part-([a-z]+)-(\d+-\d+)-(\d+-\d+)\.parquet$")
LAG_CHECK_S = 5.0
# the header of an expired group's record in the trained log (shared/buffer.py)
EXPIRED_HEADER = ("fate", "source_id", "train_step", "trained_at", "trained_by", "reason")


def _pa() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet  # pa.parquet below
    except ImportError:
        raise SettingsError(
            "the archive writes Parquet with pyarrow, which is not installed: "
            "pip install 'rollstream[archive]'"
        ) from None
    return pa


def schema() -> Any:
    """The columns of both file sets, one row per sample (a prompt without samples, as a
    dead-lettered prompt entry or a filtered record, is one row with the sample columns
    null). JSON columns are text: ``prompt_messages``, ``prompt_meta``, ``reward_details``,
    ``turns``, ``timings``."""
    pa = _pa()
    ts = pa.timestamp("us", tz="UTC")
    return pa.schema(
        [
            ("run", pa.string()),
            ("task", pa.string()),
            ("uid", pa.string()),
            ("group_id", pa.string()),
            ("sample_index", pa.int32()),
            ("n", pa.int32()),
            ("fate", pa.string()),  # trained, expired, dead, filtered
            ("reason", pa.string()),  # why it was not trained; null when trained
            ("prompt", pa.string()),  # the prompt's text; a chat prompt's last user message
            ("prompt_messages", pa.string()),  # a chat prompt's messages (JSON), else null
            ("prompt_ids", pa.list_(pa.int32())),
            ("prompt_meta", pa.string()),  # ground truth and what the judge used (JSON)
            ("response", pa.string()),
            ("response_ids", pa.list_(pa.int32())),
            ("logprobs", pa.list_(pa.float32())),
            ("versions", pa.list_(pa.int32())),  # the model step of each response token
            ("loss_mask", pa.list_(pa.uint8())),  # agent trajectories: 1 on the model's tokens
            ("turns", pa.string()),  # agent trajectories: who said which span (JSON)
            ("agent_status", pa.string()),
            ("finish_reason", pa.string()),
            ("sample_status", pa.string()),
            ("reward", pa.float64()),  # reward.score
            ("reward_details", pa.string()),  # the judge's whole reward object (JSON)
            ("response_tokens", pa.int32()),
            ("producer", pa.string()),
            ("attempt", pa.int32()),
            ("model_step", pa.int32()),  # the oldest token version of the group
            ("train_step", pa.int32()),  # the step that trained it; null when not trained
            ("staleness", pa.int32()),  # train_step - model_step - 1
            ("created_at", ts),
            ("trained_at", ts),
            ("archived_at", ts),
            ("timings", pa.string()),
            ("format", pa.string()),  # the entry's stream-format version
            ("trained_by", pa.string()),  # the trainer consumer that committed it
            ("source", pa.string()),  # the stream the group (or prompt) was in
            ("source_id", pa.string()),  # its id there
            ("entry_id", pa.string()),  # the id of the entry the archiver read: unique per file set
        ]
    )


# --- rows ------------------------------------------------------------------------------


def _json(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _prompt_columns(prompt: Prompt) -> dict[str, Any]:
    text_: str | None
    messages: str | None
    if isinstance(prompt.prompt, str):
        text_, messages = prompt.prompt, None
    else:
        users = [m.get("content") for m in prompt.prompt if m.get("role") == "user"]
        last = users[-1] if users else None
        text_ = last if isinstance(last, str) else _json(last)
        messages = _json(prompt.prompt)
    return {
        "uid": prompt.uid,
        "prompt": text_,
        "prompt_messages": messages,
        "prompt_ids": prompt.prompt_ids,
        "prompt_meta": _json(prompt.meta),
    }


def group_rows(run: str, group: Group, common: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per sample of ``group``, with ``common`` (fate, reason, steps, ids, times)."""
    train_step = common.get("train_step")
    base = {
        "run": run,
        "task": group.task,
        "group_id": group.group_id,
        "n": group.n,
        **_prompt_columns(group.prompt),
        "producer": group.producer,
        "attempt": group.attempt,
        "model_step": group.model_step,
        "staleness": None if train_step is None else train_step - group.model_step - 1,
        "created_at": group.created_at,
        "timings": _json(group.timings),
        **common,
    }
    if not group.samples:
        return [base]
    rows = []
    for i, s in enumerate(group.samples):
        rows.append(
            {
                **base,
                "sample_index": i,
                "prompt_ids": s.prompt_ids,
                "response": s.text,
                "response_ids": s.response_ids,
                "logprobs": s.logprobs,
                "versions": s.response_versions,
                "loss_mask": s.loss_mask,
                "turns": None if s.turns is None else _json([codec._turn_to_dict(t) for t in s.turns]),
                "agent_status": s.agent_status,
                "finish_reason": s.finish_reason,
                "sample_status": str(s.status),
                "reward": s.score,
                "reward_details": _json(s.reward),
                "response_tokens": len(s.response_ids),
            }
        )
    return rows


def _float(value: bytes | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:
        return None


def _int(value: bytes | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _original(fields: Mapping[bytes, bytes], header: Iterable[str]) -> dict[bytes, bytes]:
    """An entry's own fields under a header of a copy (a dead letter's, a trained log's):
    the header's fields left out and ``orig.NAME`` named NAME again."""
    names = {h.encode() for h in header}
    out = {}
    for name, value in fields.items():
        if name in names:
            continue
        out[name[5:] if name.startswith(b"orig.") else name] = value
    return out


def _task_of(source: str, keys: Keys) -> str:
    parsed = keys.parse_stream(source)
    return parsed[1] if parsed else ""


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

    def __init__(self, client: redis.Redis, settings: Settings, consumer: str = ARCHIVER_CONSUMER) -> None:
        self.pa = _pa()
        self.schema = schema()
        self.client = client
        self.settings = settings
        self.archive = settings.archive
        self.keys = Keys(settings.run)
        self.consumer = consumer
        self.root = Path(self.archive.dir)
        self.scripts = Scripts(client)
        self.sources = [
            *(
                Source(
                    SOURCE_TRAINED, self.keys.trained(t.name), TRAINED, self.keys.groups(t.name), task=t.name
                )
                for t in settings.tasks
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
                payload = _original(fields, EXPIRED_HEADER)
            if not fields or not payload:  # trimmed by the log's cap before it was read
                self.missing += 1
                log.warning(
                    "archive: entry %s of %s (group %s) was deleted by the cap archive.keep %d before "
                    "it was archived; acknowledged, not archived",
                    entry_id, source.key, source_id or "?", self.archive.keep,
                )  # fmt: skip
                self._ack(source, [Read(entry_id, source_id, (), [], 0, recovered)])
                continue
            try:
                partition, rows = self._rows(source, entry_id, fields, payload)
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

    def _rows(
        self, source: Source, entry_id: str, fields: Mapping[bytes, bytes], payload: Mapping[bytes, bytes]
    ) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
        """The rows of one entry: ``fields`` the entry's, ``payload`` the group's (the same
        but for a trained log's entry, whose group is in the groups stream)."""
        run = self.settings.run
        common: dict[str, Any] = {"entry_id": entry_id, "archived_at": time.time()}
        if source.kind == SOURCE_TRAINED and fields.get(b"fate") == b"expired":
            group = codec.decode_group(payload)
            step = _int(fields.get(b"train_step"))
            common.update(
                fate="expired",
                reason=text(fields.get(b"reason", b"expired")),
                train_step=step if step is not None and step >= 0 else None,
                trained_at=_float(fields.get(b"trained_at")),
                trained_by=text(fields.get(b"trained_by", b"")),
                source=source.groups,
                source_id=text(fields.get(b"source_id", b"")),
                format=text(payload.get(b"format", b"1.0")),
            )
            return (UNTRAINED, run, group.task, "expired"), group_rows(run, group, common)
        if source.kind == SOURCE_TRAINED:
            group = codec.decode_group(payload)
            step = _int(fields.get(b"train_step"))
            common.update(
                fate="trained",
                train_step=step if step is not None and step >= 0 else None,
                trained_at=_float(fields.get(b"trained_at")),
                trained_by=text(fields.get(b"trained_by", b"")),
                source=source.groups,
                source_id=text(fields.get(b"source_id", b"")),
                format=text(payload.get(b"format", b"1.0")),
            )
            folder = f"step-{step:08d}" if step is not None and step >= 0 else "step-none"
            return (TRAINED, run, group.task, folder), group_rows(run, group, common)
        if source.kind == SOURCE_DEAD:
            own = _original(fields, DEAD_HEADER)
            origin = text(fields.get(b"source", b""))
            common.update(
                fate="dead",
                reason=f"dead letter: {text(fields.get(b'reason', b''))} "
                f"(after {text(fields.get(b'attempts', b'0'))} deliveries)",
                source=origin,
                source_id=text(fields.get(b"source_id", b"")),
                format=text(own.get(b"format", b"1.0")),
            )
            task = _task_of(origin, self.keys) or text(own.get(b"task", b"")) or "_unknown"
            partition = (UNTRAINED, run, task, "dead")
            if codec.is_group_entry(own):
                return partition, group_rows(run, codec.decode_group(own), common)
            prompt = codec.decode_prompt(own)
            row = {"run": run, "task": prompt.task, "group_id": prompt.group_id, **_prompt_columns(prompt)}
            return partition, [{**row, **common}]
        # filtered: a small record, no samples
        task = text(fields.get(b"task", b"")) or "_unknown"
        reward_mean = text(fields.get(b"reward_mean", b""))
        common.update(
            fate="filtered",
            reason=f"filtered: rejected by the producers' is_valid (reward mean {reward_mean or 'none'})",
            source=text(fields.get(b"source", b"")),
            source_id=text(fields.get(b"source_id", b"")),
            format=text(fields.get(b"format", b"1.0")),
        )
        row = {
            "run": run,
            "task": task,
            "uid": text(fields.get(b"uid", b"")),
            "group_id": text(fields.get(b"group_id", b"")),
            "n": _int(fields.get(b"n")),
            "producer": text(fields.get(b"producer", b"")),
            "attempt": _int(fields.get(b"attempt")),
            **common,
        }
        return (UNTRAINED, run, task, "filtered"), [row]

    def _undecodable(
        self, source: Source, entry_id: str, fields: Mapping[bytes, bytes], why: str
    ) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
        """An entry that does not decode is kept as one row naming why, in the untrained set."""
        log.warning(
            "archive: entry %s of %s does not decode (%s); archived as a row naming why",
            entry_id,
            source.key,
            why,
        )
        run = self.settings.run
        task = (
            text(fields.get(b"task", b""))
            or _task_of(text(fields.get(b"source", b"")), self.keys)
            or "_unknown"
        )
        row = {
            "run": run,
            "task": task,
            "group_id": text(fields.get(b"group_id", b"")) or None,
            "fate": source.kind if source.kind != SOURCE_TRAINED else "trained",
            "reason": f"undecodable: {why}",
            "source": text(fields.get(b"source", b"")) or source.key,
            "source_id": text(fields.get(b"source_id", b"")) or entry_id,
            "entry_id": entry_id,
            "archived_at": time.time(),
        }
        return (UNTRAINED, run, task, "undecodable"), [row]

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
            done = self._archived(folder, source.kind, recovered) if recovered else set()
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

    def _archived(self, folder: Path, kind: str, ids: list[str]) -> set[str]:
        """Which of ``ids`` a file of ``folder`` holds already, by the files' id ranges."""
        if not folder.is_dir():
            return set()
        wanted = {_id_key(i): i for i in ids}
        low, high = min(wanted), max(wanted)
        found: set[str] = set()
        for path in folder.iterdir():
            m = FILE_RE.match(path.name)
            if not m or m.group(1) != kind:
                continue
            first, last = _id_key(m.group(2)), _id_key(m.group(3))
            if last < low or first > high:
                continue
            column = self.pa.parquet.read_table(path, columns=["entry_id"]).column("entry_id").to_pylist()
            found |= {i for i in column if i is not None and _id_key(i) in wanted}
        return found

    def _write(self, folder: Path, kind: str, reads: list[Read], file_set: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        ids = sorted((r.entry_id for r in reads), key=_id_key)
        name = f"part-{kind}-{ids[0]}-{ids[-1]}.parquet"
        rows = [row for r in reads for row in r.rows]
        table = self._table(rows)
        tmp = folder / f".{name}.{self.consumer}.tmp"
        with open(tmp, "wb") as f:
            self.pa.parquet.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / name)
        _fsync_dir(folder)
        self.files += 1
        self.written[file_set] += len(rows)
        telemetry.archive_written(file_set, len(rows))
        log.debug("archive: wrote %s (%d rows)", folder / name, len(rows))

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        """The rows as one table: token columns moved as whole numpy arrays (offsets and one
        concatenation), never value by value."""
        pa, np = self.pa, _np()
        arrays = []
        for f in self.schema:
            values = [row.get(f.name) for row in rows]
            if pa.types.is_list(f.type):
                dtype = f.type.value_type.to_pandas_dtype()
                parts = [None if v is None else np.asarray(v, dtype=dtype) for v in values]
                lengths = np.array([0 if p is None else len(p) for p in parts], dtype=np.int32)
                offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
                flat = np.concatenate([p for p in parts if p is not None] or [np.array([], dtype=dtype)])
                mask = pa.array([p is None for p in parts])
                arrays.append(
                    pa.ListArray.from_arrays(
                        pa.array(offsets), pa.array(flat, type=f.type.value_type), mask=mask
                    )
                )
            elif pa.types.is_timestamp(f.type):
                arrays.append(pa.array([None if v is None else int(v * 1e6) for v in values], type=f.type))
            else:
                arrays.append(pa.array(values, type=f.type))
        return pa.Table.from_arrays(arrays, schema=self.schema)

    def check_dir(self) -> None:
        """SettingsError naming archive.dir unless files can be written there."""
        probe = self.root / f".probe.{self.consumer}.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise SettingsError(
                f"archive.dir {str(self.root)!r}: the archive cannot be written there ({exc})"
            ) from None

    def clean(self) -> int:
        """Remove this consumer's temporary files left by a crash (never visible: hidden)."""
        removed = 0
        if self.root.is_dir():
            for path in self.root.rglob(f".part-*.{self.consumer}.tmp"):
                path.unlink(missing_ok=True)
                removed += 1
        return removed

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


def _np() -> Any:
    import numpy as np

    return np


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def archive_run(
    client: redis.Redis,
    settings: Settings,
    stop: threading.Event,
    consumer: str = ARCHIVER_CONSUMER,
    on_start: Callable[[Archiver], None] | None = None,
) -> Archiver:
    """The archiver's loop until ``stop``; then what the sources hold is read and written
    (the run's last step, when the run stopped), and the files closed."""
    archiver = Archiver(client, settings, consumer)
    archiver.check_dir()
    if on_start is not None:
        on_start(archiver)
    removed = archiver.clean()
    if removed:
        log.info("archive: removed %d temporary files of a write that did not finish", removed)
    archiver.ensure()
    block_ms = min(settings.buffer.block_ms, 1000)
    shown = time.monotonic()
    while not stop.is_set():
        archiver.step(block_ms)
        if time.monotonic() - shown >= settings.process.progress_s:
            shown = time.monotonic()
            log.info(
                "archive: %d trained rows, %d untrained rows in %d files under %s",
                archiver.written[TRAINED], archiver.written[UNTRAINED], archiver.files, archiver.root,
            )  # fmt: skip
    # what the sources hold now is read and written before the exit (the run's last step,
    # when the run stopped), for at most half of process.stop_timeout_s
    deadline = time.monotonic() + settings.process.stop_timeout_s / 2
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
