"""Tools the agent tests call by dotted path (``tests.plugins.tools:<name>``), each a
way a tool can end. Standard library only: the sandbox imports this module in a fresh
process for every call, and must not spend its timeout on imports."""

from __future__ import annotations

import os
import time


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "late"


def explode() -> None:
    raise ZeroDivisionError("boom")


def die() -> None:
    os._exit(9)


def noisy() -> int:
    print("this goes to stderr, not into the reply")
    return 7
