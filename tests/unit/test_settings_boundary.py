"""The settings boundary: every bad input from the environment, rollstream.toml or keyword
overrides (the command line's flags) is one line per problem naming the source, the setting,
the value with any password masked, and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from rollstream.shared.errors import SettingsError
from rollstream.shared.settings import load_settings
from rollstream.shared.settings_errors import NON_SETTING_ENV, redact_url

PASSWORD = "hunter2-Zq9"


def settings_error(**overrides: Any) -> str:
    """The message of the SettingsError that load_settings raises, checked to carry no traceback."""
    with pytest.raises(SettingsError) as info:
        load_settings(**overrides)
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__
    return str(info.value)


def one_line(**overrides: Any) -> str:
    message = settings_error(**overrides)
    assert "\n" not in message, message
    return message


def write_toml(directory: Path, text: str | bytes, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = directory / "rollstream.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    monkeypatch.chdir(directory)
    return path


# --- unknown environment variables ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "setting", "suggestion"),
    [
        ("ROLLSTREAM_ROLLOUT__MAX_STALNESS", "rollout.max_stalness", "ROLLSTREAM_ROLLOUT__MAX_STALENESS"),
        ("ROLLSTREAM_ROLLOUT_MAX_STALENESS", "rollout_max_staleness", "ROLLSTREAM_ROLLOUT__MAX_STALENESS"),
        ("ROLLSTREAM_REDIS_URL", "redis_url", "ROLLSTREAM_REDIS__URL"),
        ("ROLLSTREAM_ENGINES__SIM__SPEED_TP", "engines.sim.speed_tp", "ROLLSTREAM_ENGINES__SIM__SPEED_TPS"),
        ("ROLLSTREAM_RUNN", "runn", "ROLLSTREAM_RUN"),
        ("ROLLSTREAM_STEP", "step", "ROLLSTREAM_STEPS"),
    ],
)
def test_a_misspelt_variable_is_an_error_with_did_you_mean(
    monkeypatch: pytest.MonkeyPatch, name: str, setting: str, suggestion: str
) -> None:
    monkeypatch.setenv(name, "2")
    message = one_line()
    assert message == (
        f"invalid setting {setting} ({name}): is not a setting, got '2'; did you mean {suggestion}?"
    )


def test_an_unknown_nested_variable_lists_its_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_ROLLOUT__FOO", "1")
    message = one_line()
    assert message.startswith(
        "invalid setting rollout.foo (ROLLSTREAM_ROLLOUT__FOO): is not a setting, got '1'"
    )
    assert "; rollout has: mode, batch_size, " in message
    assert "max_staleness" in message
    assert "did you mean" not in message


def test_an_unknown_top_level_variable_lists_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_FOO", "1")
    assert one_line() == (
        "invalid setting foo (ROLLSTREAM_FOO): is not a setting, got '1'; "
        "the settings are: run, redis, tasks, buffer, engines, rollout, producer, ray, process, log, "
        "metrics, algorithm, weights, archive"
    )


def test_variable_names_are_checked_without_regard_to_case(monkeypatch: pytest.MonkeyPatch) -> None:
    # pydantic-settings reads rollstream_run as ROLLSTREAM_RUN: a misspelt one is just as silent
    monkeypatch.setenv("rollstream_rollout__max_stalness", "2")
    message = one_line()
    assert "(rollstream_rollout__max_stalness)" in message
    assert "did you mean ROLLSTREAM_ROLLOUT__MAX_STALENESS?" in message


def test_a_variable_below_a_list_is_named_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_TASKS__NAME", "math")
    assert one_line() == (
        "invalid setting tasks.name (ROLLSTREAM_TASKS__NAME): is not a setting, got 'math'; "
        "did you mean ROLLSTREAM_TASKS?"
    )


def test_variables_that_the_procfile_reads_are_allowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "settings.toml"
    config.write_text('run = "from-config"\n')
    for name in NON_SETTING_ENV:
        monkeypatch.setenv(name, "20")
    monkeypatch.setenv("ROLLSTREAM_CONFIG", str(config))
    procfile = (Path(__file__).resolve().parents[2] / "Procfile").read_text()
    read = set(re.findall(r"\$\{(ROLLSTREAM_[A-Z_]+)", procfile))
    assert {"ROLLSTREAM_STEPS", "ROLLSTREAM_TRAIN_ARGS"} <= read
    assert read | {"ROLLSTREAM_CONFIG"} <= NON_SETTING_ENV
    assert load_settings().run == "from-config"


def test_the_projects_env_file_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variable of the .env that honcho loads for the Procfile is a setting or allowed."""
    env_file = Path(__file__).resolve().parents[2] / ".env"
    for line in env_file.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            monkeypatch.setenv(name, value.strip("'"))
    assert load_settings().rollout.batch_size == 16


def test_every_problem_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_FOO", "1")
    monkeypatch.setenv("ROLLSTREAM_ROLLOUT__MAX_STALNESS", "2")
    monkeypatch.setenv("ROLLSTREAM_BUFFER__MAX_ATTEMPTS", "0")
    lines = settings_error().splitlines()
    assert len(lines) == 3
    assert (
        sum(line.startswith("invalid setting foo (ROLLSTREAM_FOO): is not a setting") for line in lines) == 1
    )
    assert any("(ROLLSTREAM_ROLLOUT__MAX_STALNESS)" in line for line in lines)
    assert (
        "invalid setting buffer.max_attempts (ROLLSTREAM_BUFFER__MAX_ATTEMPTS): must be >= 1, got '0'"
        in lines
    )


# --- unknown keys of rollstream.toml -------------------------------------------------------------


def test_an_unknown_key_in_a_section_names_file_line_and_suggestion(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_toml(tmp_path, 'run = "exp"\n\n[rollout]\nbatch_size = 8\nmax_stalness = 2\n', monkeypatch)
    assert one_line() == (
        "invalid setting rollout.max_stalness (rollstream.toml:5): is not a setting, got 2; "
        "did you mean rollout.max_staleness?"
    )


def test_an_unknown_top_level_key_names_file_line_and_suggestion(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_toml(tmp_path, '# a run\nrn = "exp"\n', monkeypatch)
    assert (
        one_line() == "invalid setting rn (rollstream.toml:2): is not a setting, got 'exp'; did you mean run?"
    )


def test_an_unknown_key_without_a_close_match_lists_the_section(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_toml(tmp_path, "[buffer]\nwibble = 1\n", monkeypatch)
    message = one_line()
    assert message.startswith("invalid setting buffer.wibble (rollstream.toml:2): is not a setting, got 1; ")
    assert "buffer has: claim_idle_ms, max_attempts, read_count, block_ms" in message


def test_an_unknown_key_of_a_task_names_its_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    text = '[[tasks]]\nname = "math"\n\n[[tasks]]\nname = "code"\nnme = "x"\n'
    write_toml(tmp_path, text, monkeypatch)
    assert one_line() == (
        "invalid setting tasks.1.nme (rollstream.toml:6): is not a setting, got 'x'; "
        "did you mean tasks.1.name?"
    )


def test_the_file_that_rollstream_config_names_is_the_one_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "exp.toml"
    config.write_text("[producer]\nmax_inflight = 0\n")
    monkeypatch.setenv("ROLLSTREAM_CONFIG", str(config))
    assert one_line() == f"invalid setting producer.max_inflight ({config}:2): must be >= 1, got 0"


def test_the_environment_is_named_where_it_wins_over_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_toml(tmp_path, "[buffer]\nmax_attempts = 5\nread_count = 0\n", monkeypatch)
    monkeypatch.setenv("ROLLSTREAM_BUFFER__MAX_ATTEMPTS", "0")
    assert settings_error().splitlines() == [
        "invalid setting buffer.max_attempts (ROLLSTREAM_BUFFER__MAX_ATTEMPTS): must be >= 1, got '0'",
        "invalid setting buffer.read_count (rollstream.toml:3): must be >= 1, got 0",
    ]


# --- a file that is not TOML ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'run = "x"\n[rollout\n', "rollstream.toml:2: not valid TOML: Expected ']' at the end of a table"),
        (b"run = \n", "rollstream.toml:1: not valid TOML: Invalid value (column 7)"),
        (b'run = "x', "rollstream.toml:1: not valid TOML: Unterminated string (at the end of the file)"),
        (b'run = "x"\n\n\x00\x01\x02', "rollstream.toml:3: not valid TOML: "),
        (
            b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
            "rollstream.toml:1: not a TOML file: byte 0x89 at column 1 is not UTF-8",
        ),
        (
            'run = "x"\n# café\n'.encode("latin-1"),
            "rollstream.toml:2: not a TOML file: byte 0xe9 at column 6 is not UTF-8",
        ),
    ],
)
def test_a_broken_file_is_one_line_with_file_and_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: bytes, expected: str
) -> None:
    write_toml(tmp_path, content, monkeypatch)
    message = one_line()
    assert message.startswith(expected), message
    assert "Traceback" not in message


def test_a_broken_file_never_shows_its_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_toml(tmp_path, f'[redis]\nurl = "redis://u:{PASSWORD}@h:6379/0\n', monkeypatch)
    message = one_line()
    assert message.startswith("rollstream.toml:2: not valid TOML: ")
    assert PASSWORD not in message


def test_a_file_that_cannot_be_read_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "rollstream.toml").mkdir()
    monkeypatch.chdir(tmp_path)
    assert one_line() == "rollstream.toml: the settings file cannot be read: Is a directory"


def test_a_broken_file_is_reported_with_the_unknown_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_toml(tmp_path, b"run = \n", monkeypatch)
    monkeypatch.setenv("ROLLSTREAM_FOO", "1")
    lines = settings_error().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("invalid setting foo (ROLLSTREAM_FOO)")
    assert lines[1].startswith("rollstream.toml:1: not valid TOML")


# --- a section given a scalar, tasks that are not a list ------------------------------------------


def test_a_section_variable_given_a_scalar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_ROLLOUT", "5")
    assert one_line() == (
        "invalid setting rollout (ROLLSTREAM_ROLLOUT): must be a JSON object of rollout's settings, "
        'as in {"mode": "async"} (or set ROLLSTREAM_ROLLOUT__MODE and the like instead), got 5'
    )


def test_a_nested_section_variable_that_is_not_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_ENGINES__SIM", "{speed_tps: 5}")
    message = one_line()
    # pydantic-settings names only the top-level field (engines): the variable is named instead
    assert message.startswith("invalid setting engines.sim (ROLLSTREAM_ENGINES__SIM): not valid JSON (")
    assert "expected a JSON object of engines.sim's settings" in message
    assert message.endswith("got '{speed_tps: 5}'")


def test_a_section_given_a_scalar_in_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_toml(tmp_path, 'run = "x"\nrollout = 5\n', monkeypatch)
    assert one_line() == (
        "invalid setting rollout (rollstream.toml:2): must be a table of rollout's settings, "
        'as in [rollout] with mode = "async" under it, got 5'
    )


def test_a_section_given_a_scalar_as_a_keyword() -> None:
    assert one_line(rollout=5) == (
        "invalid setting rollout (keyword argument rollout): must be a dict of rollout's settings, "
        'as in {"mode": "async"}, got 5'
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            "math,code",
            "invalid setting tasks (ROLLSTREAM_TASKS): not valid JSON (Expecting value: line 1 column 1 "
            '(char 0)); expected a JSON list of tasks, as in [{"name": "math", "n": 8}], got \'math,code\'',
        ),
        (
            "5",
            'invalid setting tasks (ROLLSTREAM_TASKS): must be a JSON list of tasks, as in [{"name": "math", '
            '"n": 8}], got 5',
        ),
        (
            '{"name": "math"}',
            'invalid setting tasks (ROLLSTREAM_TASKS): must be a JSON list of tasks, as in [{"name": "math", '
            '"n": 8}], got an object',
        ),
        (
            '["math"]',
            'invalid setting tasks.0 (ROLLSTREAM_TASKS): must be a task, as in {"name": "math", "n": 8}, '
            "got 'math'",
        ),
        ("[]", "invalid setting tasks (ROLLSTREAM_TASKS): at least one task is required"),
    ],
)
def test_tasks_that_are_not_a_json_list_of_tasks(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: str
) -> None:
    monkeypatch.setenv("ROLLSTREAM_TASKS", value)
    assert one_line() == expected


def test_tasks_that_are_not_an_array_in_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_toml(tmp_path, 'tasks = "math"\n', monkeypatch)
    assert one_line() == (
        "invalid setting tasks (rollstream.toml:1): must be an array of tables, "
        "as in [[tasks]] with name = \"math\" under it, one per task, got 'math'"
    )


# --- secrets -------------------------------------------------------------------------------------

BAD_URLS = [
    f"redis://trainer:{PASSWORD}@redis.internal:99999/0",  # port out of range
    f"redis://trainer:{PASSWORD}@redis.internal:port/0",  # port not a number
    f"http://trainer:{PASSWORD}@redis.internal:6379/0",  # bad scheme
    f"redis://trainer:{PASSWORD}@redis.internal:6379/abc",  # db not a number
    f"rediss://:{PASSWORD}@redis.internal:6380/-1",  # db negative
    f"redis://trainer:{PASSWORD}@redis.internal:6379?db=x",  # db query not a number
    f"redis://trainer:{PASSWORD}@[::1:6379/0",  # unbalanced IPv6 bracket
    f"redis://trainer:{PASSWORD}@",  # no host
    f"redis://trainer:{PASSWORD}",  # the '@host' left out: the password reads as a port
    f"redis://trainer:p@ss/{PASSWORD}@redis.internal:6379/0",  # raw '@' and '/' in the password
    f"redis:/trainer:{PASSWORD}@redis.internal:6379/0",  # one slash
    f"redis://redis.internal:6379/zero?password={PASSWORD}",  # password as a query parameter
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_bad_url_never_shows_the_password(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("ROLLSTREAM_REDIS__URL", url)
    from_env = one_line()
    assert from_env.startswith("invalid setting redis.url (ROLLSTREAM_REDIS__URL): ")
    assert PASSWORD not in from_env
    assert "***" in from_env

    monkeypatch.delenv("ROLLSTREAM_REDIS__URL")
    from_flag = one_line(redis={"url": url})
    assert from_flag.startswith("invalid setting redis.url (flag --redis-url or keyword argument redis): ")
    assert PASSWORD not in from_flag
    assert "***" in from_flag

    from_section = one_line(redis=url)  # a URL where the redis section goes
    assert from_section.startswith("invalid setting redis (keyword argument redis): must be a dict")
    assert PASSWORD not in from_section


def test_a_bad_url_in_the_file_or_a_json_section_never_shows_the_password(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url = f"redis://trainer:{PASSWORD}@redis.internal:6379/abc"
    write_toml(tmp_path, f'[redis]\nurl = "{url}"\n', monkeypatch)
    message = one_line()
    assert message.startswith("invalid setting redis.url (rollstream.toml:2): ")
    assert message.endswith("got 'redis://trainer:***@redis.internal:6379/abc'")

    monkeypatch.setenv("ROLLSTREAM_REDIS", f'{{"url": "{url}"')  # JSON cut short
    message = one_line()
    assert message.startswith("invalid setting redis (ROLLSTREAM_REDIS): not valid JSON")
    assert PASSWORD not in message

    monkeypatch.setenv("ROLLSTREAM_REDIS", f'"{url}"')
    message = one_line()
    assert message.startswith("invalid setting redis (ROLLSTREAM_REDIS): must be a JSON object")
    assert PASSWORD not in message


def test_an_unknown_variable_never_shows_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_REDIS__URLL", f"redis://u:{PASSWORD}@h:6379/0")
    assert one_line() == (
        "invalid setting redis.urll (ROLLSTREAM_REDIS__URLL): is not a setting, "
        "got 'redis://u:***@h:6379/0'; did you mean ROLLSTREAM_REDIS__URL?"
    )


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:pw@h:99999/0", "redis://u:***@h:99999/0"),
        ("redis://u:pw@h:port/0", "redis://u:***@h:port/0"),
        ("redis://u:p@s/s@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://u:pw@[::1]:6379/0", "redis://u:***@[::1]:6379/0"),
        ("u:pw@h:6379", "u:***@h:6379"),
        ("redis://u:pw", "redis://u:***"),
        ("redis://h:6379/0?password=pw&db=1", "redis://h:6379/0?password=***&db=1"),
        ("redis://u@h:6379/0", "redis://u@h:6379/0"),
        ("redis://[::1]/0", "redis://[::1]/0"),
        ("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=1"),
    ],
)
def test_redact_url_masks_what_urlsplit_cannot_parse(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# --- the database part of a Redis URL -------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "what"),
    [
        ("redis://h:6379/abc", "the database (the path after host:port) is not a whole number"),
        ("redis://h:6379/-1", "the database (the path after host:port) is not a whole number"),
        ("redis://h:6379/0/1", "the database (the path after host:port) is not a whole number"),
        (
            "redis://h:6379/99999999999",
            "the database (the path after host:port) is out of range: it must be 0",
        ),
        ("redis://h:6379/0?db=one", "the db query parameter is not a whole number"),
        ("unix:///run/redis.sock?db=x", "the db query parameter is not a whole number"),
        ("redis://h:0/0", "the port is not valid: it must be a number from 1 to 65535"),
        ("redis://:6379/0", "the host is missing"),
        ("unix://", "the socket path is missing"),
    ],
)
def test_a_bad_part_of_the_url_is_named(monkeypatch: pytest.MonkeyPatch, url: str, what: str) -> None:
    monkeypatch.setenv("ROLLSTREAM_REDIS__URL", url)
    message = one_line()
    assert message.startswith(f"invalid setting redis.url (ROLLSTREAM_REDIS__URL): {what}")
    assert message.endswith(f"got {url!r}")


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:6379",
        "redis://h:6379/",
        "redis://h:6379/15",
        "rediss://u:pw@h:6380/2",
        "redis://h/0?db=3",
        "unix:///run/redis.sock?db=2",
        "redis://[::1]:6379/0",
    ],
)
def test_good_urls_are_accepted(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("ROLLSTREAM_REDIS__URL", url)
    assert load_settings().redis.url == url


# --- keyword overrides (the command line's flags) -------------------------------------------------


def test_a_flag_value_names_the_flag() -> None:
    assert one_line(run="my run") == (
        "invalid setting run (flag --run or keyword argument run): must match the pattern "
        "^[A-Za-z0-9][A-Za-z0-9_.\\-]{0,63}$ (letters, digits, '_', '.', '-'), got 'my run'"
    )


def test_an_unknown_keyword_has_a_did_you_mean() -> None:
    assert one_line(buffer={"max_attemps": 3}) == (
        "invalid setting buffer.max_attemps (keyword argument buffer): is not a setting, got 3; "
        "did you mean buffer.max_attempts?"
    )


def test_a_keyword_wins_over_the_environment_and_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_ROLLOUT__MODE", "sync")
    assert one_line(rollout={"mode": "fast"}) == (
        "invalid setting rollout.mode (keyword argument rollout): must be 'sync' or 'async', got 'fast'"
    )
