"""How many producers the run wants: the figure KEDA scales the producers on.

Why not the prompts stream's lag (KEDA's redis-streams scaler): ``rollstream feed
--keep-ahead N`` keeps about N prompts waiting whatever the producers do, so the lag
says how far the feeder runs ahead, not how much work the producers miss; KEDA then
holds N / lagCount producers forever. What bounds a run's throughput is elsewhere: a
producer generates at most ``producer.max_inflight`` groups at once on the engines;
the staleness bound (the admission check, shared/scripts.py CLAIM_BOUNDED) lets in
only so much work per model step; the engines have a capacity; and the trainer takes
``rollout.batch_size`` groups a step. One producer more helps only while the trainer
waits for groups, every producer is busy to its bound, the engines have room and the
admission bound lets in more than the producers hold. So the rule
(:func:`producers_wanted`), one step a look (one producer, or an eighth of those alive:
STEP_SHARE) towards what the run needs, as the engines' autoscale rule steps:

- need = ceil((groups the producers hold + work the bound admits now) / max_inflight):
  the producers that can hold all the work that may be in flight now;
- need above the producers alive: a step up, only while the trainer has less than a batch
  ready, the producers hold at least FULL of their bound, and the engines' busy fraction
  (when the engines process publishes one) is under BUSY_HIGH; else hold;
- need below: a step down (the admission bound holds the work back, or none waits);
- paused: hold; always within the caller's bounds.

Everything comes from Redis in one pipelined round trip (:class:`DemandReader`):
the producers' heartbeats in the state hash, the pools' and the groups stream's
lengths and pending counts, the progress counters the admission bound reads, the
model step, and the engines' busy figure (producer/fleet/scaling.py ``engines_busy``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import redis
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollstream.producer.fleet.autoscale import AUTOSCALE_S, BUSY_HIGH
from rollstream.producer.fleet.scaling import ENGINES_BUSY
from rollstream.shared.allocation import over_sample_budget
from rollstream.shared.keys import (
    ABORTED,
    EVALS,
    EXPIRED,
    GROUP_OF_KIND,
    GROUPS,
    MODEL_STEP,
    PAUSED,
    PRODUCER_BEAT,
    PROMPTS,
    UNTRAINABLE,
    Count,
    Keys,
    progress_field,
)
from rollstream.shared.streams import text

FULL = 0.75  # producers holding this share of their bound are busy: one more may help
# A step is one producer, or an eighth of those alive: the HPA under KEDA leaves the
# replicas alone while the figure is within 10% of them (its tolerance), so a step of
# one from 11 producers up would never be taken
STEP_SHARE = 1 / 8
MAX_PRODUCERS = 1024  # the highest figure served without an explicit bound
PRODUCERS_WANTED = "rollstream_producers_wanted"
KEDA_VALUE = "producers_wanted"  # the answer's field that KEDA reads (its valueLocation)
BUSY_MAX_AGE_S = 3 * AUTOSCALE_S  # an engines' busy figure older than this is not used


@dataclass(frozen=True, slots=True)
class Demand:
    """What the rule weighs, as read from the run."""

    producers: int  # producers with a fresh heartbeat
    inflight: int  # the groups they hold (their heartbeats)
    max_inflight: int  # producer.max_inflight: the groups one producer generates at once
    waiting: int  # entries in the pools no producer has taken
    claimable: int  # of those, what the admission bound lets in now (eval prompts always)
    ready: int  # groups in the groups stream the trainer has not read
    batch: int  # rollout.batch_size: the groups of one train step
    engines_busy: float | None = None  # the engines' mean busy fraction; None: not known
    paused: bool = False


def producers_wanted(demand: Demand, low: int = 1, high: int = MAX_PRODUCERS) -> tuple[int, str]:
    """The producer count the rule wants (one step from ``demand.producers`` towards
    what the run needs, within ``low`` .. ``high``), and why in words."""
    if not 0 <= low <= high:
        raise ValueError(f"producer bounds need 0 <= min <= max, not min {low}, max {high}")
    d, current = demand, demand.producers
    need = math.ceil((d.inflight + d.claimable) / max(1, d.max_inflight))
    step = max(1, math.ceil(current * STEP_SHARE))
    if d.paused:
        target, why = current, "the run is paused"
    elif need > current:
        if d.ready >= d.batch:
            target, why = current, "the trainer has a batch ready"
        elif d.engines_busy is not None and d.engines_busy >= BUSY_HIGH:
            target, why = current, f"the engines are saturated (busy {d.engines_busy:.2f})"
        elif d.inflight < FULL * current * d.max_inflight:
            target, why = current, "the producers have free slots"
        else:
            target, why = (
                min(need, current + step),
                "the trainer waits, the producers are full, work is claimable",
            )
    elif need < current:
        if d.waiting > d.claimable:
            why = "the staleness bound holds the work back"
        else:
            why = "too little work waits for the producers"
        target = max(need, current - step)
    else:
        target, why = current, "the producers hold what may be in flight"
    bounded = max(low, min(high, target))
    if bounded != target:
        why = f"{why}; bounded to {low} .. {high}"
    return bounded, why


@dataclass(frozen=True, slots=True)
class DemandPlan:
    """The settings the reading needs, out of the settings tree (cli/metrics.py's
    ``demand_plan``: the settings tree stays with the composition roots and the CLI)."""

    quota: Mapping[str, int]  # each task's groups in one train step
    ahead: int  # steps the admission bound runs ahead: stale_threshold, or the sync interval
    over_sample_threshold: float
    expired_claimed: bool  # whether producers claim the expired pool (tail_batch_trigger_size >= 0)
    max_inflight: int
    batch: int
    producer_max_age_s: float  # a heartbeat older than this is a gone producer's


class DemandReader:
    """Reads a :class:`Demand` from the run in one pipelined round trip: HGETALL of the
    state and progress hashes, TIME, and per task XLEN and XINFO GROUPS of its pools and
    groups stream and XLEN of its trained log. Nothing scans keys or entries."""

    def __init__(self, client: redis.Redis, keys: Keys, plan: DemandPlan) -> None:
        self.client = client
        self.keys = keys
        self.plan = plan

    def read(self) -> Demand:
        plan, keys = self.plan, self.keys
        kinds = (EVALS, ABORTED, EXPIRED, PROMPTS, GROUPS)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(keys.state)
        pipe.hgetall(keys.progress)
        pipe.time()
        for task in plan.quota:
            for kind in kinds:
                pipe.xlen(keys.stream(kind, task))
                pipe.xinfo_groups(keys.stream(kind, task))  # an error for a stream not made yet
            pipe.xlen(keys.trained(task))
        replies: list[Any] = pipe.execute(raise_on_error=False)
        for reply in replies[:3]:
            if isinstance(reply, Exception):
                raise reply
        state, progress, now = replies[:3]
        server_now = float(now[0]) + float(now[1]) / 1e6
        producers, inflight = self._producers(state, server_now)
        model_step = _int(state.get(MODEL_STEP.encode()))
        waiting = claimable = ready = 0
        at = 3
        for task, quota in plan.quota.items():
            sizes: dict[str, tuple[int, int]] = {}  # kind -> (entries, pending)
            for kind in kinds:
                sizes[kind] = (_int(replies[at]), _pending(replies[at + 1], GROUP_OF_KIND[kind]))
                at += 2
            trained = _int(replies[at])
            at += 1
            pools = [ABORTED, PROMPTS] + ([EXPIRED] if plan.expired_claimed else [])
            task_waiting = sum(max(0, sizes[k][0] - sizes[k][1]) for k in pools)
            running = sum(sizes[k][1] for k in (ABORTED, EXPIRED, PROMPTS))
            room = max(0, self._limit(model_step, quota) - self._accepted(progress, task) - running)
            evals = max(0, sizes[EVALS][0] - sizes[EVALS][1])  # outside the bound
            waiting += task_waiting + evals
            claimable += min(room, task_waiting) + evals
            ready += max(0, sizes[GROUPS][0] - trained - sizes[GROUPS][1])
        return Demand(
            producers=producers, inflight=inflight, max_inflight=plan.max_inflight, waiting=waiting,
            claimable=claimable, ready=ready, batch=plan.batch,
            engines_busy=_busy(state.get(ENGINES_BUSY.encode()), server_now),
            paused=state.get(PAUSED.encode()) == b"1",
        )  # fmt: skip

    def _producers(self, state: Mapping[bytes, bytes], server_now: float) -> tuple[int, int]:
        """(producers with a fresh heartbeat, the groups they hold)."""
        count = inflight = 0
        for field, raw in state.items():
            if not text(field).startswith(PRODUCER_BEAT):
                continue
            try:
                beat = orjson.loads(raw)
                if server_now - float(beat["ts"]) <= self.plan.producer_max_age_s:
                    count += 1
                    inflight += max(0, int(beat["inflight"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # the producers' own readers report and remove it
        return count, inflight

    def _limit(self, model_step: int, quota: int) -> int:
        """The task's admission limit as a producer on the run's model step computes it
        (producer/worker.py ``limit``, outside tail-batch mode)."""
        return (model_step + self.plan.ahead) * quota + over_sample_budget(
            quota, self.plan.over_sample_threshold
        )

    @staticmethod
    def _accepted(progress: Mapping[bytes, bytes], task: str) -> int:
        completed = _int(progress.get(progress_field(task, Count.COMPLETED).encode()))
        return completed - sum(_int(progress.get(progress_field(task, c).encode())) for c in UNTRAINABLE)

    def answer(self, low: int = 1, high: int = MAX_PRODUCERS) -> dict[str, Any]:
        """The JSON the metrics server answers KEDA's metrics-api scaler with: the figure
        (``producers_wanted``), why, and what it weighed."""
        demand = self.read()
        wanted, why = producers_wanted(demand, low, high)
        return {KEDA_VALUE: wanted, "reason": why, "min": low, "max": high, **asdict(demand)}


def _int(raw: Any) -> int:
    """A count as Redis answers it; 0 for none or a corrupt value (the processes that write
    it name the key). A refused command (NOPERM) is raised, not read as 0."""
    if isinstance(raw, Exception):
        raise raw
    if isinstance(raw, int):
        return raw
    try:
        return int(float(raw)) if raw is not None else 0
    except (TypeError, ValueError):
        return 0


def _pending(groups: Any, name: str) -> int:
    if isinstance(groups, redis.ResponseError) and "no such key" in str(groups).lower():
        return 0  # no such stream yet
    if isinstance(groups, Exception):
        raise groups  # refused (NOPERM), or the connection lost mid-pipeline
    if not isinstance(groups, list):
        return 0
    info = next((g for g in groups if text(g["name"]) == name), None)
    return int(info["pending"]) if info else 0


def _busy(raw: bytes | None, server_now: float) -> float | None:
    """The engines' busy fraction from the state hash, when fresh."""
    if raw is None:
        return None
    try:
        body = orjson.loads(raw)
        busy, ts = float(body["busy"]), float(body["ts"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    return busy if server_now - ts <= BUSY_MAX_AGE_S and math.isfinite(busy) else None


def keda_answer(reader: DemandReader, query: Mapping[str, list[str]]) -> tuple[int, dict[str, Any]]:
    """The answer of ``GET /keda?min=A&max=B`` (bounds optional): 200 with the figure,
    400 naming a bad bound, 503 while Redis does not answer (KEDA then keeps the
    replicas it has, or its fallback)."""
    bounds = []
    for name, default in (("min", 1), ("max", MAX_PRODUCERS)):
        raw = (query.get(name) or [str(default)])[-1]
        if not raw.isdigit():
            return 400, {"error": f"{name} is {raw[:20]!r}, not a count of producers (0 or more)"}
        bounds.append(int(raw))
    if bounds[0] > bounds[1]:
        return 400, {"error": f"min {bounds[0]} is above max {bounds[1]}"}
    try:
        return 200, reader.answer(*bounds)
    except redis.RedisError as exc:
        return 503, {"error": f"cannot read run {reader.keys.run!r} from Redis: {exc}"}


class DemandCollector(Collector):
    """rollstream_producers_wanted, read at each scrape (one more pipelined round trip),
    within the default bounds: the figure /keda answers, for dashboards and for a
    Prometheus trigger."""

    def __init__(self, reader: DemandReader) -> None:
        self.reader = reader

    def describe(self) -> list[Metric]:
        return []  # collected only when scraped, never at registration

    def collect(self) -> Iterator[Metric]:
        try:
            wanted, _ = producers_wanted(self.reader.read())
        except redis.RedisError:
            return  # rollstream_run_up says so
        family = GaugeMetricFamily(
            PRODUCERS_WANTED, "Producers the run wants (producer/fleet/demand.py's rule)", labels=["run"]
        )
        family.add_metric([self.reader.keys.run], float(wanted))
        yield family
