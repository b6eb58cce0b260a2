"""``rollstream metrics``: the run's Redis-side figures for Prometheus, one process per run.

Why a process of its own (a Procfile line) rather than the trainer: the figures an
operator needs most (the queue growing, claims pending, producers gone) matter most
when the trainer is down or stuck, and a run may train with a trainer of its own that
is not ours. One collector per run reads Redis once per scrape, whatever the number
of producers (shared/runmetrics.py); every process serves its own figures besides
(shared/telemetry.py).
"""

from __future__ import annotations

import logging
import threading

from rollstream.cli.process import running
from rollstream.producer.fleet.demand import DemandCollector, DemandPlan, DemandReader, keda_answer
from rollstream.shared import json_routes, telemetry
from rollstream.shared.connection import connect
from rollstream.shared.keys import Role
from rollstream.shared.runconfig import task_quota
from rollstream.shared.runmetrics import RunCollector
from rollstream.shared.settings import Settings

log = logging.getLogger("rollstream")
# a producer whose heartbeat is older than this many of its periods counts as gone
PRODUCER_BEATS_MISSED = 3
KEDA_PATH = "/keda"  # KEDA's metrics-api scaler reads producers_wanted here


def serve_run_metrics(settings: Settings, stop: threading.Event) -> int:
    """Serve the run's figures (and this process's own) until SIGTERM or the run's stop
    event. A metrics port is required: metrics.port or $PORT."""
    tasks = [t.name for t in settings.tasks]
    # /keda answers 503 in JSON until the run is joined (the server serves /metrics from
    # its start, and its figures at any other path: KEDA would get them for its JSON)
    unready = json_routes.route(KEDA_PATH, lambda query: (503, {"error": "the run is not joined yet"}))
    # served here, required; the process wrapper's own serving finds it served already
    with (
        telemetry.serving(settings.metrics, settings.run, Role.METRICS, required=True) as port,
        running(
            settings, Role.METRICS, stop, port=port, tasks=",".join(tasks), refuse_stopped=False
        ) as process,
    ):
        if process is None:
            unready()
            return 0
        # a client of its own that does not ride out outages: a scrape during one answers
        # at once with rollstream_run_up 0 instead of hanging
        client = connect(settings.redis, check=False, ride_out=False)
        max_age_s = PRODUCER_BEATS_MISSED * settings.producer.heartbeat_s
        unregister = telemetry.register(RunCollector(client, process.keys, tasks, max_age_s))
        # the producers the run wants (producer/fleet/demand.py): a gauge, and JSON for KEDA
        demand = DemandReader(client, process.keys, demand_plan(settings, max_age_s))
        unregister_demand = telemetry.register(DemandCollector(demand))
        unroute = json_routes.route(KEDA_PATH, lambda query: keda_answer(demand, query))
        try:
            log.info("metrics: run %r's figures at :%s/metrics, the producers it wants at :%s%s",
                     settings.run, port, port, KEDA_PATH)  # fmt: skip
            stop.wait()
        finally:
            unroute()
            unregister_demand()
            unregister()
            client.close()
    return 0


def demand_plan(settings: Settings, producer_max_age_s: float) -> DemandPlan:
    rollout = settings.rollout
    ahead = rollout.stale_threshold if rollout.mode == "async" else rollout.sync_weights_interval
    return DemandPlan(
        quota=task_quota(settings), ahead=ahead,
        over_sample_threshold=rollout.over_sample_threshold,
        expired_claimed=rollout.tail_batch_trigger_size >= 0, max_inflight=settings.producer.max_inflight,
        batch=rollout.batch_size, producer_max_age_s=producer_max_age_s,
    )  # fmt: skip
