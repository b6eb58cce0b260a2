"""The chaos suite: a fed run as processes under a small supervisor that restarts
whatever exits (as systemd's Restart=always would), with faults injected at random,
and an account of every prompt taken from the trainer's own record.

    python -m chaos.run            # the full suite (make chaos): every fault, a few minutes
    python -m chaos.run --smoke    # a short mixed-fault run (CI)

Processes: redis-server (deploy/redis.conf, append-only file, appendfsync always: see
"Durability" in the README), the engines process (2 simulated engines in Ray actors),
the feeder, 2 producers, the rq judge worker, the archiver (archive.keep set: the
trainer's commit logs each trained group for it), and the reference trainer with
``--record``, which appends each step's groups before its commit and the commit after
it. Faults: kill -9 of a producer, the trainer, the feeder, the judge worker, the
archiver, an engine actor; SIGSTOP of a producer past claim_idle_ms, then SIGCONT; kill -9 of redis-server,
restarted from its append-only file; kill -9 of the trainer 4 times within one step
(each time it has read its batch again), which must dead-letter no group.

Every fed prompt ends up in exactly one row of the table: trained once, trained again
after a step that was never committed, trained twice with both steps committed (a
failure), dead-lettered (with the reason), still pending (and where), or lost (a
failure). Every group the trainer committed is in the archive's Parquet files exactly
once (read back with pyarrow): one archived twice, or not at all, is a failure.
Staleness violations come from the versions the trainer decoded, not from
tags in Redis. Writes report.json and timeline.png to --out.

The parts: chaos/constants.py (the run's settings), chaos/faults.py (the faults and how
each is done), chaos/supervisor.py (the processes and their restarts), chaos/report.py
(the account and the report). This module is the command.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson

from chaos.constants import (
    ARCHIVE_FLUSH_S,
    ARCHIVE_KEEP,
    BATCH,
    CLAIM_IDLE_MS,
    MAX_STALENESS,
    ROOT,
    TASK,
    THRESHOLD,
)
from chaos.faults import (
    ENGINE_ACTOR,
    FAULTS,
    FIRST_FAULT_STEP,
    LOST,
    RET_LOST,
    STEPS_BETWEEN_FAULTS,
    TRAINER_KILLS,
    engine_actor_pids,
)
from chaos.report import account, archived, plot, report
from chaos.supervisor import Chaos, Child

__all__ = [
    "ARCHIVE_FLUSH_S",
    "ARCHIVE_KEEP",
    "BATCH",
    "CLAIM_IDLE_MS",
    "ENGINE_ACTOR",
    "FAULTS",
    "FIRST_FAULT_STEP",
    "LOST",
    "MAX_STALENESS",
    "RET_LOST",
    "ROOT",
    "STEPS_BETWEEN_FAULTS",
    "TASK",
    "THRESHOLD",
    "TRAINER_KILLS",
    "Chaos",
    "Child",
    "account",
    "archived",
    "engine_actor_pids",
    "lost_run",
    "main",
    "plot",
    "report",
]


def lost_run(chaos: Chaos, deadline: float) -> int:
    """The redis_restarted_empty fault: once, after a few steps; the run passes when every
    process stopped with exit 5 and one clear error, none restarted, and the run is marked
    lost in Redis (so that a process started later refuses it too)."""
    chaos.faults = (LOST,)
    try:
        stopped = chaos.supervise(deadline)
    finally:
        chaos.stop()
    try:
        raw: Any = chaos.client().hgetall(chaos.keys.state)
        state = {k.decode(): v for k, v in raw.items()}
    finally:
        chaos.shutdown_redis()
    children = [c for c in chaos.children.values() if c.name != "redis"]
    errors = {c.name: [ln for ln in c.log.read_text(errors="replace").splitlines() if " is lost: " in ln]
              for c in children}  # fmt: skip
    result: dict[str, Any] = {
        "fault": LOST,
        "stopped": stopped,
        "exits": {c.name: c.exits for c in children},
        "clear_errors": {name: len(lines) for name, lines in errors.items()},
        "marked_lost": "lost" in state,
        "train_step_in_redis_after": state.get("train_step", b"").decode() or None,
    }
    (chaos.out / "report.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    ok = stopped and result["marked_lost"]
    ok = ok and all(c.exits and c.exits[-1] == RET_LOST for c in children)
    return 0 if ok and all(n >= 1 for n in result["clear_errors"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short mixed-fault run (CI)")
    parser.add_argument("--out", default="bench/results/chaos", help="where report.json, logs and the PNG go")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", help=f"comma-separated subset of {','.join(FAULTS)}, or {LOST} alone")
    parser.add_argument("--no-faults", action="store_true", help="a fault-free run, for comparison")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    faults = () if args.no_faults else tuple(args.faults.split(",")) if args.faults else FAULTS
    prompts, steps, every, deadline = (600, 40, 1.0, 300.0) if args.smoke else (2000, 150, 1.0, 1200.0)
    chaos = Chaos(out, prompts, steps, every, faults, args.seed)
    if LOST in faults:
        return lost_run(chaos, deadline)
    try:
        finished = chaos.supervise(deadline)
        drained = chaos.drain_archive()
        chaos.stop()
        result = account(chaos, finished)
        result["archive"]["drained"] = drained
    finally:
        chaos.stop()
        chaos.shutdown_redis()
    (out / "report.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    plot(chaos, out / "timeline.png")
    print(report(result))
    ok = result["finished"] and result["lost"] == 0 and result["trained_twice_both_committed"] == 0
    ok = ok and result["groups_dead_for_deliveries"] == 0
    archive = result["archive"]
    ok = ok and archive["drained"] and archive["archived_twice"] == 0 and archive["trained_not_archived"] == 0
    ok = ok and archive["archived_once"] == archive["trained_groups"]
    return 0 if ok and result["staleness_violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
