"""The chaos suite's archive account: a trained group archived twice (a file written
again after a kill), or not at all, is counted, from the Parquet files as they lie."""

from __future__ import annotations

from pathlib import Path

from chaos.run import archived
from tests.helpers import require


def _write(folder: Path, name: str, groups: list[str], samples: int = 4) -> None:
    pa = require("pyarrow", "archive")
    pq = require("pyarrow.parquet", "archive")
    folder.mkdir(parents=True, exist_ok=True)
    rows = [(g, i) for g in groups for i in range(samples)]
    table = pa.table(
        {"group_id": [g for g, _ in rows], "sample_index": pa.array([i for _, i in rows], pa.int32())}
    )
    pq.write_table(table, folder / name)


def test_each_trained_group_archived_once_is_counted_once(tmp_path: Path) -> None:
    root = tmp_path / "trained"
    _write(root / "step-1", "part-1.parquet", ["math:q0@0", "math:q1@0"])
    _write(root / "step-2", "part-2.parquet", ["math:q2@0"])
    _write(root / "step-2", ".part-3.archiver.tmp", ["math:q2@0"])  # a hidden leftover: not read
    account = archived(root, {"math:q0@0", "math:q1@0", "math:q2@0"})
    assert account["archived_once"] == account["trained_groups"] == 3
    assert account["archived_twice"] == account["trained_not_archived"] == 0


def test_a_group_archived_twice_or_missing_is_counted(tmp_path: Path) -> None:
    root = tmp_path / "trained"
    _write(root / "step-1", "part-1.parquet", ["math:q0@0", "math:q1@0"])
    _write(root / "step-1", "part-2.parquet", ["math:q1@0", "math:q9@0"])  # q1 again
    account = archived(root, {"math:q0@0", "math:q1@0", "math:q2@0"})
    assert account["archived_twice"] == 1
    assert account["archived_once"] == 1  # q0
    assert account["trained_not_archived"] == 1  # q2
    assert account["archived_not_in_record"] == 1  # q9
    assert archived(tmp_path / "none", {"math:q0@0"})["trained_not_archived"] == 1
