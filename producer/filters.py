"""The filter plug-in points: group filters (``producer.is_valid``) and the
should-continue rule of the produce loop (``producer.should_continue``). Filter
authors import from here only.

``is_valid(group) -> bool`` decides whether a completed, judged group is worth
training on; a rejected group is counted as FILTERED and dropped.
``should_continue(completed, target) -> bool`` decides whether a producer in sync
mode keeps generating for a batch. Both are a built-in name (``BUILTIN_FILTERS``,
``BUILTIN_SHOULD_CONTINUE``) or a dotted path ``package.module:attr``, resolved like
judges (a class there is built with no arguments).

    from rollstream.producer.filters import Group

    def long_enough(group: Group) -> bool:  # producer.is_valid = "mypkg.filters:long_enough"
        return all(len(s.response_ids) >= 8 for s in group.samples)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

from rollstream.producer.plugins import load_callable
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import Group, Prompt, Sample

__all__ = [
    "BUILTIN_FILTERS",
    "BUILTIN_SHOULD_CONTINUE",
    "Group",
    "IsValid",
    "Prompt",
    "Sample",
    "ShouldContinue",
    "below_target",
    "keep_all",
    "load_filter",
    "load_should_continue",
    "nonzero_reward_std",
]

IsValid = Callable[[Group], bool]
ShouldContinue = Callable[[int, int], bool]


def nonzero_reward_std(group: Group) -> bool:
    """Keep groups whose scores differ.

    With group-relative advantages (GRPO) a group whose samples all scored the
    same has zero advantage everywhere and teaches nothing. A single sample has
    no group to be relative to and is kept; so is a group with fewer than two
    scored samples, since no spread can be measured. An empty group is dropped.
    """
    if not group.samples:
        return False
    scores = [s.score for s in group.samples if s.score is not None]
    return len(scores) < 2 or len(set(scores)) > 1


def keep_all(group: Group) -> bool:
    """XTuner's default: every completed group is valid."""
    return True


def below_target(completed: int, target: int) -> bool:
    """Keep producing until the batch has its target of completed groups."""
    return completed < target


BUILTIN_FILTERS: Mapping[str, IsValid] = {
    "nonzero_reward_std": nonzero_reward_std,
    "keep_all": keep_all,
}

BUILTIN_SHOULD_CONTINUE: Mapping[str, ShouldContinue] = {"below_target": below_target}


def _load(spec: str, kind: str, builtins: Mapping[str, Callable[..., bool]]) -> Callable[..., bool]:
    spec = spec.strip()
    if spec in builtins:
        return builtins[spec]
    if "." not in spec and ":" not in spec:
        raise SettingsError(
            f"{kind} {spec!r}: not a built-in ({', '.join(builtins)}) "
            "and not a dotted path 'package.module:attr'"
        )
    return cast(Callable[..., bool], load_callable(spec, kind))


def load_filter(spec: str) -> IsValid:
    """The group filter ``spec`` names: a built-in or a dotted path; a SettingsError
    naming the spec and what is wrong otherwise."""
    return _load(spec, "filter", BUILTIN_FILTERS)


def load_should_continue(spec: str) -> ShouldContinue:
    """The should-continue rule ``spec`` names: a built-in or a dotted path."""
    return _load(spec, "should_continue", BUILTIN_SHOULD_CONTINUE)
