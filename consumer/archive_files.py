"""The rollout archive's Parquet files (consumer/archive.py reads what goes in them): the
schema, and each file written exactly once. A file is written under a hidden temporary
name (``.part-…tmp``, which pyarrow, pandas, DuckDB and ``datasets`` globs of
``*.parquet`` skip), fsynced, renamed into place and its folder fsynced; its name is
derived from the ids of the entries in it, whose ``entry_id`` column says which files
hold an entry read again after a crash."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from rollstream.shared.errors import SettingsError

FILE_RE = re.compile(r"^part-([a-z]+)-(\d+-\d+)-(\d+-\d+)\.parquet$")


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


class PartFiles:
    """The files under ``root``, written by the archiver ``consumer`` (its name in its
    temporary files, so that each cleans only its own)."""

    def __init__(self, root: Path, consumer: str) -> None:
        self.pa = _pa()
        self.schema = schema()
        self.root = root
        self.consumer = consumer

    def archived(self, folder: Path, kind: str, ids: list[str]) -> set[str]:
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

    def write(self, folder: Path, kind: str, ids: list[str], rows: list[dict[str, Any]]) -> Path:
        """One file of ``rows``, the rows of the entries ``ids``, in place under ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        ids = sorted(ids, key=_id_key)
        name = f"part-{kind}-{ids[0]}-{ids[-1]}.parquet"
        table = self.table(rows)
        tmp = folder / f".{name}.{self.consumer}.tmp"
        with open(tmp, "wb") as f:
            self.pa.parquet.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / name)
        _fsync_dir(folder)
        return folder / name

    def table(self, rows: list[dict[str, Any]]) -> Any:
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
