from __future__ import annotations

import pytest

from shared.errors import SettingsError
from shared.keys import Keys


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
