"""The shipped alert rules on a real Prometheus over a real healthy formation, with the
real Redis exporter (Debian's prometheus-redis-exporter) beside a primary Redis and its
replica, as every layout runs it: while the run trains, nothing fires but the watchdog,
which must, and what went pending at the start (no train step yet, no producer heartbeat
yet) resolves. And the exporter serves every name and label the rules and the dashboard
use of it (tests/redis_exporter.py), which the unit tests check the rules against.
Prometheus and the exporter are Debian's packages (`make test` installs them where it
can): skipped where missing, failing in CI."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis, free_port
from tests.helpers import wait_for
from tests.integration.test_prometheus import Prometheus, get, prometheus_binary
from tests.redis_exporter import (
    EXPORTER_METRICS,
    ON_PRIMARY_WITH_REPLICA,
    ON_REPLICA,
    Exporter,
    exporter_binary,
)
from tests.unit.test_alert_rules import RULES, WATCHDOG, rules
from tests.unit.test_dashboard import DASHBOARD, queries

pytestmark = pytest.mark.integration

SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", re.MULTILINE)
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')
EVALUATIONS = 30  # rule evaluations (one a second) the formation runs healthy through
# what may go pending while a run starts, and must then resolve: no train step yet (with
# groups waiting or none), no producer heartbeat yet, the metrics process not scraped yet,
# processes started after it not up yet. Nothing of Redis's, nothing else.
STARTING = {
    "RollstreamTrainerStalled",
    "RollstreamRunStalledEmptyBuffer",
    "RollstreamNoProducers",
    "RollstreamRunMetricsMissing",
    "RollstreamTargetDown",
}


PASSWORD = secrets.token_hex(24)


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    """A primary with an append-only file, a maxmemory and a password, as deploy/redis.conf
    and the layouts set them, and a replica of it that has caught up."""
    primary, replica = EmbeddedRedis().start(), EmbeddedRedis().start()
    try:
        to_primary = redis.Redis(port=primary.port)
        to_primary.config_set("maxmemory", "1gb")
        to_primary.config_set("appendonly", "yes")
        to_primary.config_set("requirepass", PASSWORD)
        to_replica = redis.Redis(port=replica.port)
        to_replica.config_set("masterauth", PASSWORD)
        to_replica.replicaof("127.0.0.1", primary.port)
        to_replica.config_set("requirepass", PASSWORD)
        to_replica = redis.Redis(port=replica.port, password=PASSWORD)
        wait_for(lambda: to_replica.info("replication")["master_link_status"] == "up", timeout=60)
        to_primary.close()
        to_replica.close()
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


def served(text: str) -> dict[str, set[str]]:
    """Each series name in an exposition, with the labels it has."""
    names: dict[str, set[str]] = {}
    for name, labels in SERIES.findall(text):
        names.setdefault(name, set()).update(LABEL.findall(labels or ""))
    return names


def test_the_exporter_serves_every_name_the_rules_and_dashboard_use(
    replicated: tuple[EmbeddedRedis, EmbeddedRedis], tmp_path: Path
) -> None:
    exporters = [Exporter(r.url, tmp_path / f"exporter-{i}.log", PASSWORD) for i, r in enumerate(replicated)]
    try:
        # the primary's exporter sees its replica once the replica has acknowledged
        on_primary = wait_for(
            lambda: (s := served(exporters[0].scrape())).get("redis_connected_slave_offset_bytes") and s,
            timeout=60,
        )
        texts = [exporter.scrape() for exporter in exporters]
        on_replica = served(texts[1])
    finally:
        for exporter in exporters:
            exporter.stop()
    for name, labels in EXPORTER_METRICS.items():
        where = on_replica if name in ON_REPLICA else on_primary
        assert name in where, f"{name}: not served by prometheus-redis-exporter"
        assert labels <= where[name], (name, sorted(where[name]))
    assert not set(ON_PRIMARY_WITH_REPLICA) & set(on_replica)
    assert set(on_primary["redis_up"]) == set()  # nothing but job and instance, as the rules join
    # each reached its Redis with the password from its environment
    assert all(re.search(r"^redis_up 1$", text, re.MULTILINE) for text in texts)
    # not vacuous: a name from memory that the exporter does not serve is not in it
    assert "redis_memory_max_bytes" in on_primary and "redis_maxmemory_bytes" not in on_primary


def rule_evaluations(prometheus: Prometheus) -> float:
    """How many times Prometheus has evaluated the rules' group (its own /metrics)."""
    with urllib.request.urlopen(f"{prometheus.url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(r'prometheus_rule_group_iterations_total\{rule_group="[^"]*;rollstream"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def alerts(prometheus: Prometheus) -> dict[str, set[str]]:
    """The alerts Prometheus holds now: each name with its states (pending, firing)."""
    held: dict[str, set[str]] = {}
    for alert in get(f"{prometheus.url}/api/v1/alerts")["data"]["alerts"]:
        held.setdefault(alert["labels"]["alertname"], set()).add(alert["state"])
    return held


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_alert_fires_over_a_healthy_formation(
    replicated: tuple[EmbeddedRedis, EmbeddedRedis], run_name: str, tmp_path: Path
) -> None:
    binary, _ = prometheus_binary(), exporter_binary()
    primary = replicated[0]
    ports = {f"rollstream_{role}": free_port() for role in ("producer", "trainer", "metrics")}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS", "PORT"))}
    env.update(
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_REDIS__URL=primary.url.replace("redis://", f"redis://:{PASSWORD}@"),
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
        ROLLSTREAM_ROLLOUT__BATCH_SIZE="4",
        ROLLSTREAM_ENGINES__COUNT="2",
        ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="20",
        ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS="200",
        ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
        ROLLSTREAM_PRODUCER__HEARTBEAT_S="0.5",
    )
    prompts = tmp_path / "math.jsonl"
    prompts.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "{i} + 1?", "answer": "{i + 1}"}}\n' for i in range(500))
    )
    cli = [sys.executable, "-m", "rollstream.cli.main"]
    fed = subprocess.run(
        [*cli, "feed", str(prompts), "--task", "math"], env=env, capture_output=True, timeout=60
    )
    assert fed.returncode == 0, fed.stderr[-2000:]

    exporters = [Exporter(r.url, tmp_path / f"exporter-{i}.log", PASSWORD) for i, r in enumerate(replicated)]
    ports.update(redis_primary=exporters[0].port, redis_replica=exporters[1].port)
    prometheus = Prometheus(binary, tmp_path, ports, rules=RULES)
    commands = {
        "rollstream_metrics": ["metrics"],
        "rollstream_producer": ["produce", "--local-engines"],
        "rollstream_trainer": ["train", "--steps", "100000", "--step-time", "0.5"],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        wait_for(prometheus.ready, 120, 0.5)
        for job, args in commands.items():
            with (tmp_path / f"{job}.log").open("wb") as log:
                procs[job] = subprocess.Popen(
                    [*cli, *args], env={**env, "PORT": str(ports[job])}, stdout=log, stderr=subprocess.STDOUT
                )
        said = lambda job: (tmp_path / f"{job}.log").read_text()[-3000:]  # noqa: E731
        run = f'run="{run_name}"'
        # the run trains: its step rises, as Prometheus sees it
        wait_for(lambda: (prometheus.scalar(f"rollstream_train_step{{{run}}}") or 0) >= 3, 180, 0.5)
        start = rule_evaluations(prometheus)
        wait_for(lambda: rule_evaluations(prometheus) >= start + EVALUATIONS, 180, 0.5)
        for job, proc in procs.items():
            assert proc.poll() is None, f"{job} exited:\n{said(job)}"

        # what went pending at the start resolves: the watchdog alone, firing
        held: list[dict[str, set[str]]] = []
        try:
            wait_for(lambda: held.append(alerts(prometheus)) or held[-1] == {WATCHDOG: {"firing"}}, 120, 0.5)
        except AssertionError:
            raise AssertionError(f"alerts held: {held[-1]}") from None
        seen = prometheus.query(
            f'count by (alertname) (count_over_time(ALERTS{{alertname!="{WATCHDOG}"}}[30m]))'
        )
        pending = {s["metric"]["alertname"] for s in seen}
        assert pending <= STARTING, sorted(pending - STARTING)
        # and nothing fired at any evaluation of the run, from the first
        fired = prometheus.query(
            f'count_over_time(ALERTS{{alertstate="firing", alertname!="{WATCHDOG}"}}[30m])'
        )
        assert not fired, [alert["metric"] for alert in fired]
        assert (
            prometheus.scalar(f'max_over_time(ALERTS{{alertname="{WATCHDOG}", alertstate="firing"}}[30m])')
            == 1
        )
        # every rule was evaluated without an error, on series that exist: the exporter's
        # names the rules use are among those Prometheus scraped from it
        groups = get(f"{prometheus.url}/api/v1/rules")["data"]["groups"]
        assert sum(len(group["rules"]) for group in groups) == len(rules())
        assert all(rule["health"] == "ok" for group in groups for rule in group["rules"]), groups
        used = {name for rule in rules() for name in EXPORTER_METRICS if name in rule["expr"]}
        for name in used:
            jobs = {series["metric"]["job"] for series in prometheus.query(name)}
            want = {"redis_replica"} if name in ON_REPLICA else {"redis_primary"}
            assert want <= jobs, (name, jobs)
        for target in get(f"{prometheus.url}/api/v1/targets")["data"]["activeTargets"]:
            assert target["health"] == "up", target
        # the dashboard's Redis panels show this primary and its replica
        for expr in queries(json.loads(DASHBOARD.read_text()), variables=False):
            if "$redis" in expr:
                promql = expr.replace("$redis", ".*").replace("$__rate_interval", "1m")
                assert prometheus.query(promql), expr

        for proc in procs.values():  # each stops on SIGTERM, with 0
            proc.send_signal(signal.SIGTERM)
        for job, proc in procs.items():
            assert proc.wait(timeout=60) == 0, said(job)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        prometheus.stop()
        for exporter in exporters:
            exporter.stop()
