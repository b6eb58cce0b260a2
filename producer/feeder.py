"""The feeder: iterate a prompt file for several epochs, keeping about K unclaimed
prompts in the stream, so that a dataset larger than what should sit in Redis
flows through it.

The cursor (epoch, position, seed, file fingerprint) lives in the run's state
hash and moves in the same script that appends the prompts, so a feeder that
is killed and restarted goes on where it stopped: no prompt of an epoch is
fed twice or skipped. Two feeders on one task cannot both advance the cursor:
the second one's script finds it moved and writes nothing.

Prompts fed this way carry the uid ``{uid}@{epoch}``: the same row in two
epochs is two prompts.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from rollstream.producer.prompts import UidCheck, check_readable, iter_lines, parse_prompt
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_feed import FEED_CHUNK
from rollstream.shared.errors import FeederError, InputError
from rollstream.shared.records import Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Cursor:
    source: str
    seed: int
    shuffle: bool
    epoch: int = 0
    pos: int = 0

    def dumps(self) -> str:
        return orjson.dumps(
            {
                "source": self.source,
                "seed": self.seed,
                "shuffle": self.shuffle,
                "epoch": self.epoch,
                "pos": self.pos,
            },
            option=orjson.OPT_SORT_KEYS,
        ).decode()

    @classmethod
    def loads(cls, text: str) -> Cursor:
        return cls(**orjson.loads(text))


@dataclass(slots=True)
class FeederStats:
    fed: int = 0
    total: int = 0  # rows x epochs
    epoch: int = 0


class Feeder:
    def __init__(
        self,
        buffer: ReplayBuffer,
        path: str | Path,
        task: str,
        *,
        epochs: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        keep_ahead: int = 1024,
        poll_s: float = 0.2,
    ) -> None:
        if epochs < 1:
            raise InputError(f"--epochs must be >= 1, got {epochs}")
        if keep_ahead < 1:
            raise InputError(f"--keep-ahead must be >= 1, got {keep_ahead}")
        self.buffer = buffer
        self.path = Path(path)
        self.task = task
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self.keep_ahead = keep_ahead
        self.poll_s = poll_s
        self.offsets: list[int] = []
        self.line_numbers: list[int] = []
        self.source = self._index()
        self._order: tuple[int, np.ndarray] | None = None

    def _index(self) -> str:
        """Validate every line before anything is written; keep the offsets of the rows."""
        check_readable(self.path)
        digest = hashlib.sha1()
        uids = UidCheck(str(self.path))
        for number, offset, raw in iter_lines(self.path):
            uids.keep(parse_prompt(raw, path=str(self.path), line=number, task=self.task), number)
            self.offsets.append(offset)
            self.line_numbers.append(number)
            digest.update(raw)
        if not self.offsets:
            raise InputError(f"{self.path}: no prompts in the file")
        self._stamp = self._file_stamp()
        return f"{self.path.name}:{len(self.offsets)}:{digest.hexdigest()[:16]}"

    def order(self, epoch: int) -> np.ndarray:
        """Row indices in the order of ``epoch``: the same for every feeder with this seed."""
        if self._order is None or self._order[0] != epoch:
            n = len(self.offsets)
            rows = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order = (epoch, rows)
        return self._order[1]

    def start_cursor(self) -> tuple[str, Cursor]:
        """The stored cursor (raw and parsed), or a fresh one; refuses another dataset."""
        raw = self.buffer.feeder_cursor(self.task)
        if not raw:
            return "", Cursor(self.source, self.seed, self.shuffle)
        cursor = Cursor.loads(raw)
        if (cursor.source, cursor.seed, cursor.shuffle) != (self.source, self.seed, self.shuffle):
            raise FeederError(
                f"task {self.task!r} of run {self.buffer.keys.run!r} was fed from {cursor.source} "
                f"(seed {cursor.seed}, shuffle {cursor.shuffle}); this feeder has {self.source} "
                f"(seed {self.seed}, shuffle {self.shuffle}). Use another run name to start over."
            )
        return raw, cursor

    def _file_stamp(self) -> tuple[int, int]:
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise InputError(f"{self.path}: cannot read it any more: {exc.strerror or exc}") from None
        return stat.st_size, stat.st_mtime_ns

    def _rows(self, indices: np.ndarray, epoch: int) -> list[Prompt]:
        if self._file_stamp() != self._stamp:
            # an input-file problem like any other (exit 2), not a feeder's disagreement
            raise InputError(
                f"{self.path} changed since the feeder read it (size or modification time): "
                "its rows are read again by offset, so restart the feeder (a changed file is a new dataset)"
            )
        out = []
        with self.path.open("rb") as handle:
            for index in map(int, indices):
                handle.seek(self.offsets[index])
                line = self.line_numbers[index]
                prompt = parse_prompt(handle.readline(), path=str(self.path), line=line, task=self.task)
                prompt.uid = f"{prompt.uid}@{epoch}"
                out.append(prompt)
        return out

    def step(self, raw: str, cursor: Cursor) -> tuple[str, Cursor, int]:
        """Top the stream up to keep_ahead unclaimed prompts; returns the new cursor and
        how many prompts were fed."""
        want = self.keep_ahead - self.buffer.unclaimed(self.task)
        n = len(self.offsets)
        fed = 0
        while want > 0 and cursor.epoch < self.epochs:
            take = min(want, FEED_CHUNK, n - cursor.pos)
            rows = self._rows(self.order(cursor.epoch)[cursor.pos : cursor.pos + take], cursor.epoch)
            pos = cursor.pos + take
            new = Cursor(cursor.source, cursor.seed, cursor.shuffle, cursor.epoch, pos)
            if pos == n:
                new = Cursor(cursor.source, cursor.seed, cursor.shuffle, cursor.epoch + 1, 0)
            new_raw = new.dumps()
            try:
                self.buffer.feed_at_cursor(self.task, rows, raw, new_raw)
            except FeederError:
                lost = self._lost_writes(cursor)
                if lost is None:
                    raise
                raw, cursor = lost
                continue
            raw, cursor = new_raw, new
            fed += take
            want -= take
        return raw, cursor, fed

    def _lost_writes(self, cursor: Cursor) -> tuple[str, Cursor] | None:
        """The cursor Redis holds, when it is behind ``cursor`` on this dataset: a feeder
        only moves the cursor forwards, so one that went back is Redis having lost this
        feeder's last writes (a failover to a replica that had not got them, a crash within
        the append-only file's fsync second), and the prompts and uids they fed with it:
        feeding on from there feeds those again. None when it is elsewhere (ahead: another
        feeder's)."""
        raw = self.buffer.feeder_cursor(self.task)
        held = Cursor.loads(raw) if raw else Cursor(self.source, self.seed, self.shuffle)
        mine = (held.source, held.seed, held.shuffle) == (self.source, self.seed, self.shuffle)
        if not mine or (held.epoch, held.pos) >= (cursor.epoch, cursor.pos):
            return None
        log.warning(
            "feeder: the cursor of task %r went back from epoch %d row %d to epoch %d row %d: Redis "
            "lost this feeder's last writes (a failover or a crash); feeding again from there",
            self.task, cursor.epoch, cursor.pos, held.epoch, held.pos,
        )  # fmt: skip
        return raw, held

    def run(
        self, stop: threading.Event | None = None, on_fed: Callable[[int, Cursor], None] | None = None
    ) -> FeederStats:
        """Feed until every epoch is in the stream, or ``stop`` is set."""
        stop = stop or threading.Event()
        raw, cursor = self.start_cursor()
        stats = FeederStats(total=len(self.offsets) * self.epochs)
        while cursor.epoch < self.epochs and not stop.is_set():
            raw, cursor, fed = self.step(raw, cursor)
            stats.fed += fed
            if fed and on_fed:
                on_fed(fed, cursor)
            if not fed:
                stop.wait(self.poll_s)
        stats.epoch = cursor.epoch
        return stats

    def done(self, cursor: Cursor) -> int:
        """Prompts of all epochs already fed at ``cursor``."""
        return cursor.epoch * len(self.offsets) + cursor.pos
