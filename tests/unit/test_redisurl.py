"""The redis+sentinel:// and redis+cluster:// forms of redis.url: parsed into their parts,
and every malformed one a settings error naming redis.url, never the password."""

from __future__ import annotations

import pytest

from rollstream.shared import redisurl
from rollstream.shared.errors import SettingsError
from rollstream.shared.settings import load_settings
from rollstream.shared.settings_errors import redact_url


def test_a_sentinel_url_names_the_sentinels_the_service_the_database_and_the_password() -> None:
    parsed = redisurl.parse("redis+sentinel://:s3cret@10.0.0.1:26379,sentinel-b:26380/mymaster/2")
    assert parsed.hosts == (("10.0.0.1", 26379), ("sentinel-b", 26380))
    assert (parsed.service, parsed.db, parsed.username, parsed.password) == ("mymaster", 2, None, "s3cret")
    one = redisurl.parse("redis+sentinel://app:pw@h:1/svc?sentinel_password=other")
    assert (one.db, one.username, one.password, one.options) == (
        0,
        "app",
        "pw",
        {"sentinel_password": "other"},
    )


def test_a_cluster_url_names_its_nodes() -> None:
    parsed = redisurl.parse("redis+cluster://:pw@127.0.0.1:7000,127.0.0.1:7001")
    assert parsed.hosts == (("127.0.0.1", 7000), ("127.0.0.1", 7001)) and parsed.password == "pw"
    assert redisurl.parse("redis+cluster://h:7000/0").db == 0


@pytest.mark.parametrize(
    ("url", "what"),
    [
        ("redis+sentinel://:s3cret@h1:26379,h2:26379", "service name is missing"),
        ("redis+sentinel://:s3cret@h1:26379/mymaster/x", "database is not a whole number"),
        ("redis+sentinel://:s3cret@h1:26379/a/1/2", "service_name[/db]"),
        ("redis+sentinel://:s3cret@h1,h2:26379/mymaster", "host:port"),
        ("redis+sentinel://:s3cret@h1:99999/mymaster", "port is not valid"),
        ("redis+sentinel://:s3cret@h1:1/mymaster?dbx=1", "query parameter 'dbx'"),
        ("redis+cluster://:s3cret@h1:7000/3", "only database 0"),
        ("redis+cluster://:s3cret@h1:7000?sentinel_password=x", "query parameter"),
    ],
)
def test_a_malformed_url_is_a_settings_error_naming_redis_url_and_not_the_password(
    url: str, what: str
) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(redis={"url": url})
    message = str(info.value)
    assert "redis.url" in message and what in message, message
    assert "s3cret" not in message


def test_valid_forms_load_and_their_password_is_redacted() -> None:
    url = "redis+sentinel://:s3cret@h1:26379,h2:26379/mymaster/1"
    assert load_settings(redis={"url": url}).redis.url == url
    assert "s3cret" not in redact_url(url) and "h1:26379,h2:26379/mymaster/1" in redact_url(url)
    assert load_settings(redis={"url": "redis+cluster://h:7000", "wait_replicas": 1}).redis.wait_replicas == 1


def test_wait_settings_are_bounded() -> None:
    with pytest.raises(SettingsError, match=r"redis\.wait_timeout_ms"):
        load_settings(redis={"wait_timeout_ms": 0})
    with pytest.raises(SettingsError, match=r"redis\.wait_replicas"):
        load_settings(redis={"wait_replicas": -1})


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis+sentinel://:p@h1:26379,h2:26379/mymaster/0", 1),  # a failover: safe by default
        ("rediss+sentinel://h1:26379/mymaster", 1),
        ("redis://h:6379/0", 0),
        ("redis+cluster://h:7000", 0),
    ],
)
def test_commits_wait_for_a_replica_by_default_where_sentinels_fail_over(url: str, expected: int) -> None:
    assert load_settings(redis={"url": url}).redis.wait_replicas == expected
    # set on purpose, it is kept: 0 runs on without a replica
    assert load_settings(redis={"url": url, "wait_replicas": 0}).redis.wait_replicas == 0
    assert load_settings(redis={"url": url, "wait_replicas": 2}).redis.wait_replicas == 2


def test_the_wait_default_follows_a_sentinel_url_from_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_REDIS__URL", "redis+sentinel://h1:26379/mymaster/0")
    assert load_settings().redis.wait_replicas == 1
    monkeypatch.setenv("ROLLSTREAM_REDIS__WAIT_REPLICAS", "0")
    assert load_settings().redis.wait_replicas == 0


def test_the_sentinels_password_in_the_query_is_redacted_too() -> None:
    shown = redact_url("redis+sentinel://:data-pw@h1:26379/mymaster?sentinel_password=sentinel-pw")
    assert "data-pw" not in shown and "sentinel-pw" not in shown and "sentinel_password=***" in shown
