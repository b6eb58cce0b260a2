"""rollstream installs one import package, `rollstream`: the parts at the root of the
checkout (shared/, producer/, consumer/, cli/) are mapped into it by pyproject.toml's
package-dir, one file per module, with no symbolic links; they are imported only as
rollstream.<part>, never as top-level modules that would collide in site-packages or load
twice. A wheel, an sdist, and an editable install of a checkout made without symbolic links
(core.symlinks=false, as on Windows) all hold or find every module."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import site
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path
from typing import Any

from tests.helpers import require

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("shared", "producer", "consumer", "recipes", "cli")
TOP_LEVEL_IMPORT = re.compile(rf"^\s*(from|import)\s+({'|'.join(PARTS)})\b", re.M)
SKIP = {".venv", ".git", "build", "dist", "var", "__pycache__"}


def _sources() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if not SKIP.intersection(p.relative_to(ROOT).parts)]


def _package_modules() -> set[str]:
    """Every module of the parts, as the path it has in an installed rollstream."""
    files = {"rollstream/__init__.py"}
    for part in PARTS:
        for path in (ROOT / part).rglob("*.py"):
            if not SKIP.intersection(path.relative_to(ROOT).parts):
                files.add(f"rollstream/{part}/{path.relative_to(ROOT / part).as_posix()}")
    return files


def _run(command: list[str], cwd: Path, timeout: float = 60) -> str:
    out = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{command}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
    return out.stdout


def test_no_source_imports_a_part_as_a_top_level_module() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        for path in _sources()
        for text in [path.read_text()]
        for m in TOP_LEVEL_IMPORT.finditer(text)
    ]
    assert len(_sources()) > 50
    assert offenders == []


# the parts of rollstream each folder may import besides its own: shared at the ground,
# producer and consumer beside each other, recipes composing both, cli and the tools on top
LAYERS = {
    "shared": set(),
    "producer": {"shared"},
    "consumer": {"shared"},
    "recipes": {"shared", "producer", "consumer"},
    "cli": {"shared", "producer", "consumer", "recipes"},
    "bench": {"shared", "producer", "consumer", "recipes"},
    "chaos": {"shared", "producer", "consumer", "recipes"},
}


def _parts_imported(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "rollstream":
            names = [f"rollstream.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("rollstream.")]
    return found


def test_each_folder_imports_only_the_layers_below_it() -> None:
    # bench imported the learning recipes from cli (cli/learning.py, cli/reverse.py)
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports rollstream.{part}"
        for folder, allowed in LAYERS.items()
        for path in (ROOT / folder).rglob("*.py")
        for line, part in _parts_imported(ast.parse(path.read_text()))
        if part != folder and part not in allowed
    ]
    assert offenders == []


def test_the_checkout_holds_no_symbolic_links() -> None:
    # mode 120000 is a symbolic link in git's index
    staged = _run(["git", "ls-files", "--stage"], ROOT).splitlines()
    assert len(staged) > 50
    assert [line.split("\t")[-1] for line in staged if line.startswith("120000")] == []


def test_package_dir_maps_each_part_and_the_script_points_into_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"rollstream": "rollstream", **{f"rollstream.{p}": p for p in PARTS}}
    # every folder holding modules is a package of its own in the list, and nothing else is
    folders = {path.parent for module in _package_modules() for path in [ROOT / module]}
    expected = {".".join(folder.relative_to(ROOT).parts) for folder in folders}
    assert sorted(setuptools["packages"]) == sorted(expected)
    assert project["project"]["scripts"]["rollstream"] == "rollstream.cli.main:entry"


def _static_tree() -> Any:
    spec = importlib.util.spec_from_file_location("static_tree", ROOT / "tools" / "static_tree.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_type_check_sees_every_module_by_its_package_name() -> None:
    # mypy does not follow package-dir: tools/typecheck.py hands it each file by name, from
    # the mapping tools/static_tree.py reads
    modules = _static_tree().mapped_modules()
    as_installed = {
        name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
        for name, path in modules.items()
    }
    assert as_installed == _package_modules()
    assert modules["rollstream.shared.buffer"] == ROOT / "shared" / "buffer.py"


def test_pyright_resolves_the_package_from_the_checkout(tmp_path: Path) -> None:
    """No static tool runs setuptools' import hook: from the checkout, where rollstream/ holds
    only __init__.py, pyright resolves the parts through the tree of links that `make` puts
    on the environment's path (tools/static_tree.py), and still reports a module that is
    not there."""
    require("pyright", "lint", load=False)
    pth = Path(sysconfig.get_paths()["purelib"]) / "rollstream-static-tree.pth"
    assert pth.is_file(), "no static tree in this environment: run make (or python tools/static_tree.py)"
    tree = Path(pth.read_text().strip())
    assert (tree / "rollstream" / "shared" / "buffer.py").resolve() == ROOT / "shared" / "buffer.py"
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from rollstream.shared.buffer import ReplayBuffer\n"
        "from rollstream.producer.engines.hf import HFEngine\n"
        "import rollstream.consumer.batches as batches\n"
        "import rollstream.shared.not_a_module\n"
        "reveal_type(ReplayBuffer)\nreveal_type(HFEngine)\nreveal_type(batches.BatchReader)\n"
    )
    pyright = Path(sys.executable).with_name("pyright")
    out = subprocess.run(
        [str(pyright), "--pythonpath", sys.executable, str(probe)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    for name in ("type[ReplayBuffer]", "type[HFEngine]", "type[BatchReader]"):
        assert f'is "{name}"' in text, text
    unresolved = re.findall(r'Import "([\w.]+)" could not be resolved', text)
    assert unresolved == ["rollstream.shared.not_a_module"], text


def test_importing_everything_loads_no_top_level_part(tmp_path: Path) -> None:
    # From outside the checkout, as an installed user would: nothing named shared, cli, ...
    code = (
        "import sys, rollstream.cli.main, rollstream.consumer, rollstream.producer.worker;"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {PARTS!r}))"
    )
    assert _run([sys.executable, "-c", code], tmp_path).strip() == "[]"


def test_the_sdist_and_the_wheel_built_from_it_hold_every_module(tmp_path: Path) -> None:
    # What `python -m build` does, offline: the sdist from the checkout, the wheel from the
    # unpacked sdist, through setuptools' own build hooks.
    dist = tmp_path / "dist"
    dist.mkdir()
    hook = "import sys, setuptools.build_meta as b; print(b.build_{}(sys.argv[1]))"
    sdist = dist / _run([sys.executable, "-c", hook.format("sdist"), str(dist)], ROOT).splitlines()[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for part in PARTS:
        for module in _package_modules():
            if module.startswith(f"rollstream/{part}/"):
                assert module.removeprefix("rollstream/") in in_sdist, module
    assert {"pyproject.toml", "README.md", "rollstream/__init__.py"} <= in_sdist
    assert not any(name.startswith("rollstream/") and name != "rollstream/__init__.py" for name in in_sdist)

    (source,) = (tmp_path / "unpacked").iterdir()
    wheel = dist / _run([sys.executable, "-c", hook.format("wheel"), str(dist)], source).splitlines()[-1]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert {name for name in names if name.endswith(".py")} == _package_modules()
    assert {name.split("/")[0] for name in names} == {"rollstream", "rollstream-0.1.0.dist-info"}
    entry_points = zipfile.ZipFile(wheel).read("rollstream-0.1.0.dist-info/entry_points.txt").decode()
    assert "rollstream = rollstream.cli.main:entry" in entry_points


def test_a_checkout_without_symbolic_links_installs_and_imports(tmp_path: Path) -> None:
    # A Windows checkout (core.symlinks=false): any link would be a text file holding its
    # target. Installed (editable, as a developer does) into a fresh venv that borrows this
    # environment's packages through a .pth, so that nothing is downloaded.
    clone, venv = tmp_path / "clone", tmp_path / "venv"
    _run(["git", "-c", "core.symlinks=false", "clone", "--quiet", str(ROOT), str(clone)], tmp_path)
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    venv_site = Path(_run([str(python), "-c", purelib], tmp_path).strip())
    (venv_site / "_borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    _run([*pip, "--editable", str(clone)], tmp_path, timeout=120)

    code = "import rollstream.shared.buffer as b, rollstream.cli.main; print(b.__file__)"
    assert Path(_run([str(python), "-c", code], tmp_path).strip()) == clone / "shared" / "buffer.py"


def test_the_settings_tree_reaches_few_modules_on_the_produce_path() -> None:
    # issue 22: the tree handed to `rollstream produce` entered 20 modules; each part now takes
    # its own sections (ReplayBuffer its BufferSettings, GroupRunner the producer's, the pool
    # the engines'), and the tree stays with the process's composition root
    spec = importlib.util.spec_from_file_location("settings_reach", ROOT / "tools" / "settings_reach.py")
    assert spec is not None and spec.loader is not None
    reach = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reach)
    hits = reach.reached()
    # the walk follows the lazy imports into the producer's composition root
    assert "rollstream.producer.assembly" in hits
    assert "rollstream.producer.worker" not in hits  # issue 33: the produce loop takes its parts
    assert len(hits) <= reach.LIMIT == 8, hits
    narrow = ("shared.buffer", "producer.group", "producer.fleet", "producer.engines")
    assert not [name for name in hits if name.removeprefix("rollstream.").startswith(narrow)], hits


def test_no_module_outside_bench_and_tests_is_over_500_lines() -> None:
    # issue 22: a module a newcomer can read at one sitting; cli/commands.py had 1,027 lines,
    # shared/settings.py 973, shared/codec.py 814
    long = {
        str(path.relative_to(ROOT)): lines
        for path in _sources()
        if path.relative_to(ROOT).parts[0] not in ("bench", "tests")
        and (lines := len(path.read_text().splitlines())) > 500
    }
    assert _sources() and not long, long


def test_under_consumer_only_the_composition_root_imports_the_settings_tree() -> None:
    # issue 33: BatchReader, ReferenceTrainer, Archiver, BatchCoordinator take parts and
    # plans; consumer/assembly.py reads the tree (consumer/__init__.py re-exports its doors)
    allowed = {"assembly.py", "__init__.py"}
    offenders = []
    for path in sorted((ROOT / "consumer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "rollstream.shared.settings"
                and any(alias.name == "Settings" for alias in node.names)
                and path.name not in allowed
            ):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
    init = (ROOT / "consumer" / "__init__.py").read_text()
    assert "from rollstream.shared.settings import" not in init  # through the assembly
