"""The settings every process of a run must share, published once in the run's state,
with the protocol's other numbers a foreign trainer reads there instead of guessing.

Producers admit work by the staleness bound and the trainer expires by it; both
split batches by the tasks' weights; the weight-sync mode decides what producers
do when the trainer publishes. A producer with max_staleness 1 beside a trainer
with 4 expires much of its work without a word, so the first process of a run
publishes these settings (HSETNX of ``settings`` in rs:{run}:state) and every
later one compares its own and refuses to start on a difference, naming each
setting with both values.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson
import redis

from rollstream.shared import rewind
from rollstream.shared.allocation import allocate_batch_sizes
from rollstream.shared.codec import FORMAT_VERSION, check_format
from rollstream.shared.errors import RunLost, RunRewound, RunSettingsMismatch, SettingsError
from rollstream.shared.keys import FORMAT, REWOUND, RUN_ID, RUN_LOST, RUN_SETTINGS, TRAIN_STEP, Keys
from rollstream.shared.settings import Settings
from rollstream.shared.settings_errors import ENV_PREFIX, redact_url

if TYPE_CHECKING:
    from rollstream.shared.buffer import ReplayBuffer


def open_buffer(client: redis.Redis, settings: Settings, consumer: str | None = None) -> ReplayBuffer:
    """The run's replay buffer for ``consumer``, built from the whole settings tree: the
    one place that picks the buffer's sections out of it (a process's composition root,
    a test, a benchmark), so that the buffer itself takes only what it uses."""
    from rollstream.shared.buffer import ReplayBuffer

    return ReplayBuffer(
        client,
        Keys(settings.run),
        settings.buffer,
        consumer,
        archive=settings.archive,
        stale_threshold=settings.rollout.stale_threshold,
    )


def task_quota(settings: Settings) -> dict[str, int]:
    """The groups of each task in one train step: the batch size split by the tasks' weights."""
    return allocate_batch_sizes(settings.rollout.batch_size, {t.name: t.weight for t in settings.tasks})


def agreed_settings(settings: Settings) -> dict[str, Any]:
    """The shared settings as flat dotted names: rollout.*, tasks.{name}.weight and .n."""
    flat: dict[str, Any] = {f"rollout.{k}": v for k, v in settings.rollout.model_dump().items()}
    flat["tasks"] = ",".join(t.name for t in settings.tasks)
    for task in settings.tasks:
        flat[f"tasks.{task.name}.weight"] = task.weight
        flat[f"tasks.{task.name}.n"] = task.n
    return flat


def protocol_settings(settings: Settings) -> dict[str, Any]:
    """What a trainer of another framework needs to follow the protocol beside the agreed
    settings, published with them (``protocol``) as the run's values, not compared: when
    an entry of a dead consumer may be taken over, after how many deliveries an entry is
    dead-lettered, how long a liveness key lives and how often producers renew their
    heartbeat, how long a stopping process waits for the others, whether the run keeps an
    archive (then commits log what they train) and the caps of the capped streams."""
    return {
        "buffer.claim_idle_ms": settings.buffer.claim_idle_ms,
        "buffer.max_attempts": settings.buffer.max_attempts,
        "process.liveness_ttl_s": settings.process.liveness_ttl_s,
        "process.stop_timeout_s": settings.process.stop_timeout_s,
        "producer.heartbeat_s": settings.producer.heartbeat_s,
        "rollout.stale_threshold": settings.rollout.stale_threshold,
        # a trainer commits with COMMIT_LOGGED when the run keeps an archive (keep > 0): the
        # plain COMMIT deletes the groups before the archiver has them
        "archive.keep": settings.archive.keep,
        # the caps of the dead letters and filtered records (XADD ... MAXLEN ~ N)
        "buffer.dead_maxlen": settings.buffer.dead_maxlen,
        "buffer.filtered_maxlen": settings.buffer.filtered_maxlen,
    }


def _variable(name: str) -> str:
    if name.startswith("tasks"):
        return f"{ENV_PREFIX}TASKS"
    return ENV_PREFIX + name.upper().replace(".", "__")


def check_run_settings(client: redis.Redis, keys: Keys, settings: Settings, who: str) -> bool:
    """Publish this process's shared settings if the run has none (returns True), else
    raise RunSettingsMismatch naming every difference (returns False when they agree)."""
    # read first, written only when missing: a process whose ACL user may only read the
    # state (metrics) joins a run that another process made without writing to it
    stored, raw = client.hmget(keys.state, [FORMAT, RUN_SETTINGS])
    if stored is None:
        client.hsetnx(keys.state, FORMAT, FORMAT_VERSION)  # the run's stream format: its first writer's
        stored = client.hget(keys.state, FORMAT)
    check_format(stored, f"run {keys.run!r}")
    mine = agreed_settings(settings)
    body = orjson.dumps(
        {"by": who, "ts": time.time(), "settings": mine, "protocol": protocol_settings(settings)}
    )
    if raw is None:
        if client.hsetnx(keys.state, RUN_SETTINGS, body):
            return True
        raw = client.hget(keys.state, RUN_SETTINGS)
    try:
        published = orjson.loads(raw or b"")
        theirs, by = dict(published["settings"]), str(published.get("by", "?"))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        raise SettingsError(
            f"the run's published settings ({keys.state} field {RUN_SETTINGS!r}) are unreadable: "
            f"{(raw or b'')[:80]!r}; delete that field to publish this process's settings"
        ) from None
    differences = [
        f"{name} ({_variable(name)}): this process has {mine.get(name)!r}, the run has {theirs.get(name)!r}"
        for name in sorted(set(mine) | set(theirs))
        if mine.get(name) != theirs.get(name)
    ]
    if differences:
        raise RunSettingsMismatch(
            f"settings differ from those of run {keys.run!r} (published by {by}); every process of a "
            "run must share them, so make them agree or use another run name:\n  " + "\n  ".join(differences)
        )
    return False


# What a run keeps in Redis and loses with it: named in RunLost's message.
LOST_DATA = (
    "its steps (train_step, model_step), settings, queued prompts, replay buffer, pending claims, "
    "progress counters and feeder cursors"
)


def run_identity(
    client: redis.Redis, keys: Keys, url: str, known: str | None = None, known_by: str = ""
) -> str:
    """The run's id, made now (HSETNX of ``run_id`` in the state hash) when the run is new.

    A run marked lost (``lost`` in the state, by a process that found its data gone)
    raises RunLost. So does a run without an id (or with another one) when ``known``
    says which id it had: ``known_by`` says who knew (the trainer's own record), so
    a Redis restarted empty is never taken for a new run behind the user's back."""
    marker, wound = client.hmget(keys.state, [RUN_LOST, REWOUND])
    if marker is not None:
        raise RunLost(_marked_lost(keys, url, _text(marker) or ""))
    if wound is not None:
        raise RunRewound(_marked_rewound(keys, url, wound))
    current = _text(client.hget(keys.state, RUN_ID))
    if known is not None and current != known:
        raise RunLost(lost_message(keys, url, known, current, known_by))
    if current is None:
        client.hsetnx(keys.state, RUN_ID, uuid.uuid4().hex)
        current = _text(client.hget(keys.state, RUN_ID))
    return current or ""


def _text(value: Any) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def check_run_identity(client: redis.Redis, keys: Keys, url: str, known: str, who: str) -> None:
    """RunLost when Redis no longer holds run id ``known`` (what this process saw at its
    start); the run is then marked lost in the state, so that no process restarted by a
    supervisor starts it again at step 0."""
    raw_id, raw_lost, wound = client.hmget(keys.state, [RUN_ID, RUN_LOST, REWOUND])
    current, marker = _text(raw_id), _text(raw_lost)
    if marker is not None:  # another process found the run lost (this one may be in a new run of it)
        raise RunLost(_marked_lost(keys, url, marker))
    if wound is not None and current == known:  # the trainer found committed steps gone
        raise RunRewound(_marked_rewound(keys, url, wound))
    if current == known:
        return
    message = lost_message(keys, url, known, current, f"{who}, which started in it")
    found = {"run_id": known, "found_by": who, "ts": time.time(), "what": message}
    client.hsetnx(keys.state, RUN_LOST, orjson.dumps(found))
    raise RunLost(message)


def lost_message(keys: Keys, url: str, known: str, current: str | None, known_by: str) -> str:
    shown = redact_url(url)
    if current is None:
        found = (
            f"Redis at {shown} no longer holds it ({keys.state} has no {RUN_ID}: Redis was emptied, "
            "or restarted without its data)"
        )
    else:
        found = f"Redis at {shown} holds another run of that name (run id {current})"
    return (
        f"run {keys.run!r} (run id {known}, known to {known_by}) is lost: {found}. Lost with it: "
        f"{LOST_DATA}. Nothing was started again at step 0: restore Redis's data (its append-only "
        "file, with a redis-server that can load it) and restart the run's processes, or start afresh "
        "under another run name"
    )


def _marked_lost(keys: Keys, url: str, marker: str) -> str:
    try:
        what = str(orjson.loads(marker)["what"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        what = repr(marker[:200])
    return (
        f"{what} (marked lost in {keys.state} field {RUN_LOST!r} at {redact_url(url)}; to start the run "
        f"afresh there: `redis-cli -u <redis.url> DEL {keys.state}`)"
    )


def _marked_rewound(keys: Keys, url: str, wound: Any) -> str:
    return (
        f"{rewind.marked(wound)} (marked in {keys.state} field {REWOUND!r} at {redact_url(url)}; "
        "`rollstream steps --train-step N --yes` clears it)"
    )


def committed_step(client: redis.Redis, keys: Keys) -> int:
    """The run's last committed train step as stored (0 when absent or unreadable)."""
    raw = client.hget(keys.state, TRAIN_STEP)
    try:
        return int(raw or 0)
    except ValueError:
        return 0
