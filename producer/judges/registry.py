"""Judges by name: a built-in judge, or any callable named by a dotted path.

A spec is a built-in name ("math", "exact", "regex", "reverse") or a dotted path,
"package.module:attr" or "package.module.attr", loaded by the plug-in loader
(rollstream.producer.plugins). A class found there is instantiated with no arguments; a
function or callable object is used as it is. Every failure is a SettingsError that
names the spec and what is wrong with it, since a spec comes from the settings and
fails once, at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

from rollstream.producer.judges.base import Judge
from rollstream.producer.judges.match import ExactMatchJudge, RegexJudge
from rollstream.producer.judges.math import MathJudge
from rollstream.producer.judges.reverse import ReverseJudge
from rollstream.producer.plugins import load_callable
from rollstream.shared.errors import SettingsError

BUILTIN_JUDGES: Mapping[str, Callable[[], Judge]] = {
    "math": MathJudge,
    "exact": ExactMatchJudge,
    "regex": RegexJudge,
    "reverse": ReverseJudge,  # the reverse task's (rollstream.recipes.reverse)
}


def load_judge(spec: str) -> Judge:
    """The judge ``spec`` names (``producer.judge``): a built-in, or a dotted path to a
    callable (a class there is built with no arguments); otherwise a SettingsError that
    names the spec and what is wrong with it."""
    spec = spec.strip()
    builtin = BUILTIN_JUDGES.get(spec)
    if builtin is not None:
        return builtin()
    if "." not in spec and ":" not in spec:
        names = ", ".join(BUILTIN_JUDGES)
        raise SettingsError(
            f"judge {spec!r}: not a built-in judge ({names}) and not a dotted path 'package.module:attr'"
        )
    return cast(Judge, load_callable(spec, "judge"))
