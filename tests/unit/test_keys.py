from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollstream.shared.errors import SettingsError
from rollstream.shared.keys import (
    FORMAT,
    GROUP_OF_KIND,
    GROUPS,
    MODEL_STEP,
    PAUSED,
    RAY_ADDRESS,
    ROLES,
    RUN_SETTINGS,
    STREAM_KINDS,
    TRAIN_STEP,
    TRAINER,
    UNTRAINABLE,
    Count,
    Keys,
    feeder_cursor_field,
    feeder_write_field,
    producer_beat_field,
    progress_field,
)


def test_every_key_of_a_run_shares_the_hash_tag() -> None:
    keys = Keys("exp1")
    names = [
        keys.prompts("math"), keys.aborted("math"), keys.expired("math"), keys.groups("math"),
        keys.eval("b1"), keys.events, keys.dead, keys.state, keys.progress, keys.metrics, keys.fed("math"),
    ]  # fmt: skip
    assert all(name.startswith("rs:{exp1}:") for name in names)
    assert keys.groups("math") == "rs:{exp1}:groups:math"
    assert len(set(names)) == len(names)


def test_parse_stream_inverts_stream() -> None:
    keys = Keys("exp1")
    assert keys.parse_stream(keys.aborted("code")) == ("aborted", "code")
    assert keys.parse_stream("rs:{other}:groups:code") is None
    assert keys.parse_stream(keys.dead) is None


@pytest.mark.parametrize("bad", ["a b", "x{y}", "a:b", "a*", ""])
def test_names_that_would_break_a_key_are_refused(bad: str) -> None:
    with pytest.raises(SettingsError):
        Keys("exp1").prompts(bad)
    with pytest.raises(SettingsError):
        Keys(bad)


# The names below are on the wire: docs/stream-format.md is the contract a trainer of
# another framework is written from, so keys.py and that document must agree.
DOC = (Path(__file__).resolve().parents[2] / "docs" / "stream-format.md").read_text(encoding="utf-8")


def _section(number: int) -> str:
    start = DOC.index(f"\n## {number}. ")
    return DOC[start : DOC.index("\n## ", start + 1)]


def test_the_counters_are_the_documented_ones() -> None:
    rows = [line for line in _section(7).splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert documented == {c.value for c in Count}


def test_admission_subtracts_the_documented_counters() -> None:
    formula = re.search(r"accepted = completed − (.+)", _section(7))
    assert formula is not None
    assert tuple(formula.group(1).strip().split(" − ")) == UNTRAINABLE


def test_the_roles_are_the_documented_ones() -> None:
    line = re.search(r"role one of (.+?): a string", " ".join(_section(8).split()))
    assert line is not None
    assert tuple(re.findall(r"`(\w+)`", line.group(1))) == ROLES


def test_fields_are_spelled_as_documented() -> None:
    assert progress_field("math", Count.COMPLETED) == "math:completed"
    assert f"`{progress_field('{task}', Count.DEAD)}`" in DOC  # `{task}:dead`
    assert producer_beat_field("p1") == "producer:p1"
    assert feeder_cursor_field("math") == "feeder:math:cursor"
    assert feeder_write_field("math") == "feeder:math:write"
    for field in (MODEL_STEP, TRAIN_STEP, FORMAT, RUN_SETTINGS, RAY_ADDRESS, PAUSED, "producer:{name}",
                  "feeder:{task}:cursor", "feeder:{task}:write"):  # fmt: skip
        assert f"| `{field}` |" in _section(6), field


def test_each_stream_kind_has_its_group() -> None:
    assert set(GROUP_OF_KIND) == set(STREAM_KINDS)
    assert {kind for kind, group in GROUP_OF_KIND.items() if group == TRAINER} == {GROUPS}
    assert all(f"`rs:{{run}}:{kind}:{{task}}`" in DOC for kind in STREAM_KINDS)


def test_a_progress_field_needs_a_known_counter() -> None:
    with pytest.raises(ValueError, match="finished"):
        progress_field("math", "finished")  # type: ignore[arg-type]
