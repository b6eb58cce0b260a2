"""Group filters and the should-continue rule, built-in and by dotted path."""

from __future__ import annotations

import pytest

from rollstream.producer.filters import (
    below_target,
    keep_all,
    load_filter,
    load_should_continue,
    nonzero_reward_std,
)
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import Group, Prompt, Sample

PROMPT = Prompt(uid="u1", task="math", prompt="q", meta={"answer": "1"})


def group(*scores: float | None) -> Group:
    samples = [
        Sample(
            prompt_ids=[1],
            response_ids=[2],
            logprobs=[-0.1],
            response_versions=[0],
            reward={} if score is None else {"score": score},
        )
        for score in scores
    ]
    return Group.for_prompt(PROMPT, samples=samples)


def long_group(group: Group) -> bool:
    """A dotted-path filter for the tests."""
    return group.n >= 3


@pytest.mark.parametrize(
    ("scores", "valid"),
    [
        ((1.0, 0.0, 1.0, 1.0), True),
        ((0.0, 0.0, 0.0, 0.0), False),
        ((1.0, 1.0), False),
        ((0.5, 0.25), True),
        ((1.0,), True),  # one sample: nothing to be relative to, kept
        ((0.0,), True),
        ((), False),  # nothing to train on
        ((1.0, None, 1.0), False),  # an unscored sample does not count as a different score
        ((1.0, None), True),  # fewer than two scores: no spread to measure
    ],
)
def test_nonzero_reward_std(scores: tuple[float | None, ...], valid: bool) -> None:
    assert nonzero_reward_std(group(*scores)) is valid


def test_keep_all() -> None:
    assert keep_all(group(0.0, 0.0))


def test_below_target() -> None:
    assert below_target(0, 4)
    assert below_target(3, 4)
    assert not below_target(4, 4)
    assert not below_target(5, 4)
    assert not below_target(0, 0)


def test_load_filter_builtins_and_dotted_paths() -> None:
    assert load_filter("nonzero_reward_std") is nonzero_reward_std
    assert load_filter("keep_all") is keep_all
    loaded = load_filter("tests.unit.test_filters:long_group")
    assert loaded(group(1.0, 1.0, 1.0)) and not loaded(group(1.0))
    assert load_filter("tests.unit.test_filters.long_group") is long_group


def test_load_should_continue() -> None:
    assert load_should_continue("below_target") is below_target
    assert load_should_continue("rollstream.producer.filters:below_target") is below_target


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonzero_std", r"filter 'nonzero_std': not a built-in \(nonzero_reward_std, keep_all\)"),
        ("tests.unit.nope:f", "module 'tests.unit.nope' not found"),
        ("rollstream.producer.filters:nope", "'rollstream.producer.filters' has no attribute 'nope'"),
        ("rollstream.producer.filters:BUILTIN_FILTERS", "is not callable"),
    ],
)
def test_load_filter_errors(spec: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_filter(spec)


def test_load_should_continue_error_names_the_kind() -> None:
    with pytest.raises(SettingsError, match=r"^should_continue 'forever'"):
        load_should_continue("forever")
