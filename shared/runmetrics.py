"""The run's figures that live in Redis, read once per scrape by one collector.

``rollstream metrics`` (one per run, its own Procfile line) serves them, so that N
producers do not multiply the reads; the per-process figures are shared/telemetry.py's.
One scrape costs one pipelined round trip: per stream of each task XLEN, XINFO
GROUPS (O(consumer groups)) and the first entry of XPENDING; HMGET of the steps,
HGETALL of the progress hash (a field per task and counter) and of the state hash
(one field per producer beside the settings), XLEN of the dead letters and TIME.
Nothing scans entries or keys.

    rollstream_stream_{kind}_entries            entries in the task's stream
    rollstream_stream_{kind}_pending            of those, claimed and not settled
    rollstream_stream_{kind}_lag                of those, not yet delivered
    rollstream_stream_{kind}_oldest_pending_age_seconds  idle time of the first pending entry
    rollstream_progress_{counter}_total         the run's cumulative counters (keys.Count)
    rollstream_progress_reward_scores           the sum of scores (a gauge: scores may be < 0)
    rollstream_dead_letters                     entries in the dead-letter stream
    rollstream_model_step, rollstream_train_step, rollstream_paused
    rollstream_producers_alive                  producers with a fresh heartbeat
    rollstream_producer_model_step_min          the oldest model step a live producer is on
    rollstream_run_up                           1 when this scrape could read the run

with ``kind`` one of evals, prompts, aborted, expired, groups, and labels run and task.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollstream.shared.keys import (
    GROUP_OF_KIND,
    GROUPS,
    MODEL_STEP,
    PAUSED,
    PRODUCER_BEAT,
    STREAM_KINDS,
    TRAIN_STEP,
    Count,
    Keys,
    progress_field,
)
from rollstream.shared.streams import text

log = logging.getLogger(__name__)

GAUGE_COUNTERS = (Count.REWARD_SUM,)  # may go down: a gauge, not a counter
# a gauge named ..._sum is read as a summary's or a histogram's sum (promtool check
# metrics refuses it): the progress hash's reward_sum is exported under this name
GAUGE_NAMES = {Count.REWARD_SUM: "rollstream_progress_reward_scores"}


def stream_metric(kind: str, what: str) -> str:
    return f"rollstream_stream_{kind}_{what}"


def progress_metric(counter: Count) -> str:
    if counter in GAUGE_COUNTERS:
        return GAUGE_NAMES[counter]
    return f"rollstream_progress_{counter.value}_total"


def exported_names() -> set[str]:
    """Every metric name this collector exports (as a scrape shows it: counters with
    ``_total``), for checks of the dashboard's queries."""
    names = {
        "rollstream_dead_letters", "rollstream_model_step", "rollstream_train_step", "rollstream_paused",
        "rollstream_producers_alive", "rollstream_producer_model_step_min", "rollstream_run_up",
        "rollstream_run_scrape_seconds",
    }  # fmt: skip
    for kind in STREAM_KINDS:
        names |= {stream_metric(kind, w) for w in ("entries", "pending", "lag", "oldest_pending_age_seconds")}
    names |= {progress_metric(c) for c in Count}
    return names


class RunCollector(Collector):
    """The run's Redis-side figures for ``tasks``, read at each scrape. A Redis that does
    not answer makes ``rollstream_run_up`` 0 and nothing else (the scrape still
    succeeds: the collector's own client does not ride out outages)."""

    def __init__(
        self, client: redis.Redis, keys: Keys, tasks: Sequence[str], producer_max_age_s: float
    ) -> None:
        self.client = client
        self.keys = keys
        self.tasks = list(tasks)
        self.producer_max_age_s = producer_max_age_s

    def describe(self) -> list[Metric]:
        return []  # collected only when scraped, never at registration

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        up = GaugeMetricFamily(
            "rollstream_run_up", "1 when this scrape could read the run in Redis", labels=["run"]
        )
        try:
            families = self.read()
        except redis.RedisError as exc:
            log.warning("metrics: cannot read run %r from Redis: %s", self.keys.run, exc)
            up.add_metric([self.keys.run], 0.0)
            yield up
            return
        up.add_metric([self.keys.run], 1.0)
        yield up
        yield from families
        took = GaugeMetricFamily(
            "rollstream_run_scrape_seconds",
            "Seconds this scrape spent reading the run in Redis",
            labels=["run"],
        )
        took.add_metric([self.keys.run], time.perf_counter() - started)
        yield took

    def read(self) -> list[Metric]:
        run = self.keys.run
        streams = [(kind, task, self.keys.stream(kind, task)) for task in self.tasks for kind in STREAM_KINDS]
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.keys.state, [MODEL_STEP, TRAIN_STEP, PAUSED])
        pipe.hgetall(self.keys.progress)
        pipe.xlen(self.keys.dead)
        pipe.time()
        pipe.hgetall(self.keys.state)
        for kind, _, key in streams:
            pipe.xlen(key)
            pipe.xinfo_groups(key)  # an error for a stream not made yet: read as empty
            pipe.xpending_range(key, GROUP_OF_KIND[kind], min="-", max="+", count=1)
        for task in self.tasks:  # groups trained but kept for the archiver: not lag
            pipe.xlen(self.keys.trained(task))
        replies: list[Any] = pipe.execute(raise_on_error=False)
        archived = dict(zip(self.tasks, replies[5 + 3 * len(streams) :], strict=True))
        for reply in replies[:5]:
            if isinstance(reply, Exception):
                raise reply
        (model_step, train_step, paused), progress, dead, now, state = replies[:5]
        server_now = float(now[0]) + float(now[1]) / 1e6

        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def gauge(name: str, doc: str, value: float, task: str | None = None) -> None:
            family = families.get(name)
            if family is None:
                labels = ["run"] if task is None else ["run", "task"]
                family = families[name] = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([run] if task is None else [run, task], value)

        for i, (kind, task, _) in enumerate(streams):
            length, groups, oldest = replies[5 + 3 * i : 8 + 3 * i]
            length = length if isinstance(length, int) else 0
            if kind == GROUPS and isinstance(archived[task], int):
                length -= archived[task]
            info = (
                next((g for g in groups if text(g["name"]) == GROUP_OF_KIND[kind]), None)
                if isinstance(groups, list)
                else None
            )
            pending = int(info["pending"]) if info else 0
            for what, value in (("entries", length), ("pending", pending), ("lag", max(0, length - pending))):
                gauge(stream_metric(kind, what), STREAM_DOCS[what].format(kind=kind), float(value), task)
            if isinstance(oldest, list) and oldest:
                what = "oldest_pending_age_seconds"
                idle = int(oldest[0]["time_since_delivered"]) / 1000
                gauge(stream_metric(kind, what), STREAM_DOCS[what].format(kind=kind), idle, task)

        counts = {text(k): _number(v) for k, v in progress.items()}
        for counter in Count:
            doc = f"The run's cumulative {counter.value} count per task (the progress hash)"
            family: GaugeMetricFamily | CounterMetricFamily
            if counter in GAUGE_COUNTERS:
                family = GaugeMetricFamily(progress_metric(counter), doc, labels=["run", "task"])
            else:
                family = CounterMetricFamily(progress_metric(counter), doc, labels=["run", "task"])
            for task in self.tasks:
                family.add_metric([run, task], counts.get(progress_field(task, counter), 0.0))
            families[progress_metric(counter)] = family

        gauge("rollstream_dead_letters", "Entries in the run's dead-letter stream", float(dead))
        gauge("rollstream_model_step", "The model step of the run's published weights", _number(model_step))
        gauge("rollstream_train_step", "The run's last committed train step", _number(train_step))
        gauge("rollstream_paused", "1 while the run is paused", 1.0 if paused == b"1" else 0.0)
        steps = []
        for field, raw in state.items():
            if not text(field).startswith(PRODUCER_BEAT):
                continue
            try:
                beat = orjson.loads(raw)
                if server_now - float(beat["ts"]) <= self.producer_max_age_s:
                    steps.append(int(beat["model_step"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # the producers' own readers report and remove it
        gauge("rollstream_producers_alive", "Producers whose heartbeat is fresh", float(len(steps)))
        if steps:
            gauge("rollstream_producer_model_step_min", "The oldest model step a live producer is on",
                  float(min(steps)))  # fmt: skip
        return list(families.values())


STREAM_DOCS = {
    "entries": "Entries in the task's {kind} stream",
    "pending": "Entries of the task's {kind} stream claimed and not yet settled",
    "lag": "Entries of the task's {kind} stream not yet delivered to its consumer group",
    "oldest_pending_age_seconds": "Seconds since the first pending entry of the {kind} stream was delivered",
}


def _number(value: Any) -> float:
    try:
        return float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return float("nan")  # corrupt: shown as NaN; the processes that need it name the key
