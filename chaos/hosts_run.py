"""A run laid out like a cluster on emulated hosts (chaos/hosts.py), with host crashes and
network partitions, and the chaos suite's account of every prompt (chaos/report.py).

    python -m chaos.hosts_run --scenario crash_producer_host
    python -m chaos.hosts_run --scenario partition_primary            # the recommended settings
    python -m chaos.hosts_run --scenario partition_primary --unsafe   # without them: measured
    python -m chaos.hosts_run --all                                   # every scenario (make hosts-chaos)

The hosts and what runs on each, with deploy/'s commands and environment (the systemd
units' ExecStart and rollstream.env, deploy/redis-ha.sh for Redis), each process bound
to its host's address:

    r1, r2, r3   a Redis data node and a Sentinel each (redis-ha.sh data / sentinel; r1 is
                 FIRST, the primary on the first start); quorum 2
    head         the Ray head (no CPUs for work), the engines process, the feeder, producer b
    gpu          a Ray worker node offering `rollout`: the 2 simulated engines
    prod         a Ray node with nothing to offer (a Ray driver needs one on its host), producer a
    train        the reference trainer (no Ray)

Every process is restarted 0.5 s after it exits, as systemd's Restart= would; a crashed
host's processes are restarted once the host is back. The recommended settings for Redis
with failover: the trainer's commit WAITs for a replica (``redis.wait_replicas = 1``, the
default with a ``redis+sentinel://`` URL) and the data nodes refuse writes without a
replica in sync (``min-replicas-to-write 1``, ``min-replicas-max-lag 10``: redis-ha.sh's defaults).
``--unsafe`` runs without both.

Scenarios (one fault each, once the run has trained FAULT_STEP steps):

- crash_producer_host: host ``prod`` crashes (every process at once), back after 10 s;
- crash_trainer_host: host ``train`` crashes (the trainer in its step), back after 10 s;
- crash_engine_host: host ``gpu`` crashes (the Ray worker node with both engines: none
  left until it is back, its engines re-created there by Ray), back after 10 s;
- partition_producer_host: host ``prod`` is cut off from the Redis hosts (not from Ray)
  for 5 x claim_idle_ms: producer b takes its claims back, and what producer a settles
  after the heal is fenced off (written nothing);
- partition_primary: the Redis primary's host is cut off from the other two Redis hosts
  (the replicas and the Sentinels' majority) for 20 s while every client still reaches
  it: the majority fails it over, the clients go on writing to the old primary (its own
  Sentinel still names it), then the heal.

Each scenario writes report.json (the account, the faults, the recovery time: from the
fault to the next step trained on the primary the majority names) and the processes'
logs to --out/<scenario>[-unsafe]/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson

from chaos.constants import TASK
from chaos.hosts_cluster import SCENARIOS, HostsChaos
from chaos.report import _group_id, account
from rollstream.shared.events import RunControl
from rollstream.shared.keys import GROUPS, POOLS, Count, progress_field


def run_scenario(
    scenario: str, safe: bool, out: Path, steps: int, deadline_s: float, seed: int, step_time: float = 0.5
) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    chaos = HostsChaos(
        out,
        prompts=steps * 16,
        steps=steps,
        seconds_between_faults=0.0,
        faults=(scenario,),
        seed=seed,
        scenario=scenario,
        safe=safe,
        step_time=step_time,
    )
    try:
        chaos.start_hosts()
        finished = chaos.supervise(deadline_s)
        if chaos.healed_at is None:
            chaos.hosts.heal()
        settled = chaos.settle()
        lost_commits = discarded(chaos)
        trained = _trained(chaos)
        lost_commits["claims_held_by_the_faulted_producer_host"] = len(chaos.held_at_crash)
        lost_commits["of_them_trained_once"] = sum(1 for g in chaos.held_at_crash if trained.get(g) == 1)
        chaos.stop()
        result = account(chaos, finished)
        result.update(lost_commits)
    finally:
        chaos.stop()
        chaos.shutdown_redis()
    result.pop("archive", None)
    t0 = chaos.fault_at
    result.update(
        scenario=scenario,
        settings="recommended (redis.wait_replicas 1, min-replicas-to-write 1)"
        if safe
        else "unsafe (redis.wait_replicas 0, min-replicas-to-write 0)",
        settled=settled,
        fault_at_step=chaos.fault_step,
        trainer_steps_done_lines=_count(out / "trainer.log", " steps done"),
        rewound_lines={p.stem: n for p in sorted(out.glob("*.log")) if (n := _count(p, " went backwards: "))},
        recovery_s=round(chaos.recovered_at - t0, 1) if chaos.recovered_at and t0 else None,
        primary_before=chaos.primary_before,
        primary_after=chaos.primary_after,
        exits={c.name: c.exits for c in chaos.children.values() if c.exits},
        timeline=[(round(t, 1), kind, detail) for t, kind, detail in chaos.timeline],
    )
    (out / "report.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return result


def discarded(chaos: HostsChaos) -> dict[str, int]:
    """Commits that returned to the trainer (its record) and that the surviving primary does
    not hold: groups it still has as waiting or pending, or prompts it never saw fed; and
    the steps committed beyond its train_step. After a split brain these were trained on the
    old primary and thrown away when it rejoined as a replica."""
    client: Any = chaos.client()
    final_step = RunControl(client, chaos.keys).train_step()
    progress = {k.decode(): float(v) for k, v in client.hgetall(chaos.keys.progress).items()}
    fed = int(progress.get(progress_field(TASK, Count.FED), 0))
    waiting = set()
    for kind in (*POOLS, GROUPS):
        for _, fields in client.xrange(chaos.keys.stream(kind, TASK)):
            if gid := _group_id(fields):
                waiting.add(gid)
    reads: dict[int, list[str]] = {}
    committed: list[tuple[int, list[str]]] = []
    if chaos.record.exists():
        for line in chaos.record.read_bytes().splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by a host crash
                entry = orjson.loads(line)
                if entry["event"] == "read":
                    reads[entry["step"]] = [g for g, _ in entry["groups"]]
                else:
                    committed.append((entry["step"], reads.pop(entry["step"], [])))
    last = {g: step for step, groups in committed for g in groups}  # each group's last commit

    def unknown(gid: str) -> bool:
        uid = gid.split(":", 1)[-1].split("@")[0]
        return gid in waiting or (uid.startswith("q") and uid[1:].isdigit() and int(uid[1:]) >= fed)

    return {
        "final_train_step": final_step,
        "steps_committed_beyond_it": len({step for step, _ in committed if step > final_step}),
        "groups_committed_then_discarded": sum(1 for g in last if unknown(g)),
    }


def _trained(chaos: HostsChaos) -> dict[str, int]:
    """How many committed steps each group was trained in, from the trainer's record."""
    reads: dict[int, list[str]] = {}
    times: dict[str, int] = {}
    if chaos.record.exists():
        for line in chaos.record.read_bytes().splitlines():
            with contextlib.suppress(ValueError):
                entry = orjson.loads(line)
                if entry["event"] == "read":
                    reads[entry["step"]] = [g for g, _ in entry["groups"]]
                else:
                    for g in reads.pop(entry["step"], []):
                        times[g] = times.get(g, 0) + 1
    return times


def _count(path: Path, text: str) -> int:
    return path.read_text(errors="replace").count(text) if path.exists() else 0


def verdict(result: dict[str, Any], safe: bool) -> bool:
    """With the recommended settings: finished, nothing lost, nothing trained twice after
    a commit, every prompt in one row. Without them the run is measured, not judged."""
    if not safe:
        return True
    rows_ok = sum(result["rows"].values()) == result["prompts"] > 0
    return bool(
        result["finished"]
        and result["lost"] == 0
        and result["trained_twice_both_committed"] == 0
        and result["groups_committed_then_discarded"] == 0
        and rows_ok
        and result["staleness_violations"] == 0
    )


def summary(result: dict[str, Any]) -> str:
    rows = ", ".join(f"{k} {v}" for k, v in sorted(result["rows"].items()))
    return (
        f"{result['scenario']} [{result['settings']}]: finished {result['finished']}, "
        f"{result['steps']} steps, recovery {result['recovery_s']} s, lost {result['lost']}, "
        f"trained twice {result['trained_twice_both_committed']}, groups committed then discarded "
        f"{result['groups_committed_then_discarded']} ({result['steps_committed_beyond_it']} steps "
        f"beyond the surviving train step {result['final_train_step']}); {rows}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=SCENARIOS, default=SCENARIOS[0])
    parser.add_argument("--all", action="store_true", help="every scenario, and partition_primary --unsafe")
    parser.add_argument(
        "--quick", action="store_true", help="with --all: crash_producer_host and partition_primary only"
    )
    parser.add_argument("--unsafe", action="store_true", help="without the recommended settings")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-time", type=float, default=0.5, help="the trainer's seconds per step")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds per scenario")
    parser.add_argument("--out", default="bench/results/hosts-chaos")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    runs = (
        [(s, True) for s in (SCENARIOS[:2] if args.quick else SCENARIOS)] + [("partition_primary", False)]
        if args.all
        else [(args.scenario, not args.unsafe)]
    )
    results, ok = [], True
    for scenario, safe in runs:
        out = Path(args.out).resolve() / (scenario + ("" if safe else "-unsafe"))
        result = run_scenario(scenario, safe, out, args.steps, args.deadline, args.seed, args.step_time)
        results.append(result)
        ok = verdict(result, safe) and ok
        print(summary(result), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(
        json.dumps(
            [
                {
                    k: r[k]
                    for k in (
                        "scenario",
                        "settings",
                        "finished",
                        "steps",
                        "recovery_s",
                        "lost",
                        "trained_twice_both_committed",
                        "groups_committed_then_discarded",
                        "steps_committed_beyond_it",
                        "rows",
                        "prompts",
                    )
                }
                for r in results
            ],
            indent=2,
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
