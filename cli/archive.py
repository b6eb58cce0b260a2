"""``rollstream archive`` and ``rollstream export``: the rollout archive's process and what
reads it back for supervised trainers (consumer/archive.py, consumer/export.py)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from rollstream.cli.process import running
from rollstream.shared.keys import Role
from rollstream.shared.settings import Settings

log = logging.getLogger("rollstream")


def archive(settings: Settings, stop: threading.Event) -> int:
    """The archiver, until SIGTERM or the run's stop event (then it writes what the run left
    in its sources). With archive.keep 0 (the default) it is off: it says so and waits for
    the run to stop, so that a Procfile line of it ends with the formation."""
    from rollstream.consumer.archive import ARCHIVER_CONSUMER, Archiver
    from rollstream.consumer.archive_files import schema
    from rollstream.consumer.assembly import run_archiver

    keep = settings.archive.keep
    if keep > 0:
        schema()  # pyarrow missing: a settings error now, before any wait
    holder: list[Archiver] = []

    def detail() -> dict[str, Any]:
        if not holder:
            return {"keep": keep}
        a = holder[0]
        return {"keep": keep, "rows": dict(a.written), "files": a.files}

    with running(
        settings, Role.ARCHIVER, stop, name=ARCHIVER_CONSUMER, detail=detail, keep=keep,
        dir=str(Path(settings.archive.dir).resolve()),
        refuse_stopped=False,  # a stopped run's trained groups are still to write
    ) as process:  # fmt: skip
        if process is None:
            return 0
        if keep <= 0:
            log.info(
                "archive: off (archive.keep is 0: the trainer keeps no trained log); set "
                "ROLLSTREAM_ARCHIVE__KEEP for the trainer and this process to archive the run. "
                "Waiting for the run to stop"
            )
            stop.wait()
            return 0
        run_archiver(settings, stop, client=process.client, on_start=holder.append)
    return 0


def export(
    archive_dir: str,
    out: str,
    *,
    kind: str,
    run: str | None,
    task: str | None,
    min_reward: float | None,
    best_of: int,
) -> int:
    from rollstream.consumer.export import export_jsonl

    written = export_jsonl(
        Path(archive_dir), Path(out), kind=kind, run=run, task=task, min_reward=min_reward, best_of=best_of
    )
    log.info("export: %d %s records written to %s", written, kind, out)
    return 0
