"""Per-step learning figures to experiment trackers, TensorBoard and W&B (the
``tensorboard`` and ``wandb`` extras), under the names verl and TRL users read.

    reward/mean, reward/std                 the step's sample scores
    actor/loss, actor/kl, actor/clip_fraction, actor/entropy
    actor/importance_ratio_mean, _min, _max, actor/is_weight_mean, _max
    rollout/staleness_mean, rollout/staleness_max, rollout/expired, rollout/groups
    perf/seconds_per_step, perf/wait_seconds, perf/groups_per_second
    eval/...                                the evaluator's own names (consumer.metrics)

``rollstream train --log-to tensorboard,wandb`` writes them for the reference trainer;
another trainer calls :func:`step_figures` (or builds its own mapping) and a
:class:`StepLogger`'s ``log`` itself. A tracker is never needed to train: without the
extra, asking for it is one settings error that says what to install.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rollstream.shared.errors import SettingsError

TRACKERS = ("tensorboard", "wandb")
# consumer.losses.policy_loss's names -> the names verl / TRL users read
POLICY_NAMES = {
    "loss": "actor/loss",
    "approx_kl": "actor/kl",
    "clip_fraction": "actor/clip_fraction",
    "entropy": "actor/entropy",
    "ratio_mean": "actor/importance_ratio_mean",
    "ratio_min": "actor/importance_ratio_min",
    "ratio_max": "actor/importance_ratio_max",
    "is_weight_mean": "actor/is_weight_mean",
    "is_weight_max": "actor/is_weight_max",
    "is_dropped_token_fraction": "actor/is_dropped_token_fraction",
    "tokens": "actor/tokens",
}


class StepLogger(Protocol):
    def log(self, step: int, figures: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def step_figures(
    step_s: float,
    wait_s: float,
    groups: int,
    scores: Sequence[float],
    staleness: Mapping[int, int],
    expired: int,
    policy: Mapping[str, float] | None = None,
    extra: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """One step's figures under the trackers' names; those without a value are left out
    (a step of a trainer without a policy has no KL)."""
    out: dict[str, float] = {
        "perf/seconds_per_step": step_s,
        "perf/wait_seconds": wait_s,
        "rollout/groups": float(groups),
        "rollout/expired": float(expired),
    }
    if step_s + wait_s > 0:
        out["perf/groups_per_second"] = groups / (step_s + wait_s)
    if scores:
        mean = sum(scores) / len(scores)
        out["reward/mean"] = mean
        out["reward/std"] = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    counted = sum(staleness.values())
    if counted:
        out["rollout/staleness_mean"] = sum(k * n for k, n in staleness.items()) / counted
        out["rollout/staleness_max"] = float(max(k for k, n in staleness.items() if n))
    for name, value in (policy or {}).items():
        out[POLICY_NAMES.get(name, f"actor/{name}")] = float(value)
    out.update(extra or {})
    return {k: v for k, v in out.items() if not math.isnan(v)}


class TensorBoardLogger:
    """Scalars to a TensorBoard event file in ``logdir`` (tensorboard's own writer: no
    TensorFlow, no torch)."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise SettingsError(
                "--log-to tensorboard needs the tensorboard extra: pip install 'rollstream[tensorboard]'"
            ) from None
        self._event, self._summary = Event, Summary
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.logdir))

    def log(self, step: int, figures: Mapping[str, float]) -> None:
        values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in figures.items()]
        self._writer.add_event(
            self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        )
        self._writer.flush()  # a run is watched while it trains

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run (the ``wandb`` extra) in ``logdir``/wandb: online with ``WANDB_API_KEY``,
    or written to disk only with ``WANDB_MODE=offline`` (``wandb sync`` uploads it later).
    W&B's console capture is off: the trainer's log lines stay as they are."""

    def __init__(self, logdir: str | Path, name: str, config: Mapping[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise SettingsError(
                "--log-to wandb needs the wandb extra: pip install 'rollstream[wandb]' "
                "(WANDB_MODE=offline writes the run without an account)"
            ) from None
        Path(logdir).mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "rollstream"),
                name=name,
                dir=str(logdir),
                config=dict(config or {}),
                settings=wandb.Settings(console="off"),
            )
        except Exception as exc:  # no account, no network: one line that says what to set
            raise SettingsError(
                f"--log-to wandb: W&B did not start ({type(exc).__name__}: {exc}); set WANDB_API_KEY, "
                "or WANDB_MODE=offline to write the run to disk only"
            ) from None

    def log(self, step: int, figures: Mapping[str, float]) -> None:
        self._run.log(dict(figures), step=step)

    def close(self) -> None:
        self._run.finish()


class Loggers:
    """Every tracker asked for, as one."""

    def __init__(self, loggers: Sequence[StepLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, figures: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, figures)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def open_loggers(
    spec: str, logdir: str | Path, name: str = "rollstream", config: Mapping[str, Any] | None = None
) -> Loggers:
    """The trackers of ``spec`` (comma-separated: ``tensorboard``, ``wandb``), writing
    under ``logdir``, the run called ``name`` (with ``config``, where the tracker keeps
    one); an empty spec is none. An unknown name is a settings error naming the known
    ones."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise SettingsError(
            f"--log-to {spec!r}: unknown tracker {unknown[0]!r}; known: {', '.join(TRACKERS)}"
        )
    loggers: list[Any] = []
    for tracker in dict.fromkeys(names):
        if tracker == "tensorboard":
            loggers.append(TensorBoardLogger(logdir))
        elif tracker == "wandb":
            loggers.append(WandbLogger(logdir, name, config))
    return Loggers(loggers)
