"""Judges: turn a group's responses into rewards. One file per family behind the protocol in base.py;
``load_judge`` finds one by name or dotted path, and rq.py runs them in rq workers."""

from __future__ import annotations

from producer.judges.base import Judge, JudgeError, Reward, apply_rewards
from producer.judges.registry import load_judge

__all__ = ["Judge", "JudgeError", "Reward", "apply_rewards", "load_judge"]
