"""The alerting rules (deploy/prometheus/alerts.yml): promtool checks them and runs their
unit tests (alerts.test.yml: each alert fires on series made for it, and not before its
`for:` nor on healthy series), the Prometheus configs that load them pass `promtool check
config` (which loads the rules through their paths), and every metric and label the rules
name is one the code exports, or the Redis exporter beside Redis (tests/redis_exporter.py,
whose names tests/integration/test_redis_exporter.py checks against the real exporter).
promtool comes with Debian's prometheus package (`make test` installs it where it can): its
tests are skipped where it is missing, failing in CI."""

from __future__ import annotations

import posixpath
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollstream.consumer import replication
from rollstream.shared import runmetrics, telemetry
from tests.conftest import CI
from tests.redis_exporter import EXPORTER_LABELS, EXPORTER_METRICS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
CONFIGS = (DEPLOY / "prometheus.yml", DEPLOY / "compose" / "prometheus.yml")
COMPOSE = DEPLOY / "compose" / "compose.yaml"
NAME = re.compile(r"\brollstream_[a-z0-9_]+\b")
REDIS_NAME = re.compile(r"\bredis_[a-z0-9_]+\b")
# a label a rule groups or matches by: `by (a, b)`, `on (a)`, `without (a)`, `{a="..."}`
GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")
MATCHER = re.compile(r"[{,]\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
TEMPLATE_LABEL = re.compile(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)")
# the labels Prometheus gives every scraped series
TARGET_LABELS = {"job", "instance"}
SEVERITIES = {"page", "ticket"}
WATCHDOG = "RollstreamWatchdog"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if CI:
            raise RuntimeError("no promtool: CI installs Debian's prometheus package (make test does)")
        pytest.skip("no promtool (apt-get install prometheus)")
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def code_text() -> str:
    return "\n".join(Path(m.__file__).read_text() for m in (telemetry, runmetrics))


def rules() -> list[dict[str, Any]]:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    assert group["name"] == "rollstream"
    return list(group["rules"])


def test_promtool_checks_the_rules() -> None:
    done = run_promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_the_rules_pass_their_unit_tests() -> None:
    done = run_promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_unit_tests_catch_an_alert_that_does_not_fire(tmp_path: Path) -> None:
    """Not vacuous: the plain increase() of an event counter misses its first event (the
    series is made at 1), which the rules' `unless ... offset` branch catches."""
    broken = RULES.read_text()
    behind = 'rollstream_redis_replica_wait_failures_total{reason="behind"}'
    branch = re.compile(
        rf"\n\s*or\n\s*\(\n\s*{re.escape(behind)}\n\s*unless {re.escape(behind)} offset 10m\n\s*\)"
    )
    broken, found = branch.subn("", broken)
    assert found == 1
    (tmp_path / "alerts.yml").write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / "alerts.test.yml")
    done = run_promtool("test", "rules", str(tmp_path / "alerts.test.yml"))
    assert done.returncode != 0
    assert "alertname: RollstreamReplicasBehind, time: 7m" in done.stdout + done.stderr


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_the_prometheus_configs_load_the_rules(config: Path) -> None:
    (rule_file,) = yaml.safe_load(config.read_text())["rule_files"]
    assert (config.parent / rule_file).resolve() == RULES
    done = run_promtool("check", "config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout
    assert f"{len(rules())} rules found" in done.stdout


def test_compose_mounts_the_rules_where_its_config_names_them() -> None:
    (rule_file,) = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())["rule_files"]
    volumes = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]["volumes"]
    mounts = {}
    for volume in volumes:
        source, _, target = volume.removesuffix(":ro").partition(":")
        mounts[source] = target
    assert (COMPOSE.parent / mounts["./prometheus.yml"]).name == "prometheus.yml"
    # in the container the path is relative to the config's directory, as here
    config_dir = posixpath.dirname(mounts["./prometheus.yml"])
    rules_at = posixpath.normpath(posixpath.join(config_dir, rule_file))
    source = next(s for s, target in mounts.items() if target == rules_at)
    assert (COMPOSE.parent / source).resolve() == RULES


def test_every_metric_the_rules_use_is_one_the_code_exports() -> None:
    exported = telemetry.exported_names() | runmetrics.exported_names()
    used = {name for rule in rules() for name in NAME.findall(rule["expr"])}
    assert len(used) >= 10, used
    # as a scrape shows them: counters with _total, histograms' _bucket, _sum and _count
    assert not used - exported, sorted(used - exported)
    # the Redis exporter's, as tests/redis_exporter.py knows them (checked against the real one)
    from_exporter = {name for rule in rules() for name in REDIS_NAME.findall(rule["expr"])}
    assert len(from_exporter) >= 6, from_exporter
    assert not from_exporter - set(EXPORTER_METRICS), sorted(from_exporter - set(EXPORTER_METRICS))
    # and by the code's own text, each name without those suffixes (the streams' and the
    # progress counters' names are made from the keys' kinds and counters)
    code = code_text()
    for name in used:
        made = name.startswith(("rollstream_stream_", "rollstream_progress_"))
        assert made or re.sub(r"_(?:bucket|count|sum|total)$", "", name) in code, name


def test_every_label_the_rules_use_is_one_the_code_gives() -> None:
    code = code_text()
    used: set[str] = set()
    for rule in rules():
        for grouping in GROUPING.findall(rule["expr"]):
            used |= {label.strip() for label in grouping.split(",") if label.strip()}
        used |= set(MATCHER.findall(rule["expr"]))
        for text in rule["annotations"].values():
            used |= set(TEMPLATE_LABEL.findall(text))
    assert {"run", "task", "role", "instance", "engine", "reason"} <= used, used
    unknown = {label for label in used - TARGET_LABELS - EXPORTER_LABELS if f'"{label}"' not in code}
    assert not unknown, unknown
    # the reasons matched are the ones consumer/replication.py counts
    counted = set(re.findall(r'replicas_failed\("([a-z_]+)"\)', Path(replication.__file__).read_text()))
    reasons = {m for rule in rules() for m in re.findall(r'reason="([a-z_]+)"', rule["expr"])}
    assert reasons == counted == set(telemetry.REPLICA_WAIT_REASONS) == {"behind", "lost_commit"}


def about_a_run(rule: dict[str, Any]) -> bool:
    """A rule on a run's figures names the run; one on a Redis exporter's figures or on a
    target (one Redis serves every run on it) names the instance."""
    return not REDIS_NAME.search(rule["expr"]) and not re.search(r"\bup\{", rule["expr"])


def test_every_alert_says_how_bad_and_where_and_is_tested() -> None:
    tested: dict[str, bool] = {}
    quiet: set[str] = set()  # a check in alerts.test.yml where it does not fire
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            tested[check["alertname"]] = tested.get(check["alertname"], False) or bool(check["exp_alerts"])
            if not check["exp_alerts"]:
                quiet.add(check["alertname"])
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names))
    for rule in rules():
        name = rule["alert"]
        assert name.startswith("Rollstream"), name
        assert "for" in rule, name
        assert tested.get(name), f"{name}: no test in alerts.test.yml where it fires"
        if name == WATCHDOG:  # the dead man's switch: about no run, no severity of its own
            assert rule["labels"]["severity"] == "none" and rule["expr"] == "vector(1)"
            continue
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert name in quiet, f"{name}: no test in alerts.test.yml where it does not fire"
        assert set(rule["annotations"]) == {"summary", "description"}, name
        if not about_a_run(rule):
            assert "$labels.instance" in rule["annotations"]["summary"], name
        elif "absent(" not in rule["expr"]:  # absent() has no run to name
            assert "$labels.run" in rule["annotations"]["summary"], name
            assert "$labels.run" in rule["annotations"]["description"], name
        if re.search(r"sum by \(run, task\)", rule["expr"]):
            assert "$labels.task" in rule["annotations"]["summary"], name
        assert tested.get(name), f"{name}: no test in alerts.test.yml where it fires"


ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"


def amtool() -> str:
    found = shutil.which("amtool")
    if found is None:
        if CI:
            raise RuntimeError("no amtool: CI installs Debian's prometheus-alertmanager (make test does)")
        pytest.skip("no amtool (apt-get install prometheus-alertmanager)")
    return found


def test_amtool_checks_the_alertmanager_config(tmp_path: Path) -> None:
    done = subprocess.run([amtool(), "check-config", str(ALERTMANAGER)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 receivers" in done.stdout and "1 inhibit rules" in done.stdout
    # not vacuous: a route to a receiver that does not exist fails it
    broken = tmp_path / "alertmanager.yml"
    broken.write_text(ALERTMANAGER.read_text().replace("receiver: page", "receiver: pager"))
    assert subprocess.run([amtool(), "check-config", str(broken)], capture_output=True).returncode != 0


def test_every_severity_the_rules_give_has_a_route() -> None:
    config = yaml.safe_load(ALERTMANAGER.read_text())
    receivers = {r["name"] for r in config["receivers"]}
    routed = {m for route in config["route"]["routes"] for m in route["matchers"]}
    given = {rule["labels"]["severity"] for rule in rules() if rule["alert"] != WATCHDOG}
    assert given == SEVERITIES
    # page has its route; ticket is the default receiver
    assert 'severity="page"' in routed and config["route"]["receiver"] == "ticket"
    assert {"page", "ticket"} <= receivers
    # the inhibition's source is an alert the rules define
    (inhibit,) = config["inhibit_rules"]
    (source,) = inhibit["source_matchers"]
    assert source.split("=", 1)[1].strip('"') in {rule["alert"] for rule in rules()}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_the_prometheus_configs_send_to_alertmanager(config: Path) -> None:
    (manager,) = yaml.safe_load(config.read_text())["alerting"]["alertmanagers"]
    (target,) = manager["static_configs"][0]["targets"]
    assert target.endswith(":9093"), target


def test_compose_runs_alertmanager_with_the_config() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    volumes = services["alertmanager"]["volumes"]
    source = next(v.split(":")[0] for v in volumes if "/etc/alertmanager/alertmanager.yml" in v)
    assert (COMPOSE.parent / source).resolve() == ALERTMANAGER
    assert "alertmanager" in services["prometheus"]["depends_on"]


def test_the_watchdog_goes_to_its_own_route_first() -> None:
    """The dead man's switch reaches the receiver meant for a heartbeat service (the `null`
    receiver as shipped), before the severity routes, repeated every minute or so."""
    assert WATCHDOG in {rule["alert"] for rule in rules()}
    config = yaml.safe_load(ALERTMANAGER.read_text())
    first = config["route"]["routes"][0]
    assert first["matchers"] == [f'alertname="{WATCHDOG}"']
    assert first["repeat_interval"] in {"1m", "2m", "5m"}
    receivers = {r["name"]: r for r in config["receivers"]}
    assert first["receiver"] in receivers
