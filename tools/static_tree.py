"""A tree of links that static tools can read the package from.

pyproject.toml's package-dir maps the folders at the root of the checkout into
`rollstream` (shared/buffer.py is rollstream.shared.buffer). An editable install makes that
work at run time with setuptools' import hook, which no static tool runs: pyright/pylance,
jedi or an import-graph tool reading the checkout find `rollstream/` holding only
`__init__.py`. setuptools' own answer, its strict editable mode, puts a tree of links on
sys.path in place of the hook; but a python started in the checkout's root (pytest,
`python -m`) finds the checkout's `rollstream/` first and then none of the parts, which only
the hook maps. So the install keeps the hook, and this adds what strict mode would: the tree
(build/static-tree/rollstream/..., one link per module, rebuilt from scratch) and a .pth
file naming it in the environment's site-packages, which pyright reads (jedi too,
but with a project rooted at the checkout it stops at the checkout's rollstream/).

At run time the tree is one more entry on sys.path: a python started outside the checkout
imports the package through its links (the same files), and a module added after the tree
was made is still found by the hook. `make` rebuilds the tree when a folder of the package
changes (a module added, moved or removed).

    python tools/static_tree.py            # (re)build the tree and the .pth file
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "static-tree"
PTH = "rollstream-static-tree.pth"


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """pyproject.toml's package-dir mapping: import package name -> folder."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = project["tool"]["setuptools"]["package-dir"]
    return {package: root / folder for package, folder in mapping.items()}


def mapped_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the mapped folders, by the name it is imported by."""
    dirs = package_dirs(root)
    modules: dict[str, Path] = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            # a folder mapped on its own (rollstream.shared -> shared/) is listed once, by
            # its own mapping, even where another mapping's folder holds it
            holders = [p for p, d in dirs.items() if path.is_relative_to(d)]
            owner = max(holders, key=lambda p: len(dirs[p].parts))
            if owner != package:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def build(root: Path = ROOT, tree: Path = TREE) -> int:
    """Links every module of the package at its import path under ``tree``; the count."""
    shutil.rmtree(tree, ignore_errors=True)
    modules = mapped_modules(root)
    for name, path in modules.items():
        parts = name.split(".")
        target = tree.joinpath(*parts, "__init__.py") if path.name == "__init__.py" else None
        if target is None:
            target = tree.joinpath(*parts[:-1], f"{parts[-1]}.py")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path, target)
    return len(modules)


def main() -> int:
    count = build()
    site = Path(sysconfig.get_paths()["purelib"])
    (site / PTH).write_text(f"{TREE}\n")
    print(f"static tree: {count} modules linked under {TREE.relative_to(ROOT)}, named in {site / PTH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
