"""`rollstream engines scale N` without an engines process (detached engines): the
command scales the run's engine actors itself, on the Ray cluster the run recorded,
and records the count serving for producers."""

from __future__ import annotations

import threading

import pytest
import ray
import redis

from rollstream.cli.engines import engines_scale
from rollstream.producer.fleet.actors import actor_name, engine_indices, namespace
from rollstream.producer.fleet.pool import EnginePool
from rollstream.producer.fleet.scaling import ENGINES_SERVING, EngineCount
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from tests.conftest import SettingsFactory

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_local")]


def test_scale_without_an_engines_process_scales_the_detached_engines(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = make_settings(
        redis_server.url, engines={"count": 2, "num_cpus": 0, "sim": {"time_compression": 100.0}}
    )
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(settings.run)
    EnginePool.start(settings.run, settings.engines)  # detached, as `rollstream engines` leaves them
    RunControl(client, keys).set_ray_address(str(ray.get_runtime_context().gcs_address))
    count = EngineCount(client, keys)
    count.set_autoscale(1, 4)
    try:
        assert engines_scale(settings, 3, wait=False, stop=threading.Event()) == 0
        assert count.autoscale() is None  # the operator's count wins over an autoscale rule
        assert engine_indices(settings.run) == {0, 1, 2}
        assert (count.wanted(), count.serving()) == (3, 3)
        handle = ray.get_actor(actor_name(settings.run, 2), namespace=namespace(settings.run))
        assert ray.get(handle.health.remote(), timeout=30)

        assert engines_scale(settings, 1, wait=False, stop=threading.Event()) == 0
        assert engine_indices(settings.run) == {0}
        assert (count.wanted(), count.serving()) == (1, 1)
        assert "1 engines serving" in capsys.readouterr().out
    finally:
        EnginePool.stop(settings.run, settings.engines.count)
        client.close()


def test_a_corrupt_engine_count_names_the_key_and_the_repair(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory
) -> None:
    from rollstream.shared.errors import CorruptValueError

    settings = make_settings(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(settings.run)
    client.hset(keys.state, ENGINES_SERVING, "many")
    with pytest.raises(CorruptValueError, match="engines scale"):
        EngineCount(client, keys).serving()
    with pytest.raises(ValueError, match="1 to 4096"):
        EngineCount(client, keys).want(0)
    client.close()


def test_scale_needs_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    from rollstream.cli.main import main

    assert main(["engines", "scale"]) == 2
    assert "usage: rollstream engines scale N" in capsys.readouterr().err


def test_scale_min_max_sets_the_autoscale_rule(
    redis_server: EmbeddedRedis, run_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollstream.cli.main import main

    common = ["--redis-url", redis_server.url, "--run", run_name, "engines", "scale"]
    assert main([*common, "--min", "2", "--max", "8"]) == 0
    assert "autoscale between 2 and 8" in capsys.readouterr().out
    client = redis.Redis.from_url(redis_server.url)
    assert EngineCount(client, Keys(run_name)).autoscale() == (2, 8)
    client.close()
    for bad in (["--min", "3"], ["--min", "5", "--max", "2"], ["4", "--min", "1", "--max", "2"]):
        assert main([*common, *bad]) == 2, bad
        assert "engines scale --min A --max B" in capsys.readouterr().err
