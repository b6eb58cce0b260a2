"""What ``rollstream status`` shows: per stream its length, pending count, consumers,
lag and oldest pending idle time; the run's steps and cumulative counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from shared.keys import GROUP_OF_KIND, MODEL_STEP, TRAIN_STEP, Keys
from shared.streams import text


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
class RunStatus:
    run: str
    model_step: int | None
    train_step: int | None
    streams: list[StreamStatus] = field(default_factory=list)
    dead_letters: int = 0
    events: int = 0
    progress: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def stream_keys(client: redis.Redis, keys: Keys) -> list[tuple[str, str, str]]:
    """(key, kind, task) of every per-task stream of the run, sorted."""
    found = []
    for raw in client.scan_iter(match=keys.pattern, count=1000, _type="stream"):
        key = text(raw)
        parsed = keys.parse_stream(key)
        if parsed:
            found.append((key, *parsed))
    return sorted(found, key=lambda k: (k[2], k[1]))


def run_status(client: redis.Redis, keys: Keys) -> RunStatus:
    state = client.hgetall(keys.state)
    progress = client.hgetall(keys.progress)
    status = RunStatus(
        run=keys.run,
        model_step=_int(state.get(MODEL_STEP.encode())),
        train_step=_int(state.get(TRAIN_STEP.encode())),
        dead_letters=int(client.xlen(keys.dead)),
        events=int(client.xlen(keys.events)),
        progress={text(k): int(v) for k, v in sorted(progress.items())},
    )
    for key, kind, task in stream_keys(client, keys):
        group = GROUP_OF_KIND[kind]
        pipe = client.pipeline(transaction=False)
        pipe.xlen(key)
        pipe.xinfo_groups(key)
        pipe.xpending_range(key, group, min="-", max="+", count=1)
        length, groups, oldest = pipe.execute(raise_on_error=False)
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
    return status
