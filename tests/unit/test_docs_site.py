"""The documentation site (mkdocs.yml, docs/): every page is in the navigation and in what
the documentation tests read (tests.helpers.documentation), the README's links lead to
files that exist, and `mkdocs build --strict` passes (a broken link, anchor or API
reference fails it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import DOCS_PAGES, require

ROOT = Path(__file__).resolve().parents[2]


def nav_pages() -> set[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return {page for item in config["nav"] for page in item.values()}


def test_every_page_is_in_the_navigation_and_in_what_the_tests_read() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert nav_pages() == pages
    assert {f"docs/{p}" for p in pages - {"api.md"}} == set(DOCS_PAGES) - {"README.md"}


def test_the_readme_is_short_and_its_links_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 80
    assert "make demo" in readme and "make test" in readme
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert links
    assert [link for link in links if not (ROOT / link).exists()] == []


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    require("mkdocs", "docs", load=False)
    require("mkdocstrings", "docs", load=False)
    # the API reference reads the package through the static tree (`make` builds it)
    tree = ROOT / "build" / "static-tree" / "rollstream"
    assert tree.is_dir(), "no static tree in this checkout: run make (or python tools/static_tree.py)"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "BatchCoordinator" in api  # the reference is generated from the docstrings
