"""Which modules the settings tree handed to `rollstream produce` reaches.

`rollstream produce` builds the whole Settings tree (cli/dispatch.py) and hands it to
cli/produce.py. A module is reached when it names the tree's root class, ``Settings``,
imported from rollstream.shared.settings: it takes the tree, not the sections it uses.
This walks the imports of cli/produce.py (module level and inside functions, the lazy
ones included: a producer process runs them), keeps the package's own modules, and lists
those that name the root class. Issue 22's target: at most 8, so that a change to one
section touches the modules that use it and not every module on the path.

    python tools/settings_reach.py          # the list, and the count against the limit

tests/unit/test_packaging.py holds the limit.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# cmd_produce in cli/dispatch.py builds the tree and hands it to cli/produce.py
BUILDER = "rollstream.cli.dispatch"
ENTRY = "rollstream.cli.produce"
ROOT_CLASS = ("rollstream.shared.settings", "Settings")
LIMIT = 8


def module_files() -> dict[str, Path]:
    """Each module of the package by its import name, from pyproject.toml's mapping."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = config["package-dir"]
    files: dict[str, Path] = {}
    for package in config["packages"]:
        mapped = max((key for key in folders if package == key or package.startswith(f"{key}.")), key=len)
        folder = ROOT / folders[mapped] / Path(*package[len(mapped) :].split(".")[1:])
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            files[name] = path
    return files


def imports(path: Path, name: str, known: dict[str, Path]) -> tuple[set[str], bool]:
    """The package modules ``path`` imports anywhere in it, and whether it names the root
    Settings class."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    names_root = False
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if base in known:
                found.add(base)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
                if (base, alias.name) == ROOT_CLASS:
                    names_root = True
    return found, names_root


def reached() -> list[str]:
    """The modules on `rollstream produce`'s import path that name the root Settings class
    (rollstream.shared.settings itself left out)."""
    known = module_files()
    seen: set[str] = set()
    todo = [ENTRY]
    hits = [BUILDER]
    while todo:
        name = todo.pop()
        if name in seen or name not in known:
            continue
        seen.add(name)
        found, names_root = imports(known[name], name, known)
        if names_root:
            hits.append(name)
        todo.extend(found - seen)
    return sorted(hits)


def main() -> int:
    hits = reached()
    for name in hits:
        print(name)
    print(f"{len(hits)} modules on the produce path take the whole Settings tree (limit {LIMIT})")
    return 0 if len(hits) <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
