"""A run that goes backwards: Redis holding a ``train_step`` below one that was committed.

Replication is asynchronous and the append-only file is fsynced once a second: a
failover to a replica that lacked the last writes, or a crash of a lone Redis, can leave
the run's records behind what the trainer committed and saw acknowledged (with
``redis.wait_replicas`` 0; with N > 0 a commit returns only once N replicas hold it). The
lost steps' groups and claims are then back in Redis's view: training on trains their
prompts again on a model that has learned them, and ``rollstream status`` counts nothing
lost. Measured on emulated hosts before this check: 232-280 trained groups discarded
without a word after a 20 s partition of the primary.

The trainer is the one that can tell: it knows the last step it recorded (in this
process; across restarts its record file, cli/train.py). Before each batch and each
commit it compares (one HGET, and the commit's own script refuses to record a step on a
state behind it). On a rewind it puts back exactly what it still holds: the commits of
the steps Redis forgot, replayed from the entry ids it keeps of its last KEEP_COMMITS
steps, when every one of those groups is still pending for it (a crash that lost the
last commit but not the reads before it). Otherwise it marks the run rewound (``rewound``
in the state hash: JSON naming what was lost and who found it) and stops with
RunRewound, exit status 5. Every other process of the run sees the mark within a second
(cli/process.py's run watch) and stops too; one started later refuses, as for a lost
run. ``rollstream steps --train-step N --yes`` is the operator's decision to go on from
there: it sets the step and clears the mark.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import redis

from rollstream.shared.errors import RunRewound
from rollstream.shared.keys import REWOUND, TRAIN_STEP, TRAINER, Keys
from rollstream.shared.streams import text

__all__ = [
    "KEEP_COMMITS", "Commit", "Commits", "check", "marked", "note_recorded", "recorded_step", "rewound",
    "settle_lost_reads",
]  # fmt: skip

log = logging.getLogger(__name__)

KEEP_COMMITS = 8  # the trainer's last commits it can replay after a rewind

# The highest train step recorded through a client, per run: what "committed here" means
# for this process (a client per process in practice; per client, so that two trainers of
# one interpreter, a test's, never see each other's steps).
_RECORDED: weakref.WeakKeyDictionary[redis.Redis, dict[str, int]] = weakref.WeakKeyDictionary()


def note_recorded(client: redis.Redis, run: str, step: int) -> None:
    runs = _RECORDED.setdefault(client, {})
    runs[run] = max(step, runs.get(run, step))


def recorded_step(client: redis.Redis, run: str) -> int | None:
    """The last train step this process recorded as committed in ``run`` (None: none)."""
    return _RECORDED.get(client, {}).get(run)


@dataclass(frozen=True, slots=True)
class Commit:
    """What one train step committed: the ids of its groups, per groups stream."""

    step: int
    ids: dict[str, list[str]]  # task -> entry ids in its groups stream


class Commits:
    """The trainer's last KEEP_COMMITS commits, ids only (never the groups' payloads)."""

    def __init__(self) -> None:
        self._kept: deque[Commit] = deque(maxlen=KEEP_COMMITS)
        self.replays = 0  # rewinds seen: a batch read before one may hold reads Redis lost

    def add(self, step: int, ids: dict[str, list[str]]) -> None:
        self._kept.append(Commit(step, {k: list(v) for k, v in ids.items() if v}))

    def steps(self, first: int, last: int) -> list[Commit] | None:
        """The commits of steps ``first`` .. ``last``, all of them, or None."""
        found = {c.step: c for c in self._kept}
        wanted = [found.get(s) for s in range(first, last + 1)]
        return None if any(c is None for c in wanted) else [c for c in wanted if c is not None]


def _stored(client: redis.Redis, keys: Keys) -> int | None:
    raw = client.hget(keys.state, TRAIN_STEP)
    try:
        return int(raw or 0)
    except ValueError:
        return None  # corrupt: the step's own reads name it


def check(
    client: redis.Redis,
    keys: Keys,
    url: str,
    who: str,
    consumer: str,
    commits: Commits | None,
    replay: Callable[[Commit], None] | None = None,
) -> None:
    """Raise RunRewound (having marked the run) when Redis's train_step is below the step
    this process recorded, unless the missing commits are replayed exactly from
    ``commits`` by ``replay`` (the trainer's own commit of one kept step's groups)."""
    recorded = recorded_step(client, keys.run)
    if recorded is None:
        return
    stored = _stored(client, keys)
    if stored is None or stored >= recorded:
        return
    kept = commits.steps(stored + 1, recorded) if commits is not None and replay else None
    if kept is not None and commits is not None:
        commits.replays += 1
    why = _replay(client, keys, consumer, kept, replay) if kept is not None and replay else (
        f"this trainer no longer holds what {_steps(stored + 1, recorded)} trained (it keeps its last "
        f"{KEEP_COMMITS} commits)"
    )  # fmt: skip
    if not why:
        log.warning(
            "run %r: Redis held train_step %d, but %s committed step %d: Redis lost acknowledged writes "
            "(a failover or a crash); the commits of steps %d-%d were replayed exactly (their groups were "
            "still pending for it)", keys.run, stored, who, recorded, stored + 1, recorded,
        )  # fmt: skip
        return
    raise rewound(client, keys, url, who, stored, recorded, why)


def _replay(
    client: redis.Redis, keys: Keys, consumer: str, kept: list[Commit], replay: Callable[[Commit], None]
) -> str:
    """Commit again the groups of ``kept`` (every id still pending for ``consumer``) and
    record the last step; '' when done, else why it could not be done exactly."""
    pipe = client.pipeline(transaction=False)
    asked = [(keys.groups(task), i) for c in kept for task, ids in c.ids.items() for i in ids]
    for stream, entry_id in asked:
        pipe.xpending_range(stream, TRAINER, entry_id, entry_id, 1, consumername=consumer)
    answers = pipe.execute(raise_on_error=False)
    missing = [i for (_, i), a in zip(asked, answers, strict=True) if not (isinstance(a, list) and a)]
    if missing:
        return (
            f"{len(missing)} of the {len(asked)} groups those steps trained are no longer pending for "
            f"this trainer (e.g. {', '.join(missing[:3])}): their reads were lost too, so they would be "
            "read and trained again"
        )
    for commit in kept:
        replay(commit)
        client.hset(keys.state, TRAIN_STEP, commit.step)
    return ""


# KEYS: groups stream, progress hash. ARGV: trainer group, consumed field, ids... Each id
# that no consumer holds but the stream still has: a group this trainer trained whose read
# Redis lost (its commit found it not pending); deleted and counted as consumed, as its
# commit would have. One held by another consumer, or gone, is left alone. Returns the count.
_LOST_READS = """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 and #redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], ARGV[2], n) end
return n
"""


def settle_lost_reads(client: redis.Redis, keys: Keys, task: str, consumed: str, ids: list[str]) -> int:
    """Settle the groups of a commit whose reads Redis lost (after a rewind): see _LOST_READS."""
    if not ids:
        return 0
    return int(client.eval(_LOST_READS, 2, keys.groups(task), keys.progress, TRAINER, consumed, *ids))


def rewound(
    client: redis.Redis, keys: Keys, url: str, who: str, stored: int, recorded: int, why: str = ""
) -> RunRewound:
    """Mark the run rewound (unless it is already) and return the error that says so."""
    message = (
        f"run {keys.run!r} went backwards: Redis at {url} holds train_step {stored}, but {who} "
        f"committed train step {recorded} there and saw it acknowledged. Redis lost acknowledged "
        f"writes: {_steps(stored + 1, recorded)} (a failover to a replica that lacked them, replication "
        "being asynchronous: set redis.wait_replicas >= 1 and min-replicas-to-write on the data nodes; "
        "or a crash within the append-only file's fsync second; or an older copy of its data)"
        + (f"; {why}" if why else "")
        + ". Training on would train those steps' prompts again on a model that learned them, with "
        "nothing counted lost: every process of the run stops. Restore Redis's data, or go on from "
        f"here on purpose with `rollstream steps --train-step {recorded} --yes` (clears the mark; "
        "the groups of the lost steps are gone and their prompts are made again)"
    )
    found = {"what": message, "found_by": who, "train_step": stored, "committed": recorded, "ts": time.time()}
    try:
        client.hsetnx(keys.state, REWOUND, orjson.dumps(found))
    except redis.RedisError as exc:  # said; the error below stops this process anyway
        log.warning("could not mark run %r rewound in %s: %s", keys.run, keys.state, exc)
    return RunRewound(message)


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def marked(value: bytes | str | None) -> str | None:
    """What a ``rewound`` mark says (None: not marked)."""
    if value is None:
        return None
    try:
        return str(orjson.loads(value)["what"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return text(value)
