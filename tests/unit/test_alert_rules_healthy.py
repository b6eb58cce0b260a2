"""No alert fires on a healthy run: a promtool unit test made here feeds every series the
code and the Redis exporter export (each counter from 0, as a process that starts serves
it: absent, then 0) for an hour of a run that trains, and expects no alert at any of its
checks but the watchdog, which must fire. Made from the exported names rather than
written out, so that a new metric or a new rule is in it without anyone remembering to
add it; a rule that uses a name this test cannot feed fails it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from rollstream.shared import runmetrics, telemetry
from tests.redis_exporter import EXPORTER_METRICS
from tests.unit.test_alert_rules import NAME, RULES, WATCHDOG, promtool, rules

MINUTES = 60
STARTS_AT = 3  # minutes before a process's first scrape: its series are absent until then
CHECKS = (5, 12, 20, 31, 45, 59)  # past every `for:` and every range of the rules
# counters of faults: a healthy run counts none of them (they stay at 0); every other
# counter rises from 0
FAULTS = (
    "_dead_total",
    "_expired_total",
    "_dropped_total",
    "_judge_failures_total",
    "_redis_outage_seconds_total",
    "_redis_outages_total",
    "_redis_primary_changes_total",
    "_redis_replica_wait_failures_total",
)
# the gauges of a healthy run that 0 would not describe: the run up, training (its step
# rises), producers and engines alive, groups and prompts waiting; a Redis at 2 % of its
# maxmemory with its append-only file writing and a replica that keeps up
HEALTHY = {
    "rollstream_run_up": "1",
    "rollstream_producers_alive": "2",
    "rollstream_engine_up": "1",
    "rollstream_train_step": "0+1",
    "rollstream_model_step": "0+1",
    "rollstream_stream_groups_entries": "8",
    "rollstream_stream_prompts_entries": "100",
    "up": "1",
    "redis_up": "1",
    "redis_memory_used_bytes": "1e8+1e6",
    "redis_memory_max_bytes": "4294967296",
    "redis_connected_clients": "12",
    "redis_connected_slaves": "1",
    "redis_aof_enabled": "1",
    "redis_aof_last_write_status": "1",
    "redis_aof_last_bgrewrite_status": "1",
    "redis_master_repl_offset": "0+50000",
    "redis_connected_slave_offset_bytes": "0+50000",
    "redis_slave_repl_offset": "0+50000",
    "redis_master_link_up": "1",
}


def is_counter(name: str) -> bool:
    return name.endswith(("_total", "_count", "_sum", "_bucket"))


def labels(name: str) -> dict[str, str]:
    """The labels the series has when scraped: its target's, a run's for rollstream's (and
    a task, a role, an engine where the code gives them), the exporter's own for Redis's."""
    if name == "up":
        return {"job": "rollstream", "instance": "trainer:9100"}
    if name.startswith("redis_"):
        given = {"job": "redis", "instance": "redis:9121"}
        given.update({label: "0" if label != "slave_state" else "online" for label in EXPORTER_METRICS[name]})
        return given
    given = {"job": "rollstream", "instance": "trainer:9100", "run": "r1"}
    if name.startswith(("rollstream_stream_", "rollstream_progress_")):
        given["task"] = "math"
    if name.startswith(("rollstream_redis_", "rollstream_engine_")):
        given["role"] = "trainer"
    if name.startswith("rollstream_engine_"):
        given["engine"] = "0"
    if name.startswith("rollstream_redis_replica_wait_failures"):
        given["reason"] = "behind"
    if name.endswith("_bucket"):
        given["le"] = "+Inf"
    return given


def values(name: str) -> str:
    """Minutes of samples: a counter absent until STARTS_AT, then from 0 (rising unless a
    fault); a gauge from the first minute, at its healthy value or 0."""
    steps = MINUTES - STARTS_AT
    if is_counter(name):
        rate = "0" if name.endswith(FAULTS) else "4"
        return f"_x{STARTS_AT} 0+{rate}x{steps}"
    return f"{HEALTHY.get(name, '0')}x{MINUTES}"


def healthy_case() -> dict[str, Any]:
    names = telemetry.exported_names() | runmetrics.exported_names() | set(EXPORTER_METRICS) | {"up"}
    series = []
    for name in sorted(names):
        given = ", ".join(f'{k}="{v}"' for k, v in labels(name).items())
        series.append({"series": f"{name}{{{given}}}", "values": values(name)})
    checks = []
    for rule in rules():
        for minute in CHECKS:
            expected = []
            if rule["alert"] == WATCHDOG:
                expected = [{"exp_labels": {"severity": "none"}, "exp_annotations": rule["annotations"]}]
            checks.append({"alertname": rule["alert"], "eval_time": f"{minute}m", "exp_alerts": expected})
    return {"interval": "1m", "input_series": series, "alert_rule_test": checks}


def run_case(rules_file: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    if rules_file.parent != tmp_path:
        shutil.copy(rules_file, tmp_path / "alerts.yml")
    test = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": [healthy_case()]}
    (tmp_path / "healthy.test.yml").write_text(yaml.safe_dump(test, sort_keys=False, width=200))
    return subprocess.run(
        [promtool(), "test", "rules", str(tmp_path / "healthy.test.yml")],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_healthy_run_feeds_every_series_the_rules_use_each_counter_from_0() -> None:
    case = healthy_case()
    fed = {s["series"].split("{", 1)[0]: s["values"] for s in case["input_series"]}
    used = {name for rule in rules() for name in NAME.findall(rule["expr"])}
    used |= {name for rule in rules() for name in set(EXPORTER_METRICS) if name in rule["expr"]}
    assert not used - set(fed), sorted(used - set(fed))
    for name, given in fed.items():
        first = given.split()[1] if given.startswith("_") else given
        if is_counter(name):
            assert given.startswith("_x") and first.startswith("0"), (name, given)
    # every alert is checked at every point, the watchdog the only one that fires
    alerts = {check["alertname"] for check in case["alert_rule_test"]}
    assert alerts == {rule["alert"] for rule in rules()}


def test_no_alert_fires_on_a_healthy_run(tmp_path: Path) -> None:
    done = run_case(RULES, tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


def test_the_healthy_run_catches_a_rule_that_fires_on_a_start(tmp_path: Path) -> None:
    """Not vacuous: without its `> 0`, the failover rule's branch for a new series takes
    every process's counter at its first 0 as a failover (alerts.yml says why)."""
    text = RULES.read_text()
    changes = "rollstream_redis_primary_changes_total"
    branch = f"({changes} unless {changes} offset 10m) > 0"
    assert text.count(branch) == 1
    (tmp_path / "alerts.yml").write_text(text.replace(branch, branch.removesuffix(" > 0")))
    done = run_case(tmp_path / "alerts.yml", tmp_path)
    assert done.returncode != 0
    assert "alertname: RollstreamFailover" in done.stdout + done.stderr
