"""Text match judges: the whole response against an expected string, or against a regex.

Both score 1.0 or 0.0 in {"score": ...}.
"""

from __future__ import annotations

import re

from rollstream.producer.judges.base import JudgeError, Reward, ground_truth
from rollstream.shared.records import Prompt, Sample


def _score(ok: bool) -> Reward:
    return {"score": 1.0 if ok else 0.0}


class ExactMatchJudge:
    """The response equals ``meta[answer_key]``, after stripping surrounding space (``strip``)
    and ignoring case (``casefold``) when asked."""

    def __init__(self, answer_key: str = "answer", strip: bool = True, casefold: bool = False) -> None:
        self.answer_key = answer_key
        self.strip = strip
        self.casefold = casefold

    def _norm(self, text: str) -> str:
        if self.strip:
            text = text.strip()
        return text.casefold() if self.casefold else text

    def __call__(self, prompt: Prompt, samples: list[Sample]) -> list[Reward]:
        truth = self._norm(ground_truth(prompt, self.answer_key))
        return [_score(self._norm(sample.text) == truth) for sample in samples]


class RegexJudge:
    """The response matches a regex: the prompt's own ``meta[pattern_key]`` when it has one,
    else the pattern this judge was built with.

    ``fullmatch`` asks the whole (stripped) response to match; otherwise a match anywhere counts.
    """

    def __init__(
        self,
        pattern: str | None = None,
        fullmatch: bool = False,
        ignore_case: bool = False,
        pattern_key: str = "pattern",
    ) -> None:
        self.flags = re.IGNORECASE if ignore_case else 0
        self.pattern = None if pattern is None else self._compile(pattern, "the configured pattern")
        self.fullmatch = fullmatch
        self.pattern_key = pattern_key

    def _compile(self, pattern: str, where: str) -> re.Pattern[str]:
        try:
            return re.compile(pattern, self.flags)
        except re.error as exc:
            raise JudgeError(f"{where} {pattern!r} is not a valid regex: {exc}") from exc

    def _pattern_for(self, prompt: Prompt) -> re.Pattern[str]:
        own = prompt.meta.get(self.pattern_key)
        if own is not None:
            return self._compile(str(own), f"meta[{self.pattern_key!r}] of prompt {prompt.group_id}")
        if self.pattern is None:
            raise JudgeError(
                f"prompt {prompt.group_id} has no meta[{self.pattern_key!r}] and the judge has no pattern"
            )
        return self.pattern

    def __call__(self, prompt: Prompt, samples: list[Sample]) -> list[Reward]:
        pattern = self._pattern_for(prompt)
        if self.fullmatch:
            return [_score(pattern.fullmatch(sample.text.strip()) is not None) for sample in samples]
        return [_score(pattern.search(sample.text) is not None) for sample in samples]
