"""Weight syncs from the trainer side: publish a new model step, wait until every
live producer runs on it. A trainer that reads no batches through BatchReader (its
own reader of the stream format, a separate process that only publishes) gets its
handle on the run from ``connect`` and ``control_for``."""

from __future__ import annotations

import time

import redis

from rollstream.shared import connection
from rollstream.shared.errors import RollstreamError
from rollstream.shared.events import WEIGHT_SYNC, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.settings import Settings


class SyncTimeout(RollstreamError):
    """Producers still on an older model step at the deadline."""


def connect(settings: Settings) -> redis.Redis:
    """A client for the run's Redis (``redis.url``) as rollstream's own processes use
    it: checked once, riding out outages up to ``redis.outage_limit_s``, replies as
    bytes (the stream's payloads are binary)."""
    return connection.connect(settings.redis)


def control_for(client: redis.Redis, settings: Settings) -> RunControl:
    """The run's control handle (its state and events) for ``publish_weights`` and
    ``wait_for_producers``; BatchReader has one as ``reader.control``."""
    return RunControl(client, Keys(settings.run))


def publish_weights(control: RunControl, model_step: int, uri: str | None = None) -> str:
    """Append the weight-sync event and set the run's model_step; returns the event id."""
    return control.publish(WEIGHT_SYNC, model_step, uri or "")


def wait_for_producers(
    control: RunControl,
    model_step: int,
    timeout_s: float,
    heartbeat_age_s: float = 10.0,
    poll_s: float = 0.02,
) -> list[str]:
    """Return the live producers once each reports ``model_step`` (from heartbeats);
    raise SyncTimeout naming the laggards at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = control.producers(heartbeat_age_s)
        laggards = [f"{b.producer} (step {b.model_step})" for b in live if b.model_step < model_step]
        if not laggards:
            return [b.producer for b in live]
        if time.monotonic() >= deadline:
            raise SyncTimeout(
                f"after {timeout_s} s, not yet on model step {model_step}: {', '.join(laggards)}"
            )
        time.sleep(poll_s)
