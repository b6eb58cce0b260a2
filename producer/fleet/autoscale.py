"""The engines' scaling policy, which the engines process (`rollstream engines`, cli/engines.py)
and `rollstream engines scale` follow: how a fleet grows and shrinks (new engines announced once
they answer; leaving ones announced first, drained, then removed), the autoscale rule (one
engine more while busy with work waiting, one fewer while idle), and the warning about an
engine that stops answering. It takes the run's name and its engines section, never the
settings tree; the counts it reads and writes are producer/fleet/scaling.py's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rollstream.producer.fleet.scaling import EngineCount
from rollstream.shared.engine_settings import EngineSettings

log = logging.getLogger("rollstream")

SCALE_POLL_S = 1.0  # how often the engines process and producers look at the run's engine counts
DRAIN_S = 120.0  # the longest a scaled-in engine has to finish its groups before it is removed
SILENT_WARNING_S = 10.0  # an engine that does not answer this long is warned about, once
AUTOSCALE_S = 30.0  # how often the engines process applies the run's autoscale rule
# the autoscale rule: one engine more while the engines are this busy and work waits for
# producers; one fewer while they are this idle
BUSY_HIGH = 0.8
BUSY_LOW = 0.3


def autoscale_target(current: int, low: int, high: int, busy: float | None, lag: int) -> int:
    """The engine count the autoscale rule wants: ``current`` one step towards what
    ``busy`` (the engines' mean busy fraction, None when none answered) and ``lag``
    (entries waiting for producers in the run's pools) ask for, within ``low`` .. ``high``."""
    target = current
    if busy is not None and busy >= BUSY_HIGH and lag > 0:
        target = current + 1
    elif busy is not None and busy <= BUSY_LOW:
        target = current - 1
    return max(low, min(high, target))


class SilentEngines:
    """Warns once when an engine stops answering (its node died, it is restarting) and
    says when it answers again: Ray re-creates it on a node with what it needs."""

    def __init__(self, engines: EngineSettings) -> None:
        self.engines = engines
        self.since: dict[int, float] = {}
        self.warned: set[int] = set()

    def note(self, healths: list[Any]) -> None:
        from rollstream.producer.fleet.actors import describe_needs

        now = time.monotonic()
        for i, health in enumerate(healths):
            if health is not None:
                if i in self.warned:
                    log.info("engines: engine %d answers again", i)
                self.since.pop(i, None)
                self.warned.discard(i)
                continue
            first = self.since.setdefault(i, now)
            if now - first >= SILENT_WARNING_S and i not in self.warned:
                self.warned.add(i)
                log.warning(
                    "engines: engine %d has not answered for %.0f s (its node gone?): Ray re-creates it "
                    "(engines.max_restarts %d) on a node with %s, and waits for one; producers send "
                    "its groups to the other engines meanwhile",
                    i, now - first, self.engines.max_restarts, describe_needs(self.engines),
                )  # fmt: skip


def scale_engines(
    run: str,
    engines: EngineSettings,
    pool: Any,
    count: EngineCount,
    target: int,
    stop: threading.Event,
    *,
    detached: bool,
) -> None:
    """Grow the run's engines to ``target`` (new actors, announced once they answer) or
    shrink them (announced first, so that producers stop sending them work; drained up to
    DRAIN_S, then removed: what they still hold fails there and producers retry it on
    the engines left)."""
    import ray

    from rollstream.producer.fleet.actors import create_engine, describe_needs, remove_engine
    from rollstream.producer.fleet.pool import EnginePool

    current = len(pool.handles)
    if target > current:
        log.info("engines: scaling out from %d to %d engines", current, target)
        new = [create_engine(run, engines, i, detached=detached) for i in range(current, target)]
        calls = [h.health.remote() for h in new]
        started, warned = time.monotonic(), False
        while not stop.is_set():
            _, waiting = ray.wait(calls, num_returns=len(calls), timeout=SCALE_POLL_S)
            if not waiting:
                break
            if not warned and time.monotonic() - started > SILENT_WARNING_S:
                warned = True
                log.warning("engines: %d new engines wait for a Ray node with %s (see `ray status`)",
                            len(waiting), describe_needs(engines))  # fmt: skip
        else:
            return
        pool.resize(pool.handles + new)
        count.set_serving(target)
        log.info("engines: %d engines serving", target)
    elif target < current:
        leaving = EnginePool(run, pool.handles[target:])
        count.set_serving(target)  # producers send them no new work from now
        pool.resize(pool.handles[:target])
        log.info("engines: scaling in from %d to %d engines: draining %d", current, target, current - target)
        deadline = time.monotonic() + DRAIN_S
        stop.wait(2 * SCALE_POLL_S + 1)  # the producers' next look at the count
        while time.monotonic() < deadline and not stop.is_set():
            busy = [h for h in leaving.probe(timeout_s=1.0) if h is not None and h.outstanding]
            if not busy:
                break
            stop.wait(0.5)
        else:
            log.warning("engines: the engines scaled in still had requests after %.0f s: removed anyway, "
                        "producers retry them on the engines left", DRAIN_S)  # fmt: skip
        for i in range(target, current):
            remove_engine(run, i)
        pool.forget_retired()
        log.info("engines: %d engines serving", target)


def autoscale_step(pool: Any, count: EngineCount, waiting: Callable[[], int]) -> int | None:
    """One look of the run's autoscale rule (`rollstream engines scale --min A --max B`):
    one engine more while the engines are busy and work waits for producers (``waiting``:
    the entries in the run's pools not yet delivered), one fewer while they idle
    (``autoscale_target``); asks for it as `engines scale` does. Returns the count it
    wants, None without a rule. With or without one it publishes the engines' busy
    fraction (scaling.py ``engines_busy``): the producers' scaling figure reads it."""
    import statistics

    healths = [h for h in pool.probe(timeout_s=2.0) if h is not None]
    busy = statistics.fmean(h.busy_fraction for h in healths) if healths else None
    if busy is not None:
        count.publish_busy(busy)
    rule = count.autoscale()
    if rule is None:
        return None
    lag = waiting()
    current = len(pool.handles)
    target = autoscale_target(current, rule[0], rule[1], busy, lag)
    if target != current:
        log.info("engines: autoscale (min %d, max %d): busy %s, %d prompts waiting: %d -> %d engines",
                 rule[0], rule[1], "-" if busy is None else f"{busy:.2f}", lag, current, target)  # fmt: skip
        count.want(target)
    return target
