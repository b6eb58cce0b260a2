"""Weight syncs from the trainer side: publish a new model step, wait until every
live producer runs on it. A trainer that reads no batches through BatchReader (its
own reader of the stream format, a separate process that only publishes) gets its
handle on the run from ``connect`` and ``control_for`` (consumer/assembly.py, which
read the settings)."""

from __future__ import annotations

import time

from rollstream.shared.errors import RollstreamError
from rollstream.shared.events import WEIGHT_SYNC, RunControl


class SyncTimeout(RollstreamError):
    """Producers still on an older model step at the deadline."""


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
