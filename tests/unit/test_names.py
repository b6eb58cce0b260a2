"""Key names live in shared/keys.py alone: no other source file spells a key, a part of a
key, a consumer-group name or a progress counter, and no Lua script hard-codes one (a
script gets them in ARGV, or formatted in from keys.py when it is loaded).

The check reads the source (the string literals of every module, f-string pieces
included, docstrings left out) rather than running it, so that it sees code no test
reaches. Status values such as "completed" or metrics fields such as "aborted" are the
same words as some counters; they are not flagged, because a counter is only ever
spelled as a progress field (``{task}:{counter}``) or inside a script."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollstream.shared import scripts
from rollstream.shared.keys import PRODUCERS, STREAM_KINDS, TRAINER, Count

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ("shared", "producer", "consumer", "cli")
KEYS_MODULE = Path("shared/keys.py")

GROUP_NAMES = (PRODUCERS, TRAINER)
COUNTERS = tuple(c.value for c in Count)
# Every part of a key after the run's hash tag (shared/keys.py's table)
KEY_PARTS = (*STREAM_KINDS, "eval", "batch", "events", "dead", "state", "progress", "metrics", "fed",
             "fence", "alive", "rq", "adapter")  # fmt: skip

_PARTS = "|".join(KEY_PARTS)
_COUNTERS = "|".join(COUNTERS)
KEY_SHAPED = {
    "a key part between colons, as in rs:{run}:groups:{task}": re.compile(rf"(^|:)({_PARTS}):(?!\s)"),
    "a key ending in a key part, as in rs:{run}:events": re.compile(rf":({_PARTS})$"),
    "a progress field, as in math:completed": re.compile(rf":({_COUNTERS})$"),
    "the key prefix rs:": re.compile(r"^rs:"),
    "a state field prefix (producer:{name}, feeder:{task}:cursor)": re.compile(r"^(producer|feeder):(?!\s)"),
}
# A Lua name in quotes: what a script would compare or pass to Redis
LUA_NAME = re.compile(rf"""['"]({"|".join((*GROUP_NAMES, *COUNTERS, *STREAM_KINDS))})['"]""")
LUA_MARK = re.compile(r"redis\.p?call|KEYS\[|ARGV\[")


def source_files(root: Path) -> list[Path]:
    files = [p for folder in SOURCE for p in sorted((root / folder).rglob("*.py"))]
    return [p for p in files if p.relative_to(root) != KEYS_MODULE]


def literals(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every string literal of a module but its docstrings; an f-string
    gives its literal pieces."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def misspelled(root: Path) -> list[str]:
    """Every name spelled outside shared/keys.py, as ``path:line: what``, in line order."""
    found: list[tuple[Path, int, str]] = []
    for path in source_files(root):
        where = path.relative_to(root)
        for line, text in literals(path):
            if text in GROUP_NAMES:
                found.append(
                    (where, line, f"{text!r}: a consumer group's name (keys.PRODUCERS, keys.TRAINER)")
                )
            if LUA_MARK.search(text):
                found += [(where, line, f"{m.group(0)} in a Lua script") for m in LUA_NAME.finditer(text)]
                continue  # a script's text is not a key
            for what, pattern in KEY_SHAPED.items():
                if pattern.search(text):
                    found.append((where, line, f"{what}: {text[:60]!r}"))
    return [f"{where}:{line}: {what}" for where, line, what in sorted(found)]


def test_no_source_file_but_keys_spells_a_name() -> None:
    assert misspelled(ROOT) == []


def test_the_check_finds_each_kind_of_name(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "keys.py").write_text('PRODUCERS = "producers"\n')  # allowed there
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "bad.py").write_text(
        '"""A docstring may say rs:{run}:groups:{task} and "producers"."""\n'
        'filtered = progress.get("math:filtered", 0)\n'
        'done = progress[f"{task}:completed"]\n'
        'client.xpending(stream, "producers")\n'
        'key = f"rs:{{{run}}}:events"\n'
        'beat = "producer:" + name\n'
        "LUA = \"redis.call('XREADGROUP', 'GROUP', 'trainer', ARGV[1])\"\n"
        'print(f"feeder: {n} prompts")\n'  # a log line, not a key
    )
    found = misspelled(tmp_path)
    assert [f.split(":", 2)[1] for f in found] == ["2", "3", "4", "5", "5", "6", "7"], found
    assert "'trainer' in a Lua script" in found[-1]


@pytest.mark.parametrize(
    "name", [n for n in dir(scripts) if n.isupper() and isinstance(getattr(scripts, n), str)]
)
def test_loaded_scripts_hard_code_no_group_or_counter(name: str) -> None:
    """The scripts as Redis gets them, after any names were formatted in."""
    text = getattr(scripts, name)
    if LUA_MARK.search(text):
        assert LUA_NAME.findall(text) == []
