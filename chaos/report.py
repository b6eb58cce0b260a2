"""The chaos run's account (chaos/run.py): every fed prompt in exactly one row, from the
trainer's own record and Redis; every committed group archived exactly once, from the
Parquet files; and the report and timeline drawn from them."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson

from chaos.constants import BATCH, TASK, THRESHOLD
from chaos.supervisor import Chaos
from rollstream.shared.keys import GROUPS, POOLS, Count, progress_field


def account(chaos: Chaos, finished: bool) -> dict[str, Any]:
    """Every fed prompt in exactly one row, from the trainer's record and Redis."""
    client: Any = chaos.client()
    progress = {k.decode(): float(v) for k, v in client.hgetall(chaos.keys.progress).items()}
    # the feeder goes through the file in order (no shuffle): what it fed is a prefix
    fed = int(progress.get(progress_field(TASK, Count.FED), 0))
    expected = {f"{TASK}:q{i}@0" for i in range(fed)}
    reads: dict[int, list[list[Any]]] = {}
    committed: list[tuple[int, list[list[Any]]]] = []
    uncommitted_reads: Counter[str] = Counter()
    if chaos.record.exists():
        for line in chaos.record.read_bytes().splitlines():
            entry = orjson.loads(line)
            if entry["event"] == "read":
                if entry["step"] in reads:  # read again: the earlier read was never committed
                    uncommitted_reads.update(g for g, _ in reads[entry["step"]])
                reads[entry["step"]] = entry["groups"]
            else:
                committed.append((entry["step"], reads.pop(entry["step"], [])))
    for groups in reads.values():  # read, never committed
        uncommitted_reads.update(g for g, _ in groups)
    times: Counter[str] = Counter(g for _, groups in committed for g, _ in groups)
    violations = [
        (step, g, version)
        for step, groups in committed
        for g, version in groups
        if step - version - 1 >= THRESHOLD
    ]
    dead: dict[str, str] = {}
    groups_dead_for_deliveries = 0  # trained groups given up for deliveries: trainer kills charged to them
    for _, fields in client.xrange(chaos.keys.dead):
        gid = _group_id(fields)
        if gid:
            dead[gid] = fields.get(b"reason", b"").decode("utf-8", "replace")
            if fields.get(b"source") == chaos.keys.groups(TASK).encode() and dead[gid].startswith(
                "delivered"
            ):
                groups_dead_for_deliveries += 1
    pending: dict[str, str] = {}
    for kind in (*POOLS, GROUPS):
        for _, fields in client.xrange(chaos.keys.stream(kind, TASK)):
            gid = _group_id(fields)
            if gid:
                pending[gid] = kind
    rows: Counter[str] = Counter()
    where: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for gid in expected:
        n = times[gid]
        if n >= 2:
            rows["trained twice, both committed"] += 1
        elif n == 1:
            rows["trained again after an uncommitted step" if uncommitted_reads[gid] else "trained once"] += 1
        elif gid in dead:
            rows["dead-lettered"] += 1
            where["dead-lettered"][dead[gid].split(":")[0]] += 1
        elif gid in pending:
            rows["still pending"] += 1
            where["still pending"][pending[gid]] += 1
        else:
            rows["lost"] += 1
    completed = progress.get(progress_field(TASK, Count.COMPLETED), 0.0)
    expired = progress.get(progress_field(TASK, Count.EXPIRED), 0.0)
    archive = archived(chaos.archive_dir / "trained", {g for g, n in times.items() if n >= 1})
    faults = Counter(
        _fault_name(kind, detail) for _, kind, detail in chaos.timeline if kind in ("kill -9", "SIGSTOP")
    )
    return {
        "finished": finished,
        "steps": len(committed),
        "prompts": fed,
        "rows": dict(rows),
        "where": {k: dict(v) for k, v in where.items()},
        "lost": rows["lost"],
        "trained_twice_both_committed": rows["trained twice, both committed"],
        "groups_dead_for_deliveries": groups_dead_for_deliveries,
        "staleness_violations": len(violations),
        "expired_per_completed": round(expired / completed, 4) if completed else 0.0,
        "faults": dict(faults),
        "restarts": {c.name: c.restarts for c in chaos.children.values()},
        "archive": archive,
    }


def archived(folder: Path, trained: set[str]) -> dict[str, int]:
    """The archive's trained file set against the groups the trainer committed: each one
    archived exactly once (every sample in one row), none missing."""
    import pyarrow.dataset as ds

    rows: Counter[tuple[str, int]] = Counter()
    if folder.exists():
        table = ds.dataset(str(folder), format="parquet").to_table(columns=["group_id", "sample_index"])
        rows.update(
            zip(table.column("group_id").to_pylist(), table.column("sample_index").to_pylist(), strict=True)
        )
    groups = {g for g, _ in rows}
    return {
        "trained_groups": len(trained),
        "archived_groups": len(groups),
        "archived_once": len(trained & groups)
        - len({g for (g, _), n in rows.items() if n > 1 and g in trained}),
        "archived_twice": len({g for (g, _), n in rows.items() if n > 1}),
        "trained_not_archived": len(trained - groups),
        # archived, and not in the trainer's record as committed: a commit that landed
        # while the trainer was killed before it recorded it (not a failure of the archive)
        "archived_not_in_record": len(groups - trained),
    }


def _fault_name(kind: str, detail: str) -> str:
    """ "kill -9 producer", "SIGSTOP producer", "kill -9 engine actor", ... without numbers."""
    what = detail.split(" (")[0].split(" for ")[0].rstrip("-0123456789")
    return f"{kind} {what}"


def _group_id(fields: Any) -> str:
    if b"group_id" in fields:
        return str(fields[b"group_id"].decode())
    if b"uid" in fields and b"task" in fields:
        return f"{fields[b'task'].decode()}:{fields[b'uid'].decode()}"
    return ""


def report(result: dict[str, Any]) -> str:
    lines = [
        f"finished: {'yes' if result['finished'] else 'NO'} ({result['steps']} steps committed)",
        "faults: " + ", ".join(f"{k} {v}x" for k, v in sorted(result["faults"].items())),
        "restarts: " + ", ".join(f"{k} {v}" for k, v in sorted(result["restarts"].items()) if v),
        f"{'prompts fed':42} {result['prompts']:>6}",
    ]
    for row in ("trained once", "trained again after an uncommitted step", "trained twice, both committed",
                "dead-lettered", "still pending", "lost"):  # fmt: skip
        detail = result["where"].get(row)
        extra = f"  ({', '.join(f'{k} {v}' for k, v in detail.items())})" if detail else ""
        lines.append(f"  {row:40} {result['rows'].get(row, 0):>6}{extra}")
    lines.append(f"{'staleness violations':42} {result['staleness_violations']:>6}")
    lines.append(f"{'expired per completed group':42} {result['expired_per_completed']:>6.3f}")
    archive = result["archive"]
    lines.append(f"{'trained groups archived exactly once':42} {archive['archived_once']:>6}")
    lines.append(f"  {'archived twice':40} {archive['archived_twice']:>6}")
    lines.append(f"  {'trained, not archived':40} {archive['trained_not_archived']:>6}")
    lines.append(f"  {'archived, not in the trainer record':40} {archive['archived_not_in_record']:>6}")
    return "\n".join(lines)


def plot(chaos: Chaos, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    t = [s["t"] for s in chaos.samples]
    ax.plot(t, [s["train_step"] for s in chaos.samples], label="train step")
    ax.plot(t, [s["completed"] / BATCH for s in chaos.samples], label="groups completed / batch")
    ax.plot(t, [s["expired"] for s in chaos.samples], label="groups expired")
    for at, kind, detail in chaos.timeline:
        if kind in ("kill -9", "SIGSTOP"):
            ax.axvline(at, color="red", alpha=0.3, linewidth=1)
            ax.text(at, 0, detail.split(" ")[0], rotation=90, fontsize=6, va="bottom")
    ax.set_xlabel("seconds")
    ax.legend(loc="upper left")
    ax.set_title("chaos run: faults (red), steps, throughput and expiries")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
