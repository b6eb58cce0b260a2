"""Group failures logged without flooding the log: a failure that hits every group (an
engine out of memory, Redis gone while the producer stops) is said once, then counted,
and the count said at most every ``interval_s`` and at the stop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from rollstream.shared.keys import RUN_ID, Keys


def why(exc: BaseException | None) -> str:
    """The exception's type and message: redis-py 8's repr of a server error hides the message."""
    return f"{type(exc).__name__}: {exc}"


@dataclass(slots=True)
class _Same:
    since: float  # when this failure was last said
    count: int = 0  # groups that failed the same way since, not said yet
    last: str = ""  # the last of them


class FailureLog:
    """``failed(group, exc)``: the first group that fails with a given error is logged at
    once (ERROR, naming the group); the next ones with the same error only once
    ``interval_s`` has passed, as one line with their count and the last group's id;
    ``flush()`` says the counts not said yet (at the producer's stop)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        quiet: Callable[[BaseException | None], bool] | None = None,
    ) -> None:
        self.log = logger
        self.interval_s = interval_s
        self.clock = clock
        self.quiet = quiet  # failures not to say: the process says their cause (run_gone)
        self._seen: dict[str, _Same] = {}

    def failed(self, group_id: str, exc: BaseException | None) -> None:
        if self.quiet is not None and self.quiet(exc):
            return
        reason = why(exc)
        now = self.clock()
        same = self._seen.get(reason)
        if same is None:
            self.log.error("group %s failed: %s", group_id, reason)
            self._seen[reason] = _Same(now)
            return
        same.count += 1
        same.last = group_id
        if now - same.since >= self.interval_s:
            self._say(reason, same, now)

    def flush(self) -> None:
        now = self.clock()
        for reason, same in self._seen.items():
            if same.count:
                self._say(reason, same, now)

    def _say(self, reason: str, same: _Same, now: float) -> None:
        self.log.error("%d more groups failed in %.0f s (the last: %s): %s",
                       same.count, now - same.since, same.last, reason)  # fmt: skip
        same.since, same.count = now, 0


def run_gone(client: redis.Redis, keys: Keys) -> Callable[[BaseException | None], bool]:
    """Whether a group's failure is a NOGROUP of a run Redis no longer holds (emptied,
    restarted without its data): the process's run watch stops it with one error naming
    that (cli/process.py), so the groups that failed on the way are not said too."""

    def gone(exc: BaseException | None) -> bool:
        if not (isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc)):
            return False
        try:
            return not client.hexists(keys.state, RUN_ID)
        except redis.RedisError:
            return False

    return gone
