"""Feeding a run's prompt pools: prompts appended once per uid (a feed sent again adds
nothing), the feeder's cursor moved in the same step as its prompts, and the count of
fresh prompts no producer has taken yet. A base of ReplayBuffer (shared/buffer.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from rollstream.shared import codec
from rollstream.shared.buffer_types import FeedResult
from rollstream.shared.errors import FeederError
from rollstream.shared.keys import (
    PRODUCERS,
    PROMPTS,
    Count,
    Keys,
    feeder_cursor_field,
    feeder_write_field,
    progress_field,
)
from rollstream.shared.records import Prompt
from rollstream.shared.scripts import Scripts
from rollstream.shared.streams import ConsumerStreams, text

FEED_CHUNK = 500


class Feeding:
    """The feeding half of a replay buffer; the buffer provides these attributes."""

    client: redis.Redis
    keys: Keys
    scripts: Scripts
    streams: ConsumerStreams

    def feed(self, prompts: Iterable[Prompt], pool: str = PROMPTS, batch: str | None = None) -> FeedResult:
        """Append prompts to their tasks' ``pool`` (fresh prompts, or eval prompts with
        "evals"); a uid already fed is not stored again. The prompts of a coordinator
        ``batch`` are remembered in the batch's own fed sets (Keys.batch_fed), which go
        with the batch, not in the run's, which never shrink."""
        added = existing = 0
        by_task: dict[str, list[Prompt]] = {}
        for prompt in prompts:
            by_task.setdefault(prompt.task, []).append(prompt)
        for task, items in by_task.items():
            self.streams.ensure(task)
            for start in range(0, len(items), FEED_CHUNK):
                chunk = items[start : start + FEED_CHUNK]
                args: list[Any] = [progress_field(task, Count.FED)]
                for p in chunk:
                    fields = codec.encode_prompt(p)
                    args += [fields["uid"], fields["task"], fields["data"]]
                fed = self.keys.fed(task) if batch is None else self.keys.batch_fed(batch, task)
                keys = [self.keys.stream(pool, task), fed, self.keys.progress]
                n = int(self.scripts.feed(keys=keys, args=args))
                added += n
                existing += len(chunk) - n
        return FeedResult(added, existing)

    def feed_at_cursor(self, task: str, prompts: Sequence[Prompt], expected: str, new: str) -> int:
        """Append prompts and move the task's feeder cursor from ``expected`` to ``new``
        in one step; FeederError, with nothing written, when the cursor is elsewhere. A
        token of this call, stored with the cursor, makes it safe to send again: the outage
        retry of a call whose reply was lost finds its own write, not another feeder's."""
        self.streams.ensure(task)
        token = os.urandom(8).hex()
        args: list[Any] = [
            feeder_cursor_field(task), expected, new, progress_field(task, Count.FED),
            feeder_write_field(task), token,
        ]  # fmt: skip
        for p in prompts:
            fields = codec.encode_prompt(p)
            args += [fields["uid"], fields["task"], fields["data"]]
        keys = [self.keys.prompts(task), self.keys.state, self.keys.progress]
        try:
            return int(self.scripts.feed_at_cursor(keys=keys, args=args))
        except redis.ResponseError as exc:
            if not str(exc).startswith("CURSOR"):
                raise
            raise FeederError(
                f"the feeder cursor of task {task!r} moved to {str(exc)[7:] or 'nothing'!r} "
                f"while this feeder expected {expected or 'nothing'!r}: is another feeder running?"
            ) from None

    def feeder_cursor(self, task: str) -> str:
        value = self.client.hget(self.keys.state, feeder_cursor_field(task))
        return "" if value is None else text(value)

    def unclaimed(self, task: str) -> int:
        """Fresh prompts not yet delivered to any producer (acked entries are deleted)."""
        self.streams.ensure(task)
        stream = self.keys.prompts(task)
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(stream)
        pipe.xpending(stream, PRODUCERS)
        length, pending = pipe.execute()
        return int(length) - int(pending["pending"])
