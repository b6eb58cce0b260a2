"""A plug-in judge, ``producer.judge = "tests.plugins.judge:by_sample_number"``: reads the
number the plug-in engine's text ends with, so a reward shows which judge and which
engine made it."""

from __future__ import annotations

from rollstream.producer.judges import Prompt, Reward, Sample


def by_sample_number(prompt: Prompt, samples: list[Sample]) -> list[Reward]:
    return [{"score": int(s.text.rsplit(" ", 1)[-1]) / 10, "plugin": 1.0} for s in samples]
