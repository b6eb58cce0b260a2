"""`rollstream train`: the reference trainer as a process, with its own record of the
run (--state-file) and its account of what each step trains (--record)."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from rollstream.cli.logs import on_terminal
from rollstream.cli.process import Process, cold_stop, running
from rollstream.producer.prompts import read_prompt_file
from rollstream.shared.errors import InputError, SettingsError
from rollstream.shared.events import STOP
from rollstream.shared.keys import Role
from rollstream.shared.settings import Settings
from rollstream.shared.settings_errors import redact_url

log = logging.getLogger("rollstream")


def train(
    settings: Settings,
    *,
    steps: int,
    step_time_s: float,
    consumer: str,
    stop: threading.Event,
    hf_model: str | None = None,
    weights_dir: str = "weights",
    lr: float = 1e-5,
    stop_run: bool = False,
    record: str | None = None,
    eval_file: str | None = None,
    eval_every: int = 10,
    eval_task: str | None = None,
    state_file: str | None = None,
    log_to: str = "",
    log_dir: str | None = None,
) -> int:
    """The reference trainer for ``steps`` steps, a log line per step (and a tqdm bar on
    a terminal); with ``hf_model`` a real policy-optimisation step (the loss the
    ``algorithm`` settings select) whose weights the hf engines load; with
    ``stop_run`` the run's stop event once the steps are done; with ``eval_file``
    its prompts evaluated every ``eval_every`` steps through the coordinator, sampled
    as in training and greedily, a log line each; with ``state_file`` the trainer's own
    record of the run (its id and last committed step), checked at the start: a Redis
    that lost the run is then named, never trained again from step 1.

    A first SIGTERM (or the run's stop event) is a warm stop: the step in training
    finishes and is committed. A second signal is a cold stop: the step ends at once,
    uncommitted, its groups left pending for this consumer name (its restart trains that
    step with them); exit 0 either way."""
    from rollstream.consumer.assembly import create_coordinator, create_policy, create_trainer
    from rollstream.consumer.tracking import open_loggers
    from rollstream.consumer.trainer import StepLog

    cold = cold_stop(stop)  # a second signal: see stop_on_signals
    held_out = None
    if eval_file:
        task = eval_task or settings.tasks[0].name
        settings.task(task)
        held_out = read_prompt_file(eval_file, task)  # every line checked before anything runs
        interval = settings.rollout.sync_weights_interval
        if eval_every % interval:
            raise SettingsError(
                f"--eval-every {eval_every} must be a multiple of rollout.sync_weights_interval "
                f"({interval}): an eval runs on the weights a sync has just published"
            )

    policy = None
    if hf_model:
        policy = create_policy(settings, hf_model, weights_dir, lr=lr)
    last: dict[str, Any] = {}
    rollout = settings.rollout
    own = _read_trainer_record(state_file, settings.run) if state_file else None
    known = (
        (str(own["run_id"]), f"the trainer's record {state_file}: delete it to start afresh") if own else None
    )
    with running(
        settings, Role.TRAINER, stop, name=consumer, detail=lambda: dict(last), known_run=known,
        steps=steps, batch_size=rollout.batch_size, max_staleness=rollout.max_staleness,
    ) as process:  # fmt: skip
        if process is None:
            return 0
        if own is not None:
            _check_trainer_record(process, own, str(state_file))
        evaluator = None
        if held_out:
            from rollstream.consumer.evaluation import EvalSet, Evaluator

            sampled = EvalSet("heldout", held_out)
            coordinator = create_coordinator(settings, client=process.client, consumer=f"{consumer}-eval")
            evaluator = Evaluator(coordinator, [sampled, sampled.greedy("greedy")], eval_every)
        trainer = create_trainer(settings, client=process.client, consumer=consumer, step_time_s=step_time_s,
                                 policy=policy, evaluator=evaluator)  # fmt: skip
        if record:
            trainer.on_commit = _recorder(record)
        # per-step learning figures to TensorBoard and W&B (--log-to), under verl / TRL names
        config = settings.model_dump(mode="json", include={"run", "tasks", "rollout", "algorithm"})
        trackers = open_loggers(log_to, log_dir or str(Path("runs") / settings.run), settings.run, config)
        with tqdm(total=steps, unit="step", desc="train", disable=not on_terminal()) as bar:

            def on_step(entry: StepLog) -> None:
                trackers.log(entry.step, {**entry.figures, **entry.eval})
                if state_file:
                    _write_trainer_record(state_file, process, entry.step)
                bar.update(1)
                # steps_left: `rollstream status --watch` shows the run's ETA from it
                done = last.get("done", 0) + 1
                last.update(step=entry.step, groups=entry.groups, done=done, steps_left=steps - done)
                reward = "-" if entry.reward_mean is None else f"{entry.reward_mean:.3f}"
                log.info(
                    "trainer: step %d, %d groups, expired %d, staleness %s, reward %s, step %.2f s, "
                    "waited %.2f s",
                    entry.step, entry.groups, entry.expired, dict(sorted(entry.staleness.items())), reward,
                    entry.train_s, entry.wait_s,
                )  # fmt: skip
                if entry.eval:
                    shown = {
                        k.removeprefix("eval/"): round(v, 4) for k, v in entry.eval.items() if "mean@" in k
                    }
                    log.info(
                        "trainer: eval at step %d: %s (%.1f s)", entry.step, shown, entry.eval["eval/seconds"]
                    )

            try:
                result = trainer.run(steps, on_step, stop, cold=cold)
            finally:
                trackers.close()
        how = " (cold stop)" if cold is not None and cold.is_set() else ""
        log.info("trainer: %d steps done%s", len(result.steps), f", stopped{how}" if stop.is_set() else "")
        if stop_run and len(result.steps) == steps:
            event = process.control.publish(STOP)
            log.info("trainer: published the run's stop event %s", event)
    return 0


def _read_trainer_record(path: str, run: str) -> dict[str, Any] | None:
    """The trainer's own record of ``run`` (None when it has none: a new run, or a file
    of another run)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the trainer's record: {exc}") from None
    try:
        record = orjson.loads(raw)
        ok = isinstance(record, dict) and isinstance(record["run_id"], str) and int(record["train_step"]) >= 0
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise InputError(
            f"{path}: not a trainer's record (JSON with run, run_id and train_step): {raw[:80]!r}; "
            "delete it to start the run afresh"
        )
    return record if record.get("run") == run else None


def _check_trainer_record(process: Process, own: dict[str, Any], path: str) -> None:
    """A run id that matches, but a train_step in Redis behind the record's: Redis lost
    its last writes (a crash within the append-only file's fsync second, or an older copy
    of its data). Training again from there would train those steps twice."""
    from rollstream.shared.rewind import rewound
    from rollstream.shared.runconfig import committed_step

    stored, recorded = committed_step(process.client, process.keys), int(own["train_step"])
    if stored < recorded:
        raise rewound(
            process.client, process.keys, redact_url(process.redis_url),
            f"the trainer (its record {path})", stored, recorded, "nothing was trained on it now",
        )  # fmt: skip


def _write_trainer_record(path: str, process: Process, step: int) -> None:
    """After each committed step: the run's id and the step, replaced atomically."""
    record = {
        "run": process.run, "run_id": process.run_id, "train_step": step,
        "redis": redact_url(process.redis_url), "ts": time.time(),
    }  # fmt: skip
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_bytes(orjson.dumps(record) + b"\n")
    os.replace(temporary, target)


def _recorder(path: str) -> Any:
    """Append what each step trains, before its commit, and the commit after it, as JSON
    lines: an account of training kept outside Redis (the chaos suite checks against it)."""
    handle = open(path, "ab")  # noqa: SIM115 - open for the life of the process

    def record(step: int, batch: Any) -> None:
        if batch is None:
            entry: dict[str, Any] = {"event": "commit", "step": step, "ts": time.time()}
        else:
            # the oldest version among the tokens decoded, not the group's stored tag
            groups = [[g.group_id, _oldest_version(g)] for g in batch.groups]
            entry = {"event": "read", "step": step, "ts": time.time(), "groups": groups}
        handle.write(orjson.dumps(entry) + b"\n")
        handle.flush()
        os.fsync(handle.fileno())

    return record


def _oldest_version(group: Any) -> int:
    """The oldest version among the group's tokens; a group without a response token is
    taken at its model_step, the step its generation started at (docs/stream-format.md
    §11.3), as the trainer's staleness rule takes it."""
    versions = [int(s.response_versions.min()) for s in group.samples if len(s.response_versions)]
    return min(versions, default=int(group.model_step))
