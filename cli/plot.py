"""``rollstream plot``: a finished (or running) run's reward, staleness and throughput,
from the figures the trainer recorded with ``--log-to tensorboard``, as one PNG.

Three panels against the train step, each line named in its legend: the reward (the
step's mean, its spread, and the evals' accuracy where there are any), the staleness of
the trained groups (mean and max, and the bound they expire at when given), and the
throughput (groups per second and seconds per step). Needs the tensorboard extra (to
read the event files) and matplotlib (the bench extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollstream.shared.errors import InputError, SettingsError


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files in ``logdir``: tag -> [(step, value)]."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise SettingsError(
            "rollstream plot reads the trainer's TensorBoard files: pip install 'rollstream[tensorboard]'"
        ) from None
    if not Path(logdir).is_dir():
        raise InputError(f"{logdir}: no such folder (the trainer's --log-dir, default runs/RUN)")
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    tags = events.Tags()["scalars"]
    if not tags:
        raise InputError(f"{logdir}: no TensorBoard scalars (was the trainer run with --log-to tensorboard?)")
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags}


def plot(logdir: str | Path, out: str | Path, *, stale_threshold: int | None = None, title: str = "") -> Path:
    """Draw the run of ``logdir`` into the PNG ``out``; returns its path."""
    scalars = read_scalars(logdir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SettingsError(
            "rollstream plot draws with matplotlib: pip install 'rollstream[bench]'"
        ) from None
    fig, (reward, staleness, throughput) = plt.subplots(1, 3, figsize=(16, 4.5))

    def line(ax: Any, tag: str, label: str, *style: Any, **kwargs: Any) -> None:
        points = scalars.get(tag)
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, *style, label=label, **kwargs)

    line(reward, "reward/mean", "train reward (step mean)", color="tab:blue")
    _band(reward, scalars.get("reward/mean"), scalars.get("reward/std"))
    for tag in sorted(t for t in scalars if t.startswith("eval/") and "/mean@" in t):
        line(reward, tag, tag.removeprefix("eval/"), "o--", ms=3)
    reward.set_title("reward")
    line(staleness, "rollout/staleness_mean", "staleness: mean of the step's groups", color="tab:purple")
    line(staleness, "rollout/staleness_max", "staleness: max", ":", color="tab:purple")
    if stale_threshold is not None:
        staleness.axhline(
            stale_threshold, color="tab:red", ls="--", lw=0.8, label=f"expires at {stale_threshold}"
        )
    staleness.set_title("staleness (train steps)")
    line(throughput, "perf/groups_per_second", "groups per second", color="tab:green")
    seconds = throughput.twinx()
    line(seconds, "perf/seconds_per_step", "seconds per step (right)", color="tab:orange", alpha=0.7)
    throughput.set_title("throughput")
    throughput.set_ylabel("groups / s")
    seconds.set_ylabel("s / step")
    for ax in (reward, staleness, throughput):
        ax.set_xlabel("train step")
    handles = throughput.get_legend_handles_labels()
    more = seconds.get_legend_handles_labels()
    throughput.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="lower right")
    for ax in (reward, staleness):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    fig.suptitle(title or f"rollstream run: {Path(logdir).name}")
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _band(
    ax: Any, means: Sequence[tuple[int, float]] | None, stds: Sequence[tuple[int, float]] | None
) -> None:
    """mean ± std of the step's rewards, shaded."""
    if not means or not stds or len(means) != len(stds):
        return
    steps = [s for s, _ in means]
    low = [m - s for (_, m), (_, s) in zip(means, stds, strict=True)]
    high = [m + s for (_, m), (_, s) in zip(means, stds, strict=True)]
    ax.fill_between(steps, low, high, color="tab:blue", alpha=0.15, label="± one std of the step's rewards")
