"""The trainer's side of the archive: with ``archive.keep`` > 0 a commit leaves its groups
to the task's trained log (rs:{run}:trained:{task}) instead of deleting them, an expiry
sends a copy there, and the archiver (consumer/archive.py) deletes what it has written.
The trainer never waits for the archiver: it warns when the log nears ``keep`` and when
the log's cap has deleted groups unarchived, and that is all an archive that lags costs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rollstream.shared import telemetry
from rollstream.shared.buffer_types import BatchItem
from rollstream.shared.keys import Keys
from rollstream.shared.settings import ArchiveSettings

ARCHIVE_WARN_S = 30.0  # the trainer's warnings of an archive that lags, at most this often
log = logging.getLogger(__name__)


class TrainedLog:
    """What one buffer writes to the trained logs of its run, and its warnings of an
    archive that lags. Without ``archive`` (or with keep 0) there is no trained log."""

    def __init__(self, keys: Keys, archive: ArchiveSettings | None, stale_threshold: int | None) -> None:
        self.keys = keys
        self.settings = archive if archive is not None else ArchiveSettings()
        if self.settings.keep > 0 and stale_threshold is None:
            raise ValueError(
                "a buffer with a trained log (archive.keep > 0) needs the rollout's stale_threshold"
            )
        self.stale_threshold = stale_threshold
        # when the trainer last warned of the archive's lag, and of groups deleted unarchived
        self._warned = {"lag": -ARCHIVE_WARN_S, "trimmed": -ARCHIVE_WARN_S}
        self._trimmed = 0  # groups the trained log's cap trimmed since that warning

    @property
    def keep(self) -> int:
        """The groups a task's trained log holds at most; 0: no trained log."""
        return self.settings.keep

    def lag(self, task: str, length: int, trimmed: int) -> None:
        """Warn when the task's trained log nears archive.keep, where the commit deletes its
        oldest unarchived groups, and when it has deleted some (each at most every
        ARCHIVE_WARN_S)."""
        settings, warned = self.settings, self._warned
        now = time.monotonic()
        if trimmed > 0:
            self._trimmed += trimmed
            telemetry.archive_trimmed(trimmed)
            if now - warned["trimmed"] >= ARCHIVE_WARN_S:
                warned["trimmed"] = now
                log.warning(
                    "%d trained groups were deleted unarchived: the trained log %s holds archive.keep "
                    "%d and the archiver (`rollstream archive`) is behind or stopped; they are not "
                    "in the archive",
                    self._trimmed, self.keys.trained(task), settings.keep,
                )  # fmt: skip
                self._trimmed = 0
        elif length >= settings.warn_at * settings.keep and now - warned["lag"] >= ARCHIVE_WARN_S:
            warned["lag"] = now
            log.warning(
                "the archive lags: %d groups in the trained log %s not archived yet, of archive.keep "
                "%d; beyond it the oldest are deleted, never archived (is `rollstream archive` running?)",
                length, self.keys.trained(task), settings.keep,
            )  # fmt: skip

    def expired_record(
        self, item: BatchItem, train_step: int, consumer: str
    ) -> tuple[str, dict[str, Any]] | None:
        """With an archive: the trained-log record of a group that expired at
        ``train_step``, the group's own fields after the header (docs/stream-format.md
        §13). Expiry is rare (admission control comes first): sending the copy from here
        costs the trainer nothing it would notice."""
        if self.settings.keep <= 0:
            return None
        staleness = train_step - item.group.model_step - 1
        header: dict[str, Any] = {
            "fate": "expired",
            "source_id": item.entry.id,
            "train_step": train_step,
            "trained_at": repr(time.time()),
            "trained_by": consumer,
            "reason": f"expired at train step {train_step}: staleness {staleness} >= stale_threshold "
            f"{self.stale_threshold}",
        }
        record = dict(header)
        for name, value in item.entry.fields.items():
            key = name.decode() if isinstance(name, bytes) else str(name)
            record["orig." + key if key in header else key] = value
        return self.keys.trained(item.entry.task), record
