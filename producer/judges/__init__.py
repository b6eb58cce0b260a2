"""The judge plug-in point: what turns a group's responses into rewards. Judge authors
import from here only.

A judge is a callable ``judge(prompt, samples) -> list[Reward]``: one reward per
sample, each a dict with a finite float "score" (other entries travel with it). It
reads ``sample.text`` and the ground truth in ``prompt.meta`` (``ground_truth``) and
leaves the samples alone; the producer checks the rewards and sets them. A judge that
cannot score raises JudgeError. ``producer.judge`` names one: a built-in
(``BUILTIN_JUDGES``: math, exact, regex, reverse) or a dotted path ``package.module:attr``
(a class there is built with no arguments). With ``producer.judge_on_queue`` the same
judge runs in rq workers (rq.py).

    from rollstream.producer.judges import Prompt, Reward, Sample

    def judge(prompt: Prompt, samples: list[Sample]) -> list[Reward]:  # "mypkg.judge:judge"
        return [{"score": float(len(s.text) < 200)} for s in samples]
"""

from __future__ import annotations

from rollstream.producer.judges.base import Judge, JudgeError, Reward, apply_rewards, ground_truth
from rollstream.producer.judges.match import ExactMatchJudge, RegexJudge
from rollstream.producer.judges.math import MathJudge
from rollstream.producer.judges.registry import BUILTIN_JUDGES, load_judge
from rollstream.shared.records import Prompt, Sample

__all__ = [
    "BUILTIN_JUDGES",
    "ExactMatchJudge",
    "Judge",
    "JudgeError",
    "MathJudge",
    "Prompt",
    "RegexJudge",
    "Reward",
    "Sample",
    "apply_rewards",
    "ground_truth",
    "load_judge",
]
