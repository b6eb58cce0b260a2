"""`rollstream feed`: a one-shot feed of a prompt file, or a feeder that keeps prompts
ahead of the producers for some epochs."""

from __future__ import annotations

import logging
import threading
from typing import Any

from tqdm import tqdm

from rollstream.cli.logs import Ticker, on_terminal
from rollstream.cli.process import run_stopped, running, start_line
from rollstream.producer.feeder import Cursor, Feeder
from rollstream.producer.prompts import read_prompt_file
from rollstream.shared.buffer_types import default_consumer_name
from rollstream.shared.connection import connect, wait_for_redis
from rollstream.shared.errors import RunStopped
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys, Role
from rollstream.shared.runconfig import check_run_settings, open_buffer, run_identity
from rollstream.shared.settings import Settings

log = logging.getLogger("rollstream")

FEED_PART = 5000  # prompts a one-shot feed writes between two updates of its progress bar


def feed(
    settings: Settings,
    path: str,
    task: str,
    stop: threading.Event,
    *,
    first_uid_wins: bool = False,
    wait: bool = False,
) -> int:
    """One-shot feed: every line is checked before anything is written. A person typing it
    gets an unreachable Redis as an error at once (exit 3); with ``wait`` (a script or a
    process manager starting it beside Redis) it waits up to process.wait_timeout_s."""
    settings.task(task)
    prompts = read_prompt_file(path, task, first_uid_wins=first_uid_wins)
    start_line("feed", settings, file=path, task=task)
    if wait:
        waited = wait_for_redis(settings.redis, settings.process.wait_timeout_s, stop)
        if waited is None:
            return 0
        client = waited
    else:
        client = connect(settings.redis)
    run_identity(client, Keys(settings.run), settings.redis.url)  # a run marked lost is not fed again
    why = run_stopped(RunControl(client, Keys(settings.run)), "feed", default_consumer_name("feed"))
    if why:
        raise RunStopped(f"{why}: nothing fed")
    check_run_settings(client, Keys(settings.run), settings, default_consumer_name("feed"))
    buffer = open_buffer(client, settings, default_consumer_name("feed"))
    added = existing = 0
    # a progress bar on a terminal: a big file takes a while (each part is idempotent by uid)
    with tqdm(total=len(prompts), unit="prompt", desc=f"feed {task}", disable=not on_terminal()) as bar:
        for start in range(0, len(prompts), FEED_PART):
            part = buffer.feed(prompts[start : start + FEED_PART])
            added, existing = added + part.added, existing + part.existing
            bar.update(part.added + part.existing)
    print(f"{path}: {added} prompts added to task {task!r}, {existing} already there")
    return 0


def run_feeder(
    settings: Settings,
    path: str,
    task: str,
    *,
    epochs: int,
    shuffle: bool,
    seed: int,
    keep_ahead: int,
    stop: threading.Event,
    until_stopped: bool = False,
) -> int:
    """Keep about ``keep_ahead`` unclaimed prompts in the stream until every epoch is
    fed; with ``until_stopped`` stay until SIGTERM or the run's stop event after that,
    so that a process manager does not take a finished feeder for the end of the run."""
    settings.task(task)
    state: dict[str, Any] = {"fed": 0, "epoch": 0}
    with running(
        settings, Role.FEEDER, stop, detail=lambda: dict(state), task=task, file=path, epochs=epochs
    ) as process:
        if process is None:
            return 0
        feeder = Feeder(
            open_buffer(process.client, settings, process.name),
            path,
            task,
            epochs=epochs,
            shuffle=shuffle,
            seed=seed,
            keep_ahead=keep_ahead,
        )
        _, cursor = feeder.start_cursor()
        total = len(feeder.offsets) * epochs
        log.info("feeder: %d prompts x %d epochs, at epoch %d position %d", len(feeder.offsets), epochs,
                 cursor.epoch, cursor.pos)  # fmt: skip
        with tqdm(total=total, initial=feeder.done(cursor), unit="prompt", desc=f"feed {task}",
                  disable=not on_terminal()) as bar:  # fmt: skip
            ticker = Ticker(settings.process.progress_s)

            def on_fed(n: int, at: Cursor) -> None:
                bar.update(n)
                state.update(fed=state["fed"] + n, epoch=at.epoch, pos=at.pos)
                if ticker.due():
                    log.info("feeder: %d prompts fed, epoch %d of %d", feeder.done(at), at.epoch, epochs)

            stats = feeder.run(stop, on_fed)
        done = stats.epoch >= epochs
        log.info("feeder: %s after %d prompts this run, epoch %d of %d",
                 "done" if done else "stopped", stats.fed, stats.epoch, epochs)  # fmt: skip
        if done and until_stopped and not stop.is_set():
            log.info("feeder: every epoch is fed; staying until stopped (the cursor is kept)")
            state["done"] = True
            stop.wait()
    return 0
