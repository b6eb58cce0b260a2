"""What ``rollstream status`` shows: per stream its length, pending count, consumers,
lag and oldest pending idle time; the run's steps and cumulative counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import redis

from rollstream.shared import rewind
from rollstream.shared.keys import (
    DROPPED,
    EVALS,
    GROUP_OF_KIND,
    GROUPS,
    MODEL_STEP,
    PAUSED,
    POOLS,
    REWOUND,
    RUN_ID,
    RUN_LOST,
    TRAIN_STEP,
    UNTRAINABLE,
    Count,
    Keys,
    progress_field,
)
from rollstream.shared.liveness import ProcessBeat, live_processes
from rollstream.shared.redis_cluster import scan_run
from rollstream.shared.streams import text


@dataclass(slots=True)
class StreamStatus:
    key: str
    kind: str
    task: str
    length: int
    group: str
    pending: int
    consumers: int
    # Entries not yet delivered to the group. Acked entries are deleted, so this is
    # length - pending; Redis 7's own "lag" turns null once entries are deleted.
    lag: int
    oldest_pending_idle_ms: int | None


@dataclass(slots=True)
class TaskAccount:
    """Where the prompts fed to a task are. ``lost`` is what none of the others holds:
    0 unless something is wrong."""

    fed: int
    trained: int  # committed by a trainer
    evaluated: int  # eval prompts whose results went to their eval batch
    waiting: int  # produced, in the groups stream, not yet committed
    in_pools: int  # evals, prompts, aborted and expired streams: unclaimed or being produced
    filtered: int
    dropped: int  # expired with tail_batch_trigger_size -1, aborted or removed with their batch
    dead: int
    lost: int
    # Groups of the replay buffer that no producer made from a fed prompt (written by hand,
    # or by a producer that does not count `completed`): in the figures above (trained,
    # waiting, dead, ...) but not in fed, so they are taken out of lost.
    not_fed: int = 0


@dataclass(slots=True)
class RunStatus:
    run: str
    model_step: int | None
    train_step: int | None
    paused: bool = False
    streams: list[StreamStatus] = field(default_factory=list)
    dead_letters: int = 0
    events: int = 0
    progress: dict[str, int] = field(default_factory=dict)
    accounts: dict[str, TaskAccount] = field(default_factory=dict)
    processes: list[ProcessBeat] = field(default_factory=list)
    run_id: str | None = None  # the run's identity (None: no process has started in it)
    lost: str | None = None  # what the process that found the run lost said, when one did
    rewound: str | None = None  # what the trainer that found committed steps gone said (shared/rewind.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _count(value: bytes | str) -> int:
    """A progress counter; status shows -1 for one that is not a number (it reports, it
    does not refuse: `rollstream status` is what an operator looks at first)."""
    try:
        return int(float(value))
    except ValueError:
        return -1


def _lost(value: Any) -> str | None:
    if value is None:
        return None
    try:
        return str(orjson.loads(value)["what"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return text(value)


def _int(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return -1  # corrupt: the processes that need it say so, naming the key


def stream_keys(client: redis.Redis, keys: Keys) -> list[tuple[str, str, str]]:
    """(key, kind, task) of every per-task stream of the run, sorted."""
    found = []
    for raw in scan_run(client, keys.state, keys.pattern, 1000, "stream"):
        key = text(raw)
        parsed = keys.parse_stream(key)
        if parsed:
            found.append((key, *parsed))
    return sorted(found, key=lambda k: (k[2], k[1]))


def run_status(client: redis.Redis, keys: Keys) -> RunStatus:
    found = stream_keys(client, keys)
    # The counters and the streams' lengths in one snapshot (MULTI): the account of the
    # prompts adds up only if nothing moves between reading the ones and the others.
    snap = client.pipeline(transaction=True)
    snap.hgetall(keys.state)
    snap.hgetall(keys.progress)
    snap.xlen(keys.dead)
    snap.xlen(keys.events)
    for key, _, _ in found:
        snap.xlen(key)
    # groups trained but kept in groups:{task} for the archiver (archive.keep > 0): one
    # entry each in the trained log; neither waiting nor lag
    archived = [task for _, kind, task in found if kind == GROUPS]
    for task in archived:
        snap.xlen(keys.trained(task))
    state, progress, dead, events, *rest = snap.execute()
    held = dict(zip(archived, rest[len(found) :], strict=True))
    lengths = [
        int(n) - (int(held[task]) if kind == GROUPS else 0)
        for n, (_, kind, task) in zip(rest[: len(found)], found, strict=True)
    ]
    status = RunStatus(
        run=keys.run,
        model_step=_int(state.get(MODEL_STEP.encode())),
        train_step=_int(state.get(TRAIN_STEP.encode())),
        paused=state.get(PAUSED.encode()) == b"1",
        dead_letters=int(dead),
        events=int(events),
        progress={text(k): _count(v) for k, v in sorted(progress.items())},
        processes=live_processes(client, keys),
        run_id=None if state.get(RUN_ID.encode()) is None else text(state[RUN_ID.encode()]),
        lost=_lost(state.get(RUN_LOST.encode())),
        rewound=rewind.marked(state.get(REWOUND.encode())),
    )
    for (key, kind, task), length in zip(found, lengths, strict=True):
        group = GROUP_OF_KIND[kind]
        pipe = client.pipeline(transaction=False)
        pipe.xinfo_groups(key)
        pipe.xpending_range(key, group, min="-", max="+", count=1)
        groups, oldest = pipe.execute(raise_on_error=False)
        info = (
            next((g for g in groups if text(g["name"]) == group), None) if isinstance(groups, list) else None
        )
        pending = int(info["pending"]) if info else 0
        idle = int(oldest[0]["time_since_delivered"]) if isinstance(oldest, list) and oldest else None
        status.streams.append(
            StreamStatus(
                key=key,
                kind=kind,
                task=task,
                length=int(length),
                group=group,
                pending=pending,
                consumers=int(info["consumers"]) if info else 0,
                lag=int(length) - pending,
                oldest_pending_idle_ms=idle,
            )
        )
    status.accounts = _accounts(status)
    return status


def _accounts(status: RunStatus) -> dict[str, TaskAccount]:
    lengths = {(s.kind, s.task): s.length for s in status.streams}
    named = {k.partition(":")[0] for k in status.progress}
    tasks = sorted(t for t in named if progress_field(t, Count.FED) in status.progress)  # the fed ones
    out = {}
    for task in tasks:
        count = {c: status.progress.get(progress_field(task, c), 0) for c in Count}
        dropped = sum(count[c] for c in DROPPED)
        waiting = lengths.get((GROUPS, task), 0)
        in_pools = sum(lengths.get((kind, task), 0) for kind in (EVALS, *POOLS))
        trained, evaluated, filtered = (
            count[Count.CONSUMED],
            count[Count.EVAL_COMPLETED],
            count[Count.FILTERED],
        )
        held = trained + evaluated + waiting + in_pools + filtered + dropped
        # What entered the groups stream (completed by producers, and anything else) is
        # there or left it by one of these; what the producers did not count came from
        # elsewhere. Never below 0: a group deleted by hand before anyone read it is lost.
        left_groups = waiting + trained + sum(count[c] for c in UNTRAINABLE)
        not_fed = max(0, left_groups - count[Count.COMPLETED])
        out[task] = TaskAccount(
            fed=count[Count.FED],
            trained=trained,
            evaluated=evaluated,
            waiting=waiting,
            in_pools=in_pools,
            filtered=filtered,
            dropped=dropped,
            dead=count[Count.DEAD],
            lost=count[Count.FED] - held - count[Count.DEAD] + not_fed,
            not_fed=not_fed,
        )
    return out


# What each key of a run is, by the shape of its name below rs:{run}: (shared/keys.py)
_HASHES = ("state", "progress", "batch")
_SETS = ("fed",)
_STRINGS = ("alive", "fence")
_STREAMS = ("events", "dead", "metrics", "filtered", "eval", *GROUP_OF_KIND)


def expected_type(keys: Keys, key: str) -> str | None:
    """The Redis type rollstream keeps ``key`` of the run in, None for a key it does not
    name (rq's, or another's)."""
    parts = key.removeprefix(keys.base + ":").split(":")
    if not key.startswith(keys.base + ":") or parts[0] == "rq":
        return None
    if parts[0] == "batch" and len(parts) > 2 and parts[2] == "fed":
        return "set"
    for kind, names in (("hash", _HASHES), ("set", _SETS), ("string", _STRINGS), ("stream", _STREAMS)):
        if parts[0] in names:
            return kind
    return None


def wrong_types(client: redis.Redis, keys: Keys, limit: int = 10_000) -> list[str]:
    """The run's keys that hold another type than rollstream keeps there (what a WRONGTYPE
    reply does not say), e.g. "rs:{exp}:state holds a string, not a hash"."""
    out = []
    for i, raw in enumerate(scan_run(client, keys.state, keys.pattern, 500)):
        if i >= limit:
            break
        key = text(raw)
        expected = expected_type(keys, key)
        actual = text(client.type(key)) if expected else ""
        if expected and actual not in (expected, "none"):
            out.append(f"{key} holds a {actual}, not a {expected}")
    return sorted(out)
