"""Prometheus metrics of one process: what it does itself, counted where it happens.

Every long-running process serves them on ``/metrics`` (cli/process.py ``running``
starts :func:`serving` for each) on the port of ``metrics.port``, or of ``$PORT`` when
that setting is unset: the port honcho and foreman give each process of a Procfile.
Unset both (or set ``metrics.port`` 0) and nothing is served; the figures are still
counted (a test reads them from the registry).

Process-local figures only. What lives in Redis (stream depth, lag, pending, steps,
progress counters, producers alive) is read once per scrape by one collector,
shared/runmetrics.py, that ``rollstream metrics`` serves: N producers do not
multiply Redis' load.

Names follow Prometheus' conventions (``rollstream_<thing>_<unit>[_total]``, base
units); labels are ``run`` and ``role`` on every figure, ``task`` and ``engine`` where
they apply, ``outcome`` (a closed set: the group outcomes) on the produced counters and
``set`` (trained, untrained) on the archive's rows: a label, not a metric per value, so
that a sum over it is the whole. Nothing with unbounded values (a group id, a producer
name) is a label.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, make_wsgi_app, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from rollstream.shared.errors import SettingsError
from rollstream.shared.json_routes import routed
from rollstream.shared.settings import MetricsSettings

log = logging.getLogger(__name__)

PORT_ENV = "PORT"  # set per process by honcho and foreman
BASE = ("run", "role")
_identity: dict[str, str] = {"run": "", "role": ""}
_served: list[int] = []  # the port this process serves on, while it does

# Latency buckets (seconds): a group takes from a few ms (simulated) to minutes (long
# reasoning on a busy engine); a weight sync from ms (in-process) to minutes (a 70B load).
_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_STALENESS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)

# --- producer ------------------------------------------------------------------------
GROUPS_PRODUCED = Counter(
    "rollstream_groups_produced_total",
    "Claims a producer finished, by outcome: completed, filtered, aborted, failed, fenced, error",
    [*BASE, "task", "outcome"],
)
SAMPLES_PRODUCED = Counter(
    "rollstream_samples_produced_total",
    "Samples (responses) of the groups a producer finished, by the group's outcome",
    [*BASE, "task", "outcome"],
)
GENERATED_TOKENS = Counter(
    "rollstream_generated_tokens_total", "Response tokens of the completed groups", [*BASE, "task"]
)
GENERATION_SECONDS = Histogram(
    "rollstream_group_generation_seconds",
    "Seconds a group took to generate (every sample, retries included), before its judge",
    [*BASE, "task"],
    buckets=_SLOW,
)
INFLIGHT_GROUPS = Gauge("rollstream_inflight_groups", "Claims a producer holds and works on now", BASE)
# rollstream_inflight_requests (per engine): _InflightRequests below, read at each scrape
INFLIGHT_REQUESTS_NAME = "rollstream_inflight_requests"
ADMISSION_WAITS = Counter(
    "rollstream_admission_waits_total",
    "Times a producer found prompts waiting but claimed none: the staleness bound held it back",
    [*BASE, "task"],
)
WEIGHT_SYNC_SECONDS = Histogram(
    "rollstream_weight_sync_seconds",
    "Seconds from a weight sync's publication (its event, on Redis' clock) to this producer "
    "generating on the new weights",
    BASE,
    buckets=_SLOW,
)
ENGINE_RELOAD_SECONDS = Histogram(
    "rollstream_engine_reload_seconds",
    "Seconds a producer's engines took to confirm a weight sync (load, or drain / abort and load)",
    BASE,
    buckets=_SLOW,
)
MODEL_STEP = Gauge("rollstream_process_model_step", "The model step this process generates with", BASE)
# --- judge ---------------------------------------------------------------------------
JUDGE_SECONDS = Histogram(
    "rollstream_judge_seconds",
    "Seconds to judge one group (in process or on the judge queue)",
    [*BASE, "task"],
    buckets=_SLOW,
)
JUDGE_FAILURES = Counter(
    "rollstream_judge_failures_total", "Groups whose judge failed (after its retries)", [*BASE, "task"]
)
# --- trainer -------------------------------------------------------------------------
TRAIN_STEP = Gauge("rollstream_trainer_step", "The last train step this trainer committed", BASE)
TRAIN_STEP_SECONDS = Histogram(
    "rollstream_train_step_seconds",
    "Seconds of one optimizer step (without the wait for its batch)",
    BASE,
    buckets=_SLOW,
)
BATCH_WAIT_SECONDS = Histogram(
    "rollstream_batch_wait_seconds", "Seconds a trainer waited for a step's batch", BASE, buckets=_SLOW
)
GROUPS_TRAINED = Counter(
    "rollstream_groups_trained_total", "Groups committed by train steps", [*BASE, "task"]
)
GROUPS_EXPIRED = Counter(
    "rollstream_groups_expired_total", "Groups the trainer found too stale to train on", BASE
)
# The archive (consumer/archive.py): what the trainer's trained log trimmed before the
# archiver read it, and what the archiver wrote, lags behind, found already written
ARCHIVE_TRIMMED = Counter(
    "rollstream_archive_trimmed_total",
    "Groups the trained log's cap (archive.keep) trimmed before the archiver archived them",
    BASE,
)
ARCHIVE_ROWS = Counter(
    "rollstream_archive_rows_total", "Rows the archiver wrote to Parquet, by file set", [*BASE, "set"]
)
ARCHIVE_LAG = Gauge(
    "rollstream_archive_lag_entries", "Entries of the trained log the archiver has not archived yet", BASE
)
STALENESS = Histogram(
    "rollstream_trained_group_staleness",
    "Staleness (train step - oldest token version - 1, in steps) of each trained group",
    BASE,
    buckets=_STALENESS,
)
TRAINER_FIGURES = {
    "reward_mean": Gauge("rollstream_trainer_reward_mean", "Mean score of the last step's samples", BASE),
    "loss": Gauge("rollstream_trainer_loss", "The last step's policy loss", BASE),
    "approx_kl": Gauge(
        "rollstream_trainer_kl", "The last step's approximate KL of the policy to the behaviour policy", BASE
    ),
    "clip_fraction": Gauge(
        "rollstream_trainer_clip_fraction", "Share of the last step's tokens whose ratio was clipped", BASE
    ),
    "ratio_mean": Gauge("rollstream_trainer_importance_ratio_mean", "The last step's mean π/μ ratio", BASE),
    "ratio_max": Gauge("rollstream_trainer_importance_ratio_max", "The last step's largest π/μ ratio", BASE),
}
# --- any process ---------------------------------------------------------------------
REDIS_OUTAGES = Counter(
    "rollstream_redis_outages_total", "Redis outages this process rode out (or gave up on)", BASE
)
REDIS_OUTAGE_SECONDS = Counter(
    "rollstream_redis_outage_seconds_total", "Seconds this process spent waiting for Redis to answer", BASE
)
REPLICA_WAIT_SECONDS = Histogram(
    "rollstream_redis_replica_wait_seconds",
    "How long a write waited for redis.wait_replicas replicas to hold it (WAIT), when they did",
    BASE,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
REPLICA_WAIT_FAILURES = Counter(
    "rollstream_redis_replica_wait_failures_total",
    "Writes that redis.wait_replicas replicas did not acknowledge, by reason: behind (fewer "
    "replicas within redis.outage_limit_s) or lost_commit (a failover lost the trainer's commit)",
    [*BASE, "reason"],
)
REPLICA_WAIT_REASONS = ("behind", "lost_commit")
PRIMARY_CHANGES = Counter(
    "rollstream_redis_primary_changes_total",
    "Times this process's Sentinels named a primary at another address than before (a failover followed)",
    BASE,
)


def identify(run: str, role: str) -> None:
    """The run and role every figure of this process is labelled with. The counters of
    rare events (outages, failovers, failed replica waits) start at 0 now, not at their
    first event: an alert's ``increase()`` sees that first one."""
    _identity.update(run=run, role=role)
    for counter in (REDIS_OUTAGES, REDIS_OUTAGE_SECONDS, PRIMARY_CHANGES):
        counter.labels(**labels())
    for reason in REPLICA_WAIT_REASONS:
        REPLICA_WAIT_FAILURES.labels(**labels(reason=reason))


def labels(**extra: str) -> dict[str, str]:
    return {**_identity, **extra}


# The labelled child of each figure, by (figure, run, role, other label values): what the
# per-group calls use. prometheus-client's labels() builds, checks and looks up the label
# set under a lock, several µs a call; this is one dict lookup.
_children: dict[tuple[Any, ...], Any] = {}


def _child(metric: MetricWrapperBase, *extra: str) -> Any:
    key = (id(metric), _identity["run"], _identity["role"], *extra)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(_identity["run"], _identity["role"], *extra)
    return child


def metrics_port(
    settings: MetricsSettings, environ: Mapping[str, str] | None = None
) -> tuple[int, str] | None:
    """(port, where it came from) of this process's metrics server, None for none:
    ``metrics.port`` when set (0: none), else ``$PORT`` when set, else none."""
    if settings.port is not None:
        return (settings.port, "metrics.port (ROLLSTREAM_METRICS__PORT)") if settings.port else None
    raw = (os.environ if environ is None else environ).get(PORT_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 0 < int(raw) <= 65535:
        raise SettingsError(
            f"${PORT_ENV} is {raw[:20]!r}, not a port from 1 to 65535: it is the metrics port a process "
            "manager sets; set metrics.port (ROLLSTREAM_METRICS__PORT) to choose one, 0 to serve none"
        )
    return int(raw), f"${PORT_ENV}"


@contextmanager
def serving(
    settings: MetricsSettings, run: str, role: str, *, required: bool = False
) -> Iterator[int | None]:
    """Serve this process's metrics while the block runs; yields the port, or None when
    none is served. A port that cannot be bound is an error line and the process goes on
    without metrics: a run must not stop for its dashboard, nor a formation that a
    process manager started on ports that another one holds. ``required`` (the metrics
    process, which has nothing else to do): no port at all, or a taken one that
    metrics.port names explicitly, is a settings error."""
    identify(run, role)
    if _served:  # served already by an enclosing block of this process
        yield _served[-1]
        return
    chosen = metrics_port(settings)
    if chosen is None:
        if required:
            raise SettingsError(
                f"{role}: no metrics port: set metrics.port (ROLLSTREAM_METRICS__PORT) or ${PORT_ENV}"
            )
        yield None
        return
    port, source = chosen
    host = settings.host
    try:
        server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as exc:
        message = f"{role}: cannot serve metrics on {host}:{port} (from {source}): {exc.strerror or exc}"
        if required and source != f"${PORT_ENV}":
            raise SettingsError(message) from None
        log.error("%s; going on without them", message)
        yield None
        return
    server.set_app(routed(make_wsgi_app(REGISTRY)))  # the JSON routes beside /metrics (json_routes.py)
    log.info("%s: metrics at http://%s:%d/metrics", role, host, port)
    _served.append(port)
    try:
        yield port
    finally:
        _served.remove(port)
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --- what the code calls where things happen ---------------------------------------------


def group_finished(task: str, outcome: str, samples: int) -> None:
    _child(GROUPS_PRODUCED, task, outcome).inc()
    _child(SAMPLES_PRODUCED, task, outcome).inc(samples)


def group_generated(task: str, seconds: float) -> None:
    _child(GENERATION_SECONDS, task).observe(seconds)


def group_completed(task: str, tokens: int) -> None:
    _child(GENERATED_TOKENS, task).inc(tokens)


def judged(task: str, seconds: float) -> None:
    _child(JUDGE_SECONDS, task).observe(seconds)


def judge_failed(task: str) -> None:
    _child(JUDGE_FAILURES, task).inc()


def admission_wait(task: str) -> None:
    _child(ADMISSION_WAITS, task).inc()


def weight_synced(model_step: int, reload_s: float, since_publish_s: float | None) -> None:
    ENGINE_RELOAD_SECONDS.labels(**labels()).observe(reload_s)
    if since_publish_s is not None:
        WEIGHT_SYNC_SECONDS.labels(**labels()).observe(max(0.0, since_publish_s))
    MODEL_STEP.labels(**labels()).set(model_step)


def track_inflight(groups: Callable[[], int], per_engine: Callable[[], Sequence[int]]) -> None:
    """Read the claims and engine requests in flight at each scrape (no bookkeeping on
    the hot path). ``per_engine`` is read whole at each scrape: the engine pool grows and
    shrinks while a producer runs, and a scrape shows the engines it has then."""
    INFLIGHT_GROUPS.labels(**labels()).set_function(groups)
    _INFLIGHT_REQUESTS.per_engine = per_engine


class _InflightRequests(Collector):
    """rollstream_inflight_requests: this process's outstanding requests per engine of
    its pool, as the pool is at the scrape."""

    def __init__(self) -> None:
        self.per_engine: Callable[[], Sequence[int]] | None = None

    def describe(self) -> list[Any]:
        return [self._family()]

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            INFLIGHT_REQUESTS_NAME,
            "Engine requests this process has outstanding, per engine",
            labels=[*BASE, "engine"],
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        per_engine = self.per_engine
        for engine, outstanding in enumerate(list(per_engine()) if per_engine else []):
            family.add_metric([_identity["run"], _identity["role"], str(engine)], float(outstanding))
        yield family


_INFLIGHT_REQUESTS = _InflightRequests()
REGISTRY.register(_INFLIGHT_REQUESTS)


def archive_trimmed(groups: int) -> None:
    ARCHIVE_TRIMMED.labels(**labels()).inc(groups)


def archive_written(kind: str, rows: int) -> None:
    ARCHIVE_ROWS.labels(**labels(set=kind)).inc(rows)


def archive_lag(entries: int) -> None:
    ARCHIVE_LAG.labels(**labels()).set(entries)


def outage(seconds: float) -> None:
    REDIS_OUTAGES.labels(**labels()).inc()
    REDIS_OUTAGE_SECONDS.labels(**labels()).inc(max(0.0, seconds))


def replicas_waited(seconds: float) -> None:
    REPLICA_WAIT_SECONDS.labels(**labels()).observe(max(0.0, seconds))


def replicas_failed(reason: str) -> None:
    """``reason``: behind or lost_commit."""
    REPLICA_WAIT_FAILURES.labels(**labels(reason=reason)).inc()


def primary_changed() -> None:
    PRIMARY_CHANGES.labels(**labels()).inc()


def train_step(
    step: int,
    train_s: float,
    wait_s: float,
    trained: Mapping[str, int],
    staleness: Mapping[int, int],
    expired: int,
    figures: Mapping[str, float | None],
) -> None:
    """One committed train step: its counts, times, staleness and learning figures."""
    TRAIN_STEP.labels(**labels()).set(step)
    TRAIN_STEP_SECONDS.labels(**labels()).observe(train_s)
    BATCH_WAIT_SECONDS.labels(**labels()).observe(wait_s)
    for task, count in trained.items():
        GROUPS_TRAINED.labels(**labels(task=task)).inc(count)
    GROUPS_EXPIRED.labels(**labels()).inc(expired)
    histogram = STALENESS.labels(**labels())
    for staleness_of, groups in staleness.items():
        for _ in range(groups):
            histogram.observe(staleness_of)
    for name, gauge in TRAINER_FIGURES.items():
        figure = figures.get(name)
        if figure is not None:
            gauge.labels(**labels()).set(figure)


ENGINE_METRICS = (
    "rollstream_engine_outstanding_requests",
    "rollstream_engine_busy_ratio",
    "rollstream_engine_model_step",
    "rollstream_engine_up",
)


class EngineCollector(Collector):
    """The engines' own figures, asked of them at each scrape (the engines process):
    requests outstanding, busy fraction and model step per engine."""

    def __init__(self, probe: Callable[[], Sequence[Any]]) -> None:
        # ``probe``: each engine's health (producer.engines.base.EngineHealth, read by its
        # attributes), None for one that did not answer
        self.probe = probe

    def describe(self) -> list[Any]:
        return []  # collected only when scraped, never at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names = [*BASE, "engine"]
        outstanding = GaugeMetricFamily(
            ENGINE_METRICS[0],
            "Requests an engine holds (running + queued)",
            labels=names,
        )
        busy = GaugeMetricFamily(
            ENGINE_METRICS[1],
            "Decode capacity an engine uses, averaged since it started (0 idle .. 1 saturated)",
            labels=names,
        )
        step = GaugeMetricFamily(ENGINE_METRICS[2], "The model step an engine holds", labels=names)
        up = GaugeMetricFamily(ENGINE_METRICS[3], "1 when the engine answered this scrape", labels=names)
        try:
            healths = list(self.probe())
        except Exception as exc:
            log.warning("metrics: the engines did not answer a probe: %s", exc)
            healths = []
        for i, health in enumerate(healths):
            values = [_identity["run"], _identity["role"], str(i)]
            up.add_metric(values, 0.0 if health is None else 1.0)
            if health is None:
                continue
            outstanding.add_metric(values, float(health.outstanding))
            busy.add_metric(values, float(health.busy_total))
            step.add_metric(values, float(health.model_step))
        yield from (outstanding, busy, step, up)


def register(collector: Collector) -> Callable[[], None]:
    """Add a collector to what this process serves; returns what removes it."""
    REGISTRY.register(collector)
    return lambda: REGISTRY.unregister(collector)


def exported_names() -> set[str]:
    """Every sample name this module's figures show in a scrape (counters with
    ``_total``, histograms as ``_bucket``, ``_sum`` and ``_count``), for checks of the
    dashboard's queries; the run collector's are shared/runmetrics.py's."""
    metrics = [v for v in globals().values() if isinstance(v, MetricWrapperBase)]
    names = {*ENGINE_METRICS, INFLIGHT_REQUESTS_NAME}
    for metric in [*metrics, *TRAINER_FIGURES.values()]:
        for family in metric.describe():
            if family.type == "counter":
                names.add(f"{family.name}_total")
            elif family.type == "histogram":
                names |= {f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
            else:
                names.add(family.name)
    return names
