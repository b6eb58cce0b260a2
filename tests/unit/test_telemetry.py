"""Prometheus metrics: where a process serves them (metrics.port, $PORT), the per-process
figures it counts, and the run collector's figures read from Redis (fakeredis here; the
real server in tests/integration/test_metrics.py)."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import urllib.request
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from rollstream.producer.engines.base import EngineHealth
from rollstream.shared import telemetry
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.embedded import free_port
from rollstream.shared.errors import SettingsError
from rollstream.shared.events import RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.runmetrics import RunCollector, exported_names
from rollstream.shared.settings import MetricsSettings
from tests.conftest import CI, BufferFactory, SettingsFactory
from tests.helpers import group_for, prompts


def test_the_port_comes_from_the_setting_else_from_PORT_else_none() -> None:
    unset = MetricsSettings()
    assert telemetry.metrics_port(unset, {}) is None
    assert telemetry.metrics_port(unset, {"PORT": "5100"}) == (5100, "$PORT")
    assert telemetry.metrics_port(MetricsSettings(port=9400), {"PORT": "5100"})[0] == 9400
    assert telemetry.metrics_port(MetricsSettings(port=0), {"PORT": "5100"}) is None  # 0: off


@pytest.mark.parametrize("bad", ["web", "0", "70000", "-1"])
def test_a_bad_PORT_is_a_settings_error_that_names_it(bad: str) -> None:
    with pytest.raises(SettingsError, match=r"\$PORT is .*metrics\.port \(ROLLSTREAM_METRICS__PORT\)"):
        telemetry.metrics_port(MetricsSettings(), {"PORT": bad})


def test_a_bad_metrics_port_setting_is_refused(make_settings: SettingsFactory) -> None:
    with pytest.raises(SettingsError, match=r"metrics\.port"):
        make_settings(metrics={"port": 70000})


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def test_a_process_serves_its_figures_labelled_with_run_and_role(make_settings: SettingsFactory) -> None:
    port = free_port()
    settings = make_settings(metrics={"port": port, "host": "127.0.0.1"})
    with telemetry.serving(settings.metrics, settings.run, "producer") as served:
        assert served == port
        telemetry.group_finished("math", "completed", 4)
        telemetry.outage(2.5)
        body = _scrape(port)
    run = settings.run
    assert (
        f'rollstream_groups_produced_total{{outcome="completed",role="producer",run="{run}",task="math"}} 1.0'
        in body
    )
    samples = f'{{outcome="completed",role="producer",run="{run}",task="math"}} 4.0'
    assert f"rollstream_samples_produced_total{samples}" in body
    assert f'rollstream_redis_outage_seconds_total{{role="producer",run="{run}"}} 2.5' in body
    with pytest.raises(OSError):  # stopped with the block
        _scrape(port)


def test_a_taken_port_is_an_error_line_and_the_process_goes_on(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = make_settings(metrics={"port": port, "host": "127.0.0.1"})
        with (
            caplog.at_level(logging.ERROR),
            telemetry.serving(settings.metrics, settings.run, "trainer") as served,
        ):
            assert served is None
        assert f"cannot serve metrics on 127.0.0.1:{port} (from metrics.port" in caplog.text
        with (
            pytest.raises(SettingsError, match=f"127.0.0.1:{port}"),
            telemetry.serving(settings.metrics, settings.run, "metrics", required=True),
        ):
            pass  # the metrics process, on a port named explicitly: an error


def test_a_taken_PORT_leaves_even_the_metrics_process_running(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two formations on one machine, both started by a process manager on its default
    ports: the second goes on, its metrics process says why it serves nothing."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        monkeypatch.setenv("PORT", str(taken.getsockname()[1]))
        with (
            caplog.at_level(logging.ERROR),
            telemetry.serving(make_settings().metrics, "run", "metrics", required=True) as served,
        ):
            assert served is None
    assert "(from $PORT)" in caplog.text and "going on without them" in caplog.text


def test_the_per_group_figures_follow_the_identity_of_the_process(run_name: str) -> None:
    value = telemetry.REGISTRY.get_sample_value
    for role in ("producer", "judge", "producer"):  # the labelled children are reused, per identity
        telemetry.identify(run_name, role)
        telemetry.group_finished("math", "filtered", 8)
        telemetry.group_generated("math", 0.5)
        telemetry.judge_failed("code")
    producer, judge = {"run": run_name, "role": "producer"}, {"run": run_name, "role": "judge"}
    filtered = {"task": "math", "outcome": "filtered"}
    assert value("rollstream_groups_produced_total", {**producer, **filtered}) == 2
    assert value("rollstream_samples_produced_total", {**producer, **filtered}) == 16
    assert value("rollstream_groups_produced_total", {**judge, **filtered}) == 1
    assert value("rollstream_group_generation_seconds_count", {**producer, "task": "math"}) == 2
    assert value("rollstream_judge_failures_total", {**judge, "task": "code"}) == 1
    assert (
        value("rollstream_groups_produced_total", {**producer, "task": "math", "outcome": "completed"})
        is None
    )


def test_inflight_requests_show_the_engines_the_pool_has_at_each_scrape(run_name: str) -> None:
    telemetry.identify(run_name, "producer")
    outstanding = [2, 0, 1]  # a producer's pool: engines join and leave while it runs
    telemetry.track_inflight(lambda: 5, lambda: outstanding)

    def scraped() -> dict[str, float]:
        families = {m.name: m for m in telemetry.REGISTRY.collect()}  # raises if a figure cannot be read
        samples = families["rollstream_inflight_requests"].samples
        return {s.labels["engine"]: s.value for s in samples if s.labels["run"] == run_name}

    assert scraped() == {"0": 2.0, "1": 0.0, "2": 1.0}
    outstanding.append(4)  # scaled out
    assert scraped() == {"0": 2.0, "1": 0.0, "2": 1.0, "3": 4.0}
    del outstanding[1:]  # scaled in: the retired engines left the pool
    assert scraped() == {"0": 2.0}
    assert (
        telemetry.REGISTRY.get_sample_value(
            "rollstream_inflight_groups", {"run": run_name, "role": "producer"}
        )
        == 5
    )


def test_the_trainer_figures(make_settings: SettingsFactory) -> None:
    settings = make_settings()
    telemetry.identify(settings.run, "trainer")
    telemetry.train_step(
        7, 0.25, 1.5, {"math": 3, "code": 1}, {0: 3, 2: 1}, 2, {"approx_kl": 0.01, "loss": None}
    )
    value = telemetry.REGISTRY.get_sample_value
    base = {"run": settings.run, "role": "trainer"}
    assert value("rollstream_trainer_step", base) == 7
    assert value("rollstream_groups_trained_total", {**base, "task": "math"}) == 3
    assert value("rollstream_groups_expired_total", base) == 2
    assert value("rollstream_trained_group_staleness_count", base) == 4
    assert value("rollstream_trained_group_staleness_bucket", {**base, "le": "0.0"}) == 3
    assert value("rollstream_trained_group_staleness_bucket", {**base, "le": "1.0"}) == 3
    assert value("rollstream_trained_group_staleness_bucket", {**base, "le": "2.0"}) == 4
    assert value("rollstream_trainer_kl", base) == 0.01
    assert value("rollstream_train_step_seconds_sum", base) == 0.25


def _collect(client: redis.Redis, settings_run: str, tasks: list[str]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RunCollector(client, Keys(settings_run), tasks, producer_max_age_s=60))
    return registry


def test_the_run_collector_reports_what_redis_holds(fake_buffer: BufferFactory) -> None:
    producer: ReplayBuffer = fake_buffer("p1")
    run = producer.keys.run
    producer.feed(prompts("math", 5))
    claims = producer.claim("math", 3)
    producer.complete(claims[0], group_for(claims[0].prompt))
    producer.complete(claims[1], group_for(claims[1].prompt))
    RunControl(producer.client, producer.keys).publish_status("p1", 0, 1)
    trainer = fake_buffer("trainer")
    trainer.read_batch("math", 1)  # one of the two groups pending with the trainer
    producer.client.hset(producer.keys.state, mapping={"model_step": 3, "train_step": 4})

    registry = _collect(producer.client, run, ["math", "code"])
    value = registry.get_sample_value
    math, code = {"run": run, "task": "math"}, {"run": run, "task": "code"}
    assert value("rollstream_run_up", {"run": run}) == 1
    assert value("rollstream_stream_prompts_entries", math) == 3  # 5 fed, 2 completed
    assert value("rollstream_stream_prompts_pending", math) == 1
    assert value("rollstream_stream_prompts_lag", math) == 2
    assert value("rollstream_stream_groups_entries", math) == 2
    assert value("rollstream_stream_groups_pending", math) == 1
    assert value("rollstream_stream_groups_lag", math) == 1
    assert value("rollstream_stream_groups_oldest_pending_age_seconds", math) >= 0
    assert value("rollstream_stream_prompts_entries", code) == 0  # a stream not made yet
    assert value("rollstream_stream_groups_oldest_pending_age_seconds", code) is None
    assert value("rollstream_progress_fed_total", math) == 5
    assert value("rollstream_progress_completed_total", math) == 2
    assert value("rollstream_progress_fed_total", code) == 0
    assert value("rollstream_model_step", {"run": run}) == 3
    assert value("rollstream_train_step", {"run": run}) == 4
    assert value("rollstream_producers_alive", {"run": run}) == 1
    assert value("rollstream_producer_model_step_min", {"run": run}) == 0
    assert value("rollstream_dead_letters", {"run": run}) == 0
    assert _sample_names(registry) <= exported_names()


def test_every_figure_passes_promtools_lint_of_names_and_types(fake_buffer: BufferFactory) -> None:
    """promtool check metrics (Prometheus' own lint: a counter ends in _total, a unit is a
    base unit, no _sum / _count / _bucket on what is not a summary or histogram) on a
    scrape of every figure: each process's, the engines' and the run collector's."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if CI:
            raise RuntimeError("no promtool: CI installs Debian's prometheus package (make test does)")
        pytest.skip("no promtool (apt-get install prometheus)")
    producer: ReplayBuffer = fake_buffer("p1")
    run = producer.keys.run
    producer.feed(prompts("math", 2))
    claim = producer.claim("math", 1)[0]
    producer.complete(claim, group_for(claim.prompt))  # the progress counters, reward included
    telemetry.identify(run, "producer")
    telemetry.group_finished("math", "completed", 4)
    telemetry.group_generated("math", 0.5)
    telemetry.group_completed("math", 64)
    telemetry.judged("math", 0.1)
    telemetry.judge_failed("math")
    telemetry.admission_wait("math")
    telemetry.weight_synced(1, 0.2, 0.3)
    telemetry.track_inflight(lambda: 1, lambda: [1, 0])
    telemetry.outage(1.0)
    telemetry.archive_trimmed(1)
    telemetry.archive_written("trained", 2)
    telemetry.archive_lag(3)
    figures = {name: 0.5 for name in telemetry.TRAINER_FIGURES}
    telemetry.train_step(2, 0.25, 1.0, {"math": 1}, {0: 1}, 1, figures)
    engines = CollectorRegistry()
    engines.register(telemetry.EngineCollector(lambda: [EngineHealth(True, 1, False, 2, 2, 0, 0.5)]))
    scrapes = [telemetry.REGISTRY, engines, _collect(producer.client, run, ["math"])]
    exposition = b"".join(generate_latest(registry) for registry in scrapes)
    assert b"rollstream_progress_reward_scores{" in exposition and b"rollstream_engine_up{" in exposition
    lint = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert lint.returncode == 0, (lint.stdout + lint.stderr).decode()


def _sample_names(registry: CollectorRegistry) -> set[str]:
    """The metric names a scrape of ``registry`` shows."""
    lines = generate_latest(registry).decode().splitlines()
    return {line.split("{")[0].split(" ")[0] for line in lines if line and not line.startswith("#")}


def test_the_run_collector_says_when_redis_does_not_answer(run_name: str) -> None:
    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)
    registry = _collect(client, run_name, ["math"])
    assert registry.get_sample_value("rollstream_run_up", {"run": run_name}) == 0
    assert registry.get_sample_value("rollstream_model_step", {"run": run_name}) is None


def test_the_run_collector_reads_redis_in_one_round_trip(fake_buffer: BufferFactory) -> None:
    buffer = fake_buffer("p1")
    buffer.feed(prompts("math", 2))
    calls: list[int] = []
    client = buffer.client
    real = client.pipeline

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    client.pipeline = counting  # type: ignore[method-assign]
    registry = _collect(client, buffer.keys.run, ["math", "code"])
    assert (
        registry.get_sample_value("rollstream_progress_fed_total", {"run": buffer.keys.run, "task": "math"})
        == 2
    )
    assert len(calls) == 1


def test_the_engines_figures_are_asked_of_them_at_each_scrape(run_name: str) -> None:
    telemetry.identify(run_name, "engines")
    answers: list[list[Any]] = [
        [EngineHealth(True, 3, False, 5, 4, 1, 0.5, busy_total=0.75), None],
        [
            EngineHealth(True, 4, False, 0, 0, 0, 0.0, busy_total=0.5),
            EngineHealth(True, 4, False, 2, 2, 0, 0.2),
        ],
    ]
    registry = CollectorRegistry()
    registry.register(telemetry.EngineCollector(lambda: answers.pop(0)))
    engine = {"run": run_name, "role": "engines"}
    first = {m.name: {s.labels["engine"]: s.value for s in m.samples} for m in registry.collect()}
    assert first["rollstream_engine_up"] == {"0": 1.0, "1": 0.0}  # engine 1 did not answer
    assert first["rollstream_engine_outstanding_requests"] == {"0": 5.0}
    assert first["rollstream_engine_busy_ratio"] == {"0": 0.75}
    assert first["rollstream_engine_model_step"] == {"0": 3.0}
    assert (
        registry.get_sample_value("rollstream_engine_model_step", {**engine, "engine": "1"}) == 4
    )  # asked again
    assert (
        registry.get_sample_value("rollstream_engine_up", {**engine, "engine": "1"}) is None
    )  # a third: no reply


def test_a_probe_that_fails_is_a_warning_not_a_failed_scrape(
    run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    def probe() -> list[Any]:
        raise TimeoutError("engines gone")

    registry = CollectorRegistry()
    registry.register(telemetry.EngineCollector(probe))
    assert [m.samples for m in registry.collect()] == [[], [], [], []]
    assert "engines did not answer a probe: engines gone" in caplog.text


def test_the_counters_of_rare_events_start_at_zero(run_name: str) -> None:
    # an alert's increase() sees a counter's first event only when the series was there
    # before it, at 0 (deploy/prometheus/alerts.yml)
    value = telemetry.REGISTRY.get_sample_value
    me = {"run": run_name, "role": "trainer"}
    assert value("rollstream_redis_primary_changes_total", me) is None
    telemetry.identify(run_name, "trainer")
    assert value("rollstream_redis_outages_total", me) == 0
    assert value("rollstream_redis_outage_seconds_total", me) == 0
    assert value("rollstream_redis_primary_changes_total", me) == 0
    for reason in ("behind", "lost_commit"):
        assert value("rollstream_redis_replica_wait_failures_total", {**me, "reason": reason}) == 0
    telemetry.replicas_failed("behind")
    assert value("rollstream_redis_replica_wait_failures_total", {**me, "reason": "behind"}) == 1
