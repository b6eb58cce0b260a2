"""The chaos run's settings (chaos/run.py): one task, small batches, a tight staleness
bound, and an archive that keeps every trained group."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = "math"
BATCH = 8
MAX_STALENESS = 1
THRESHOLD = MAX_STALENESS + 1  # sync_weights_interval 1
CLAIM_IDLE_MS = 3000
# The archive: the trained log holds at most this many unarchived groups (more than a run
# trains, so none is trimmed and every trained group must be archived), files are closed
# every FLUSH_S so that a kill -9 of the archiver lands between its writes and its acks.
ARCHIVE_KEEP = 100_000
ARCHIVE_FLUSH_S = 1.0
