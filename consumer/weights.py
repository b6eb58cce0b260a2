"""Weight syncs from the trainer side: publish a new model step, wait until every
live producer runs on it. A trainer that reads no batches through BatchReader (its
own reader of the stream format, a separate process that only publishes) gets its
handle on the run from ``connect`` and ``control_for`` (consumer/assembly.py, which
read the settings).

``WeightPublisher`` does the whole sync for a trainer that holds a torch model (an outside
trainer's adapter, consumer/integrations/): the model's tensors through the run's weight
transport (shared/transports.py), then the event that names them as a new model step."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rollstream.consumer.lora import adapter_tensors
from rollstream.shared.errors import RollstreamError
from rollstream.shared.events import WEIGHT_SYNC, RunControl
from rollstream.shared.transports import Sender, TransportSettings, sender_for, unique_tensors


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


def model_tensors(model: Any) -> dict[str, Any]:
    """What a weight sync sends of a torch ``model``: a peft model's adapter (the engines
    merge it into the weights they loaded: consumer/lora.py), else every weight, tied ones
    once, by the names the engines' copy of the model has."""
    if hasattr(model, "peft_config"):
        return adapter_tensors(model)
    return unique_tensors(model.state_dict())


class WeightPublisher:
    """A torch model's weights to the run's engines: sent through ``transport`` (files
    under ``out_dir`` unless it names a directory, Ray's object store, a gloo broadcast),
    then published as the next model step. Each publish is a step above the run's
    model_step: producers follow a weight sync only to a higher step."""

    def __init__(self, control: RunControl, transport: TransportSettings, out_dir: str, run: str) -> None:
        self.control = control
        self.transport = transport
        self.out_dir = out_dir
        self.run = run
        self._sender: Sender | None = None

    def publish(self, model: Any, step: int | None = None) -> tuple[int, str]:
        """Send ``model``'s weights and publish them as ``step`` (the run's model_step + 1
        when None); returns (step, the URI engines load them from)."""
        config = getattr(model, "config", None)
        files = {"config.json": config.to_json_string()} if config is not None else {}
        return self.publish_tensors(model_tensors(model), step, files)

    def publish_tensors(
        self,
        tensors: Mapping[str, Any],
        step: int | None = None,
        config_files: Mapping[str, str] | None = None,
    ) -> tuple[int, str]:
        """``publish`` for tensors by name (the engines' names for them)."""
        step = self.control.model_step() + 1 if step is None else step
        if self._sender is None:
            self._sender = sender_for(self.transport, self.out_dir, self.run, config_files or {})
        uri = self._sender.send(step, tensors)
        publish_weights(self.control, step, uri)
        return step, uri

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
