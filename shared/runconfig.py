"""The settings every process of a run must share, published once in the run's state.

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
from typing import Any

import orjson
import redis

from rollstream.shared.codec import FORMAT_VERSION, check_format
from rollstream.shared.errors import RunSettingsMismatch, SettingsError
from rollstream.shared.keys import FORMAT, RUN_SETTINGS, Keys
from rollstream.shared.settings import ENV_PREFIX, Settings


def agreed_settings(settings: Settings) -> dict[str, Any]:
    """The shared settings as flat dotted names: rollout.*, tasks.{name}.weight and .n."""
    flat: dict[str, Any] = {f"rollout.{k}": v for k, v in settings.rollout.model_dump().items()}
    flat["tasks"] = ",".join(t.name for t in settings.tasks)
    for task in settings.tasks:
        flat[f"tasks.{task.name}.weight"] = task.weight
        flat[f"tasks.{task.name}.n"] = task.n
    return flat


def _variable(name: str) -> str:
    if name.startswith("tasks"):
        return f"{ENV_PREFIX}TASKS"
    return ENV_PREFIX + name.upper().replace(".", "__")


def check_run_settings(client: redis.Redis, keys: Keys, settings: Settings, who: str) -> bool:
    """Publish this process's shared settings if the run has none (returns True), else
    raise RunSettingsMismatch naming every difference (returns False when they agree)."""
    client.hsetnx(keys.state, FORMAT, FORMAT_VERSION)  # the run's stream format: its first writer's
    check_format(client.hget(keys.state, FORMAT), f"run {keys.run!r}")
    mine = agreed_settings(settings)
    body = orjson.dumps({"by": who, "ts": time.time(), "settings": mine})
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
