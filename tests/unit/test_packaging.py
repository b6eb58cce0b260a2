"""rollstream installs one import package, `rollstream`: the parts at the root of the
checkout (shared/, producer/, consumer/, cli/) are imported only as rollstream.<part>,
never as top-level modules that would collide in site-packages or load twice."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("shared", "producer", "consumer", "cli")
TOP_LEVEL_IMPORT = re.compile(rf"^\s*(from|import)\s+({'|'.join(PARTS)})\b", re.M)


def _sources() -> list[Path]:
    skip = {".venv", ".git", "rollstream", "build", "var"}
    return [p for p in ROOT.rglob("*.py") if not skip.intersection(p.relative_to(ROOT).parts)]


def test_no_source_imports_a_part_as_a_top_level_module() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        for path in _sources()
        for text in [path.read_text()]
        for m in TOP_LEVEL_IMPORT.finditer(text)
    ]
    assert len(_sources()) > 50
    assert offenders == []


def test_the_package_links_every_part() -> None:
    for part in PARTS:
        link = ROOT / "rollstream" / part
        assert link.is_symlink() and link.resolve() == ROOT / part, part


def test_only_rollstream_is_installed_and_the_script_points_into_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["rollstream*"]
    assert project["project"]["scripts"]["rollstream"] == "rollstream.cli.main:entry"


def test_importing_everything_loads_no_top_level_part(tmp_path: Path) -> None:
    # From outside the checkout, as an installed user would: nothing named shared, cli, ...
    code = (
        "import sys, rollstream.cli.main, rollstream.consumer, rollstream.producer.worker;"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {PARTS!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
