from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.shared.errors import SettingsError
from rollstream.shared.settings import load_settings
from rollstream.shared.settings_errors import redact_url


def test_defaults_are_valid() -> None:
    settings = load_settings()
    assert settings.run == "default"
    assert settings.redis.url.startswith("redis://")
    assert [t.name for t in settings.tasks] == ["default"]


def test_env_prefix_and_nested_delimiter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_RUN", "exp1")
    monkeypatch.setenv("ROLLSTREAM_REDIS__URL", "rediss://trainer:s3cret@redis.internal:6380/2")
    monkeypatch.setenv("ROLLSTREAM_BUFFER__MAX_ATTEMPTS", "7")
    monkeypatch.setenv("ROLLSTREAM_TASKS", '[{"name": "math", "weight": 2, "n": 16}, {"name": "code"}]')
    settings = load_settings()
    assert settings.run == "exp1"
    assert settings.redis.url == "rediss://trainer:s3cret@redis.internal:6380/2"
    assert settings.buffer.max_attempts == 7
    assert [(t.name, t.weight, t.n) for t in settings.tasks] == [("math", 2.0, 16), ("code", 1.0, 8)]


def test_toml_file_and_env_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "rollstream.toml"
    config.write_text('run = "from-file"\n[buffer]\nclaim_idle_ms = 500\n[[tasks]]\nname = "math"\nn = 4\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ROLLSTREAM_BUFFER__CLAIM_IDLE_MS", "900")
    settings = load_settings()
    assert settings.run == "from-file"
    assert settings.buffer.claim_idle_ms == 900
    assert settings.task("math").n == 4


def test_config_env_names_a_missing_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_CONFIG", "/nonexistent/rollstream.toml")
    with pytest.raises(SettingsError, match="ROLLSTREAM_CONFIG"):
        load_settings()


@pytest.mark.parametrize(
    ("env", "value", "names"),
    [
        (
            "ROLLSTREAM_BUFFER__MAX_ATTEMPTS",
            "0",
            ["buffer.max_attempts", "ROLLSTREAM_BUFFER__MAX_ATTEMPTS", ">= 1"],
        ),
        ("ROLLSTREAM_BUFFER__CLAIM_IDLE_MS", "soon", ["buffer.claim_idle_ms", "integer"]),
        ("ROLLSTREAM_REDIS__URL", "http://localhost:6379", ["redis.url", "redis, rediss, unix"]),
        ("ROLLSTREAM_RUN", "my run{1}", ["run", "ROLLSTREAM_RUN", "pattern"]),
        ("ROLLSTREAM_TASKS", '[{"name": "math", "n": 0}]', ["tasks.0.n", ">= 1"]),
    ],
)
def test_invalid_value_names_the_setting_and_what_is_allowed(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, names: list[str]
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    for name in names:
        assert name in str(info.value)


def test_duplicate_task_names_are_refused() -> None:
    with pytest.raises(SettingsError, match="repeated: math"):
        load_settings(tasks=[{"name": "math"}, {"name": "math"}])


def test_unknown_task_lists_the_known_ones() -> None:
    settings = load_settings(tasks=[{"name": "math"}, {"name": "code"}])
    with pytest.raises(SettingsError, match="math, code"):
        settings.task("poetry")


def test_unknown_setting_is_an_error() -> None:
    with pytest.raises(SettingsError, match=r"buffer\.max_attemps"):
        load_settings(buffer={"max_attemps": 3})


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://user:p%40ss@h.example:6380/1", "rediss://user:***@h.example:6380/1"),
        ("redis://host:6379/0", "redis://host:6379/0"),
    ],
)
def test_redact_url_hides_only_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "pw" not in redact_url(url).split("@")[0].replace("***", "")


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_a_number_setting_that_is_not_finite_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION", value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith("invalid setting engines.sim.time_compression")
    assert "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION" in message and "finite" in message
