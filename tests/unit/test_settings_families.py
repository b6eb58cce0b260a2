"""The settings tree composes the families' models (issue 22): the engines' in
shared/engine_settings.py, the algorithm's in shared/algorithm_settings.py, and the
message machinery in shared/settings_errors.py walks whatever root it is given. Each of
these imports no settings module above it. Each name has one home (issue 33): the
families' names import from their own modules, not from rollstream.shared.settings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from rollstream.shared import algorithm_settings, engine_settings, settings, settings_errors
from rollstream.shared.errors import SettingsError
from rollstream.shared.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]


def _rollstream_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollstream"):
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rollstream")}
    return found


def test_the_family_modules_sit_below_the_tree() -> None:
    # pydantic only: an engine or a trainer imports its family's model without the tree
    assert _rollstream_imports(ROOT / "shared" / "engine_settings.py") == set()
    assert _rollstream_imports(ROOT / "shared" / "algorithm_settings.py") == set()
    assert _rollstream_imports(ROOT / "shared" / "settings_errors.py") == {"rollstream.shared.errors"}


def test_the_engines_take_their_models_from_the_family_module() -> None:
    engines = sorted((ROOT / "producer" / "engines").glob("*.py"))
    assert len(engines) > 5
    users = [p.name for p in engines if "rollstream.shared.engine_settings" in _rollstream_imports(p)]
    assert {"__init__.py", "sim.py", "hf.py", "vllm.py", "http.py", "openai.py", "sglang.py"} <= set(users)
    assert [p.name for p in engines if "rollstream.shared.settings" in _rollstream_imports(p)] == []


def test_the_tree_composes_the_families_models() -> None:
    fields = settings.Settings.model_fields
    assert fields["engines"].annotation is engine_settings.EngineSettings
    assert fields["algorithm"].annotation is algorithm_settings.AlgorithmSettings
    engines = engine_settings.EngineSettings.model_fields
    assert engines["hf"].annotation is engine_settings.HFEngineSettings
    assert engines["openai"].annotation is engines["sglang"].annotation is engine_settings.HTTPEngineSettings


def test_the_tree_does_not_re_export_the_families_names() -> None:
    moved = [name for module in (engine_settings, algorithm_settings) for name in module.__all__]
    assert len(moved) == 13
    used = {"EngineSettings", "AlgorithmSettings", "ENV_PREFIX", "CONFIG_ENV"}  # what the tree itself reads
    for name in moved:
        assert name in used or not hasattr(settings, name), name
    for name in ("DEFAULT_CONFIG_FILE", "NON_SETTING_ENV", "redact_url"):
        assert not hasattr(settings, name), name
    tree = ast.parse((ROOT / "shared" / "settings.py").read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert [a.name for node in imports for a in node.names if a.asname == a.name] == []


class _Inner(BaseModel):
    size: int = Field(default=1, ge=1)


class _Root(BaseModel):
    inner: _Inner = Field(default_factory=_Inner)


def test_the_messages_walk_the_root_they_are_given() -> None:
    # a root of its own: the machinery names its settings, not the rollstream tree's
    env = {"ROLLSTREAM_INNER__SIZ": "2", "ROLLSTREAM_INNER": "{"}
    problems = settings_errors.check_env(_Root, env, {name: name for name in env})
    assert [line for line, _ in problems] == [
        "invalid setting inner.siz (ROLLSTREAM_INNER__SIZ): is not a setting, got '2'; "
        "did you mean ROLLSTREAM_INNER__SIZE?",
        "invalid setting inner (ROLLSTREAM_INNER): not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1)); expected a JSON object of inner's settings, as in "
        "{\"size\": 1} (or set ROLLSTREAM_INNER__SIZE and the like instead), got '{'",
    ]


def test_a_lora_run_needs_engines_that_merge_adapters() -> None:
    # algorithm.lora_rank > 0: syncs carry the adapter only (consumer/lora.py), which hf and
    # vllm engines merge
    tree = load_settings(algorithm={"lora_rank": 8}, engines={"kind": "hf"})
    assert tree.algorithm.lora_rank == 8 and tree.algorithm.lora_targets[0] == "q_proj"
    assert load_settings(algorithm={"lora_rank": 8}, engines={"kind": "vllm"}).engines.kind == "vllm"
    with pytest.raises(SettingsError, match=r"algorithm\.lora_rank is 8.*engines\.kind 'sglang'"):
        load_settings(algorithm={"lora_rank": 8}, engines={"kind": "sglang"})
    with pytest.raises(SettingsError, match=r"algorithm\.lora_rank"):
        load_settings(algorithm={"lora_rank": -1})
