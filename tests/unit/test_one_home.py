"""One home per name (issue 33): no module keeps a name importable only so that an old
import path still works. A name imported "as" itself is a re-export, and a module-level
``__getattr__`` forwards names to other modules; only the public facades may do either."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# the public facades that load their names on first use (producer/agents: a tool's sandbox
# must not pay for the producer's imports)
FORWARDING = {"rollstream.producer.agents"}


def _modules() -> dict[str, ast.Module]:
    spec = importlib.util.spec_from_file_location("static_tree", ROOT / "tools" / "static_tree.py")
    assert spec is not None and spec.loader is not None
    static_tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(static_tree)
    modules = {name: ast.parse(path.read_text()) for name, path in static_tree.mapped_modules(ROOT).items()}
    assert len(modules) > 50
    return modules


def test_no_module_imports_a_name_as_itself() -> None:
    found = [
        f"{name}: {alias.name}"
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    ]
    assert found == []


def test_only_the_public_facades_forward_names() -> None:
    forwarding = {
        name
        for name, tree in _modules().items()
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    }
    assert forwarding == FORWARDING
