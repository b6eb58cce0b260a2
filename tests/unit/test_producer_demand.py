"""The producers' scaling figure (producer/fleet/demand.py) that KEDA scales the
producers on: one producer more only while the trainer waits, the producers are full,
the engines have room and the staleness bound admits more than the producers hold; one
fewer while the bound holds the work back or none waits; read from the run in Redis and
answered as JSON on the metrics server's /keda."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest
import redis

from rollstream.cli.metrics import demand_plan
from rollstream.producer.fleet.demand import (
    MAX_PRODUCERS,
    Demand,
    DemandReader,
    keda_answer,
    producers_wanted,
)
from rollstream.producer.fleet.scaling import ENGINES_BUSY, EngineCount
from rollstream.shared.events import RunControl
from rollstream.shared.json_routes import route, routed
from rollstream.shared.keys import Keys
from rollstream.shared.runconfig import open_buffer
from tests.conftest import SettingsFactory
from tests.helpers import prompts

# four producers of 8 groups each, all 32 slots in use, 40 claimable prompts, an empty
# groups stream (the trainer waits), engines at half their capacity
STARVED = Demand(producers=4, inflight=32, max_inflight=8, waiting=40, claimable=40, ready=0, batch=16,
                 engines_busy=0.5)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "wanted", "why"),
    [
        ({}, 5, "the trainer waits"),  # too few producers: one more
        ({"engines_busy": None}, 5, "the trainer waits"),  # no engines' figure: not saturated
        ({"engines_busy": 0.95}, 4, "saturated"),  # more producers would only queue on them
        ({"ready": 16}, 4, "batch ready"),  # the trainer is not waiting
        ({"inflight": 12}, 4, "free slots"),  # the producers are not full: more would idle too
        # the staleness bound admits nothing: the work held now needs 2 producers, one fewer
        ({"inflight": 12, "claimable": 0}, 3, "staleness bound"),
        ({"inflight": 0, "waiting": 0, "claimable": 0}, 3, "too little work"),  # nothing to do
        ({"claimable": 0}, 4, "hold what may be in flight"),  # full, nothing more admitted
        ({"paused": True, "inflight": 0}, 4, "paused"),
    ],
)
def test_the_rule_steps_once_towards_what_the_run_asks(change: dict[str, Any], wanted: int, why: str) -> None:
    got, reason = producers_wanted(replace(STARVED, **change))
    assert got == wanted
    assert why in reason


def test_no_producers_yet_asks_for_one_when_work_is_claimable() -> None:
    none_yet = replace(STARVED, producers=0, inflight=0)
    assert producers_wanted(none_yet) == (1, "the trainer waits, the producers are full, work is claimable")
    assert producers_wanted(none_yet, low=0)[0] == 1
    idle = replace(none_yet, waiting=0, claimable=0)
    assert producers_wanted(idle, low=0)[0] == 0  # scale to zero: nothing to do
    assert producers_wanted(idle)[0] == 1  # the default bound keeps one


def test_a_step_is_an_eighth_of_the_producers_alive_so_that_the_hpa_takes_it() -> None:
    # the HPA ignores a figure within 10% of the replicas: from 20, 21 would never be taken
    many = replace(STARVED, producers=20, inflight=160, claimable=400)
    assert producers_wanted(many)[0] == 23
    assert producers_wanted(replace(many, claimable=8))[0] == 21  # never past what the run needs
    held = replace(many, inflight=40, claimable=0)  # 40 groups fill 5 producers
    assert producers_wanted(held) == (17, "the staleness bound holds the work back")
    assert producers_wanted(replace(held, producers=6))[0] == 5


def test_the_figure_stays_within_the_bounds() -> None:
    assert producers_wanted(STARVED, 1, 4) == (4, "the trainer waits, the producers are full, work is "
                                                   "claimable; bounded to 1 .. 4")  # fmt: skip
    assert producers_wanted(replace(STARVED, producers=9, inflight=0, claimable=0, waiting=0), 1, 4)[0] == 4
    assert producers_wanted(replace(STARVED, producers=1, inflight=0, claimable=0), 2, 4)[0] == 2
    assert producers_wanted(STARVED)[0] <= MAX_PRODUCERS
    with pytest.raises(ValueError, match="min <= max"):
        producers_wanted(STARVED, 5, 3)


def _reader(client: redis.Redis, make_settings: SettingsFactory, **rollout: Any) -> DemandReader:
    settings = make_settings(
        tasks=[{"name": "math", "n": 2}], rollout={"batch_size": 4, "max_staleness": 0, **rollout},
        producer={"max_inflight": 3},
    )  # fmt: skip
    return DemandReader(client, Keys(settings.run), demand_plan(settings, producer_max_age_s=30.0))


def test_the_reader_sees_producers_work_waiting_and_the_admission_room(
    fake_client: redis.Redis, make_settings: SettingsFactory
) -> None:
    reader = _reader(fake_client, make_settings)
    empty = reader.read()  # a run with nothing yet
    assert (empty.producers, empty.waiting, empty.claimable, empty.ready) == (0, 0, 0, 0)
    assert (empty.max_inflight, empty.batch, empty.engines_busy) == (3, 4, None)

    settings = make_settings(tasks=[{"name": "math", "n": 2}], rollout={"batch_size": 4, "max_staleness": 0})
    buffer = open_buffer(fake_client, settings, "p1")
    buffer.feed(prompts("math", 10))
    # the bound at model step 0: (0 + stale_threshold 1) x batch 4 = 4 groups
    claims = buffer.claim("math", 3, limit=4)
    assert len(claims) == 3
    RunControl(fake_client, Keys(settings.run)).publish_status("p1", 0, 3)
    demand = reader.read()
    assert (demand.producers, demand.inflight) == (1, 3)
    assert demand.waiting == 7
    assert demand.claimable == 1  # the bound lets one more in
    # the one producer is full and the bound admits one group more: a second producer
    assert producers_wanted(demand) == (2, "the trainer waits, the producers are full, work is claimable")
    assert len(open_buffer(fake_client, settings, "p2").claim("math", 3, limit=4)) == 1
    RunControl(fake_client, Keys(settings.run)).publish_status("p2", 0, 1)
    held_back = reader.read()
    assert (held_back.producers, held_back.inflight, held_back.claimable, held_back.waiting) == (2, 4, 0, 6)
    # 4 groups in flight fill 2 producers of 3: the bound holds the 6 others back
    assert producers_wanted(held_back) == (2, "the producers hold what may be in flight")

    EngineCount(fake_client, Keys(settings.run)).publish_busy(0.97)
    assert reader.read().engines_busy == pytest.approx(0.97)
    seconds, _ = fake_client.time()
    fake_client.hset(Keys(settings.run).state, ENGINES_BUSY, orjson.dumps({"busy": 0.5, "ts": seconds - 600}))
    assert reader.read().engines_busy is None  # the engines process is gone: not used


def test_keda_answers_with_the_figure_and_names_a_bad_bound(
    fake_client: redis.Redis, make_settings: SettingsFactory
) -> None:
    reader = _reader(fake_client, make_settings)
    status, body = keda_answer(reader, {"min": ["2"], "max": ["6"]})
    assert status == 200
    assert (body["producers_wanted"], body["min"], body["max"], body["producers"]) == (2, 2, 6, 0)
    assert body["reason"]
    assert keda_answer(reader, {"min": ["-1"]}) == (
        400, {"error": "min is '-1', not a count of producers (0 or more)"}
    )  # fmt: skip
    assert keda_answer(reader, {"min": ["5"], "max": ["2"]}) == (400, {"error": "min 5 is above max 2"})
    down = DemandReader(redis.Redis(port=1, socket_connect_timeout=0.5), reader.keys, reader.plan)
    status, body = keda_answer(down, {})
    assert status == 503
    assert "cannot read run" in body["error"]


def test_the_metrics_server_answers_a_route_as_json_and_the_rest_as_before() -> None:
    seen: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen.append(status)

    app = routed(lambda environ, start: [b"metrics"])
    remove = route("/test-route", lambda query: (200, {"asked": query.get("x", [""])[0]}))
    try:
        body = app({"PATH_INFO": "/test-route", "QUERY_STRING": "x=1"}, start_response)
        assert orjson.loads(b"".join(body)) == {"asked": "1"}
        assert seen == ["200 OK"]
        assert app({"PATH_INFO": "/metrics"}, start_response) == [b"metrics"]
        route("/failing", lambda query: 1 / 0)  # type: ignore[arg-type,return-value]
        body = app({"PATH_INFO": "/failing"}, start_response)
        assert seen[-1].startswith("500")
        assert "ZeroDivisionError" in orjson.loads(b"".join(body))["error"]
    finally:
        remove()
        route("/failing", lambda query: (200, {}))()
    assert app({"PATH_INFO": "/test-route"}, start_response) == [b"metrics"]


def test_a_refused_read_is_an_error_not_a_zero(
    fake_client: redis.Redis, make_settings: SettingsFactory
) -> None:
    """A user that may not read a stream (NOPERM) must not read as an idle run: /keda
    answers 503 naming it, and KEDA keeps the replicas it has."""
    reader = _reader(fake_client, make_settings)
    real = fake_client.pipeline

    def refusing(**kwargs: Any) -> Any:
        pipe = real(**kwargs)
        execute = pipe.execute

        def refused(raise_on_error: bool = True) -> list[Any]:
            replies = execute(raise_on_error=raise_on_error)
            return [*replies[:3], redis.exceptions.NoPermissionError("NOPERM no XLEN for you"), *replies[4:]]

        pipe.execute = refused  # type: ignore[method-assign]
        return pipe

    fake_client.pipeline = refusing  # type: ignore[method-assign]
    status, body = keda_answer(reader, {})
    assert status == 503 and "NOPERM" in body["error"], body
