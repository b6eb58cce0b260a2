"""What `rollstream status --watch` warns about and the rates it shows, on fakeredis."""

from __future__ import annotations

import redis

from rollstream.cli.watch import Watcher, eta, headline, plain
from rollstream.shared.keys import Count, Keys, progress_field
from rollstream.shared.liveness import Liveness
from tests.conftest import SettingsFactory


def test_the_warnings_an_operator_acts_on(make_settings: SettingsFactory, fake_client: redis.Redis) -> None:
    settings = make_settings(rollout={"max_staleness": 0})  # stale_threshold 1
    client, keys = fake_client, Keys(settings.run)
    client.hset(keys.state, mapping={"model_step": 2, "train_step": 3, "paused": "1"})
    client.xadd(keys.dead, {"reason": "judge failed"})
    watcher = Watcher(settings, client)
    view = watcher.view()
    assert view.warnings == (
        "the run is PAUSED: producers claim nothing (`rollstream resume`)",
        "STUCK: a group made now is 1 steps stale, it expires at 1 (`rollstream steps` says how to repair)",
        "no producer alive",
        "no trainer alive",
        "1 dead letters (`rollstream show dead`)",
    )
    assert "  WARNING no trainer alive" in plain(view)


def test_rates_come_from_what_moved_between_two_refreshes(
    make_settings: SettingsFactory, fake_client: redis.Redis
) -> None:
    settings = make_settings()
    client, keys = fake_client, Keys(settings.run)
    client.hset(keys.state, mapping={"model_step": 1, "train_step": 1})
    watcher = Watcher(settings, client)
    first = watcher.view()
    assert first.steps_per_min is None and first.groups_per_s is None  # nothing to compare with yet
    client.hset(keys.state, "train_step", 3)
    client.hincrby(keys.progress, progress_field("math", Count.COMPLETED), 10)
    second = watcher.view()
    assert second.steps_per_min is not None and second.steps_per_min > 0
    assert second.groups_per_s is not None and second.groups_per_s > 0
    assert second.trained_per_s == 0


def test_the_eta_comes_from_the_trainer_s_steps_left_and_the_step_rate(
    make_settings: SettingsFactory, fake_client: redis.Redis
) -> None:
    settings = make_settings()
    client, keys = fake_client, Keys(settings.run)
    client.hset(keys.state, mapping={"model_step": 1, "train_step": 1})
    Liveness(client, keys, "trainer", "trainer", 60).beat(step=1, steps_left=9)
    watcher = Watcher(settings, client)
    assert eta(watcher.view()) == ", 9 steps left"  # no rate yet
    client.hset(keys.state, "train_step", 2)
    view = watcher.view()
    assert view.steps_per_min
    assert eta(view).startswith(", 9 steps left, ETA ")
    assert ", 9 steps left, ETA " in headline(view)
