"""What each command does, in terms of the library, by family: cli.feed (feed, the
feeder), cli.ops (the operator's commands), cli.engines (the engines process, scaling),
cli.produce (producer, judge worker) and cli.train (the trainer). The parser is cli.parser,
the dispatch to these cli.dispatch. This module keeps the names it held importable."""

from __future__ import annotations

from rollstream.cli.engines import engines, engines_scale, join_ray, serving_settings, with_engine_count
from rollstream.cli.feed import FEED_PART, feed, run_feeder
from rollstream.cli.ops import check, control, dead_letter, format_status, redis_server, status, steps
from rollstream.cli.produce import _watch_ray_address, judge, produce
from rollstream.cli.train import train
from rollstream.producer.fleet.autoscale import (
    AUTOSCALE_S,
    DRAIN_S,
    SCALE_POLL_S,
    SILENT_WARNING_S,
    SilentEngines,
    autoscale_step,
    scale_engines,
)

__all__ = [
    "AUTOSCALE_S",
    "DRAIN_S",
    "FEED_PART",
    "SCALE_POLL_S",
    "SILENT_WARNING_S",
    "SilentEngines",
    "_watch_ray_address",
    "autoscale_step",
    "check",
    "control",
    "dead_letter",
    "engines",
    "engines_scale",
    "feed",
    "format_status",
    "join_ray",
    "judge",
    "produce",
    "redis_server",
    "run_feeder",
    "scale_engines",
    "serving_settings",
    "status",
    "steps",
    "train",
    "with_engine_count",
]
