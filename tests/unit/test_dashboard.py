"""The Grafana dashboard (deploy/grafana): every metric its queries use is one the code
exports (or the Redis exporter beside Redis: tests/redis_exporter.py), with the labels
they give, and the panels an operator looks for are there. tests/integration/
test_prometheus.py runs each query on a real Prometheus, test_alerts_live.py the Redis ones."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from rollstream.shared import runmetrics, telemetry
from tests.redis_exporter import EXPORTER_LABELS, EXPORTER_METRICS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "rollstream.json"
NAME = re.compile(r"\brollstream_[a-z0-9_]+\b")
REDIS_NAME = re.compile(r"\bredis_[a-z0-9_]+\b")
# the labels the code gives (and Prometheus' own: job, instance; histograms' le), and the
# Redis exporter's
LABELS = {"run", "task", "role", "engine", "outcome", "set", "le", "job", "instance"} | EXPORTER_LABELS


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # a collapsed row holds its panels
    return out


def queries(dashboard: dict[str, Any], *, variables: bool = True) -> list[str]:
    """The PromQL of every panel, and with ``variables`` the variables' queries (Grafana's
    ``label_values(metric, label)``, not PromQL)."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"] if variables else []:
        query = variable.get("query")
        if variable["type"] == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def exported() -> set[str]:
    return telemetry.exported_names() | runmetrics.exported_names()


def test_every_metric_a_query_uses_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in queries(dashboard) for name in NAME.findall(expr)}
    assert used, "no query names a rollstream metric"
    unknown = sorted(used - exported())
    assert not unknown, f"the dashboard queries metrics the code does not export: {unknown}"
    from_exporter = {name for expr in queries(dashboard) for name in REDIS_NAME.findall(expr)}
    assert not from_exporter - set(EXPORTER_METRICS), sorted(from_exporter - set(EXPORTER_METRICS))


def test_the_redis_panels_are_there() -> None:
    """Memory against maxmemory, clients, commands per second, replication lag, the
    append-only file's status and the keys, of every Redis the exporter watches."""
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in queries(dashboard) for name in REDIS_NAME.findall(expr)}
    wanted = {
        "redis_memory_used_bytes", "redis_memory_max_bytes", "redis_connected_clients",
        "redis_commands_processed_total", "redis_master_repl_offset", "redis_connected_slave_offset_bytes",
        "redis_aof_last_write_status", "redis_db_keys", "redis_up",
    }  # fmt: skip
    assert wanted <= used, sorted(wanted - used)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["redis"]["query"]["query"] == "label_values(redis_up, instance)"
    for expr in queries(dashboard, variables=False):
        if REDIS_NAME.search(expr):  # every Redis query keeps to the Redis chosen
            assert expr.count('instance=~"$redis"') == len(REDIS_NAME.findall(expr)), expr


def test_the_check_catches_a_misspelt_name() -> None:
    assert "rollstream_groups_trained" not in exported()  # a counter is scraped with _total
    assert "rollstream_groups_trained_total" in exported()


def test_queries_group_and_select_only_by_labels_the_code_gives() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for expr in queries(dashboard):
        grouped = [label.strip() for by in re.findall(r"\bby \(([^)]*)\)", expr) for label in by.split(",")]
        selected = re.findall(r"[{,]\s*([a-z_]+)\s*(?:=~|!=|!~|=)", expr)
        assert set(grouped + selected) <= LABELS, expr


def test_the_panels_an_operator_looks_at_are_there() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in queries(dashboard) for name in NAME.findall(expr)}
    wanted = {
        "throughput": "rollstream_groups_trained_total",
        "staleness": "rollstream_trained_group_staleness_bucket",
        "lag": "rollstream_stream_groups_lag",
        "pending": "rollstream_stream_prompts_pending",
        "expiry": "rollstream_progress_expired_total",
        "dead letters": "rollstream_dead_letters",
        "weight-sync latency": "rollstream_weight_sync_seconds_bucket",
        "engine busy": "rollstream_engine_busy_ratio",
        "reward": "rollstream_trainer_reward_mean",
        "KL": "rollstream_trainer_kl",
        "archive lag": "rollstream_archive_lag_entries",
        "archive trimmed": "rollstream_archive_trimmed_total",
        "archive rows": "rollstream_archive_rows_total",
    }
    missing = {what: name for what, name in wanted.items() if name not in used}
    assert not missing, missing
    for panel in panels(dashboard):
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_provisioning_files_point_at_the_dashboard_and_prometheus() -> None:
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/rollstream.yaml").read_text())
    assert provider["apiVersion"] == 1
    assert provider["providers"][0]["type"] == "file"
    assert provider["providers"][0]["options"]["path"]
    source = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["type"] == "prometheus"
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {
        c["job_name"]: [t for s in c["static_configs"] for t in s["targets"]]
        for c in scrape["scrape_configs"]
    }
    assert len(jobs["rollstream"]) == 8  # the Procfile's processes but redis, two producers (`-c producer=2`)
    assert jobs["redis"] == ["127.0.0.1:9121"]  # the Redis exporter beside redis-server
