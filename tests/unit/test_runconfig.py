"""shared.runconfig: the first process of a run publishes the shared settings, every
later one agrees with them or refuses to start naming each difference; and
load_settings' error for a variable that is not JSON."""

from __future__ import annotations

import orjson
import pytest
import redis

from rollstream.shared.errors import RunSettingsMismatch, SettingsError
from rollstream.shared.keys import RUN_SETTINGS, Keys
from rollstream.shared.runconfig import agreed_settings, check_run_settings
from rollstream.shared.settings import load_settings
from tests.conftest import SettingsFactory


def published(client: redis.Redis, keys: Keys) -> dict[str, object]:
    return orjson.loads(client.hget(keys.state, RUN_SETTINGS))  # type: ignore[no-any-return]


def test_agreed_settings_are_the_rollout_and_the_tasks_as_dotted_names(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(rollout={"max_staleness": 2, "batch_size": 16})
    flat = agreed_settings(settings)
    assert flat["rollout.max_staleness"] == 2
    assert flat["rollout.batch_size"] == 16
    assert flat["rollout.on_weight_sync"] == "partial"
    assert flat["tasks"] == "math,code"
    assert flat["tasks.math.n"] == 4 and flat["tasks.code.n"] == 2
    assert flat["tasks.math.weight"] == 1.0
    # per-process settings are not shared
    assert not any(name.startswith(("producer.", "buffer.", "redis.", "engines.")) for name in flat)


def test_the_first_process_publishes_and_the_same_settings_agree(
    fake_client: redis.Redis, make_settings: SettingsFactory
) -> None:
    settings = make_settings()
    keys = Keys(settings.run)
    assert check_run_settings(fake_client, keys, settings, "trainer") is True
    body = published(fake_client, keys)
    assert body["by"] == "trainer"
    assert body["settings"] == agreed_settings(settings)
    # the same settings again, from another process: they agree, nothing is rewritten
    assert check_run_settings(fake_client, keys, make_settings(), "producer-1") is False
    assert published(fake_client, keys) == body


def test_a_different_max_staleness_is_refused_naming_both_values_and_the_variable(
    fake_client: redis.Redis, make_settings: SettingsFactory
) -> None:
    keys = Keys(make_settings().run)
    assert check_run_settings(fake_client, keys, make_settings(), "trainer") is True
    before = fake_client.hget(keys.state, RUN_SETTINGS)
    with pytest.raises(RunSettingsMismatch) as excinfo:
        check_run_settings(fake_client, keys, make_settings(rollout={"max_staleness": 3}), "producer-1")
    message = str(excinfo.value)
    assert "rollout.max_staleness (ROLLSTREAM_ROLLOUT__MAX_STALENESS)" in message
    assert "this process has 3, the run has 1" in message
    assert "published by trainer" in message
    assert keys.run in message
    assert "tasks." not in message  # only what differs is named
    assert fake_client.hget(keys.state, RUN_SETTINGS) == before  # the run's settings stay


def test_every_difference_is_named(fake_client: redis.Redis, make_settings: SettingsFactory) -> None:
    keys = Keys(make_settings().run)
    check_run_settings(fake_client, keys, make_settings(), "trainer")
    other = make_settings(rollout={"max_staleness": 0, "on_weight_sync": "abort"})
    with pytest.raises(RunSettingsMismatch) as excinfo:
        check_run_settings(fake_client, keys, other, "producer-1")
    message = str(excinfo.value)
    assert "rollout.max_staleness (ROLLSTREAM_ROLLOUT__MAX_STALENESS): this process has 0" in message
    assert (
        "rollout.on_weight_sync (ROLLSTREAM_ROLLOUT__ON_WEIGHT_SYNC): this process has 'abort', "
        "the run has 'partial'" in message
    )


def test_a_different_group_size_names_the_task_setting(
    fake_client: redis.Redis, make_settings: SettingsFactory
) -> None:
    keys = Keys(make_settings().run)
    check_run_settings(fake_client, keys, make_settings(), "trainer")
    other = make_settings(tasks=[{"name": "math", "n": 8}, {"name": "code", "n": 2}])
    with pytest.raises(RunSettingsMismatch) as excinfo:
        check_run_settings(fake_client, keys, other, "producer-1")
    message = str(excinfo.value)
    assert "tasks.math.n (ROLLSTREAM_TASKS): this process has 8, the run has 4" in message
    assert "tasks.code.n" not in message
    assert "rollout." not in message


def test_a_missing_task_is_named(fake_client: redis.Redis, make_settings: SettingsFactory) -> None:
    keys = Keys(make_settings().run)
    check_run_settings(fake_client, keys, make_settings(), "trainer")
    with pytest.raises(RunSettingsMismatch) as excinfo:
        check_run_settings(fake_client, keys, make_settings(tasks=[{"name": "math", "n": 4}]), "producer-1")
    message = str(excinfo.value)
    assert "tasks (ROLLSTREAM_TASKS): this process has 'math', the run has 'math,code'" in message
    assert "tasks.code.n (ROLLSTREAM_TASKS): this process has None, the run has 2" in message


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b'{"by": "trainer"}', b'{"settings": 5}', b'{"settings": "ab"}', b"null", b"[]"],
)
def test_unreadable_published_settings_name_the_key_and_field(
    fake_client: redis.Redis, make_settings: SettingsFactory, raw: bytes
) -> None:
    settings = make_settings()
    keys = Keys(settings.run)
    fake_client.hset(keys.state, RUN_SETTINGS, raw)
    with pytest.raises(SettingsError) as excinfo:
        check_run_settings(fake_client, keys, settings, "producer-1")
    assert not isinstance(excinfo.value, RunSettingsMismatch)
    message = str(excinfo.value)
    assert keys.state in message
    assert f"field {RUN_SETTINGS!r}" in message
    assert "unreadable" in message
    assert fake_client.hget(keys.state, RUN_SETTINGS) == raw  # left for a person to look at


def test_tasks_that_are_not_json_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_TASKS", "math,code")
    with pytest.raises(SettingsError) as excinfo:
        load_settings()
    assert type(excinfo.value) is SettingsError
    message = str(excinfo.value)
    assert message.startswith("invalid setting tasks (ROLLSTREAM_TASKS): not valid JSON")
    assert excinfo.value.__suppress_context__  # raised from None: no pydantic-settings traceback


def test_a_nested_section_that_is_not_json_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_ROLLOUT", "{max_staleness: 2")
    with pytest.raises(SettingsError) as excinfo:
        load_settings()
    assert str(excinfo.value).startswith("invalid setting rollout (ROLLSTREAM_ROLLOUT): not valid JSON")


def test_the_protocols_numbers_are_published_with_the_settings_not_compared(
    fake_client: redis.Redis, make_settings: SettingsFactory
) -> None:
    keys = Keys(make_settings().run)
    first = make_settings(
        buffer={"claim_idle_ms": 30_000, "max_attempts": 5},
        process={"liveness_ttl_s": 12.0, "stop_timeout_s": 20.0},
        producer={"heartbeat_s": 1.5},
        rollout={"max_staleness": 2, "sync_weights_interval": 2},
    )
    assert check_run_settings(fake_client, keys, first, "trainer") is True
    # what a trainer of another framework reads instead of guessing (docs/stream-format.md §10)
    assert published(fake_client, keys)["protocol"] == {
        "buffer.claim_idle_ms": 30_000,
        "buffer.max_attempts": 5,
        "process.liveness_ttl_s": 12.0,
        "process.stop_timeout_s": 20.0,
        "producer.heartbeat_s": 1.5,
        "rollout.stale_threshold": 6,
        "archive.keep": 0,
        "buffer.dead_maxlen": 10_000,
        "buffer.filtered_maxlen": 100_000,
    }
    later = make_settings(rollout={"max_staleness": 2, "sync_weights_interval": 2})  # other defaults
    assert check_run_settings(fake_client, keys, later, "producer-1") is False  # the run's stay
    assert published(fake_client, keys)["protocol"]["buffer.claim_idle_ms"] == 30_000


def test_an_archive_runs_keep_is_published_for_a_foreign_trainer(
    fake_client: redis.Redis, make_settings: SettingsFactory
) -> None:
    """With archive.keep > 0 a trainer must commit with COMMIT_LOGGED (docs/stream-format.md
    §12): the run's state says so, or a foreign trainer commits with the plain script and
    the archive misses every group it trains."""
    keys = Keys(make_settings().run)
    assert check_run_settings(fake_client, keys, make_settings(archive={"keep": 100}), "feeder") is True
    assert published(fake_client, keys)["protocol"]["archive.keep"] == 100
