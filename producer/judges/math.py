"""Math answer match: the response's final answer against ``prompt.meta["answer"]``.

The final answer is the content of the last ``\\boxed{...}`` (braces may nest:
``\\boxed{\\frac{1}{2}}``), or, when the response boxes nothing, the last
number in it. Both sides are normalised (spaces, ``$``, a trailing period,
thousands separators, ``\\frac``) and compared as exact fractions when both
read as numbers, so "1/2", "0.5" and "\\frac{1}{2}" are one answer, and
as text otherwise. The reward is {"score": 1.0 | 0.0, "format": 1.0 | 0.0},
where "format" says whether the response boxed an answer at all.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rollstream.producer.judges.base import Reward, ground_truth
from rollstream.shared.records import Prompt, Sample

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")

# A sign only where it cannot be a binary minus ("3-5" ends in 5, "x = -5" in -5), and no
# digits glued to an ASCII word ("step2"); CJK text is no word here, so "答案是5" gives 5.
_NUMBER = re.compile(
    r"(?:(?<![A-Za-z0-9_.)\]}])-)?(?<![A-Za-z0-9_.])"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/\d+)?"
)
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")
# "x = 5" answers 5: a leading variable name and a single "="
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*=(?!=)")
# LaTeX spacing and sizing, and the units ($, %, degrees) a dataset's answer usually leaves out
_NOISE = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|\^\{?\\circ\}?|\\?%|\$")


def _balanced(text: str, start: int) -> str | None:
    """The text from ``start`` up to the brace that closes the one just before it, if any closes it."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None  # cut off before the box closed: no answer in it


def last_boxed(text: str) -> str | None:
    """The content of the last complete \\boxed{...} in text."""
    found = None
    for match in _BOXED.finditer(text):
        content = _balanced(text, match.end())
        if content is not None:
            found = content
    return found


def last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str) -> tuple[str | None, bool]:
    """The final answer of a response and whether it was boxed."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    return last_number(text), False


def normalize(answer: str) -> str:
    answer = _TEXT.sub(r"\1", answer)
    answer = _NOISE.sub("", answer)
    answer = "".join(answer.split())
    answer = _FRAC.sub(r"\1/\2", answer)
    answer = _ASSIGNMENT.sub("", answer)
    return answer.rstrip(".")


def to_number(answer: str) -> Fraction | None:
    """The exact value of a normalised answer, or None when it is not a plain number."""
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    numerator, slash, denominator = answer.partition("/")
    try:
        value = Fraction(numerator)
        if slash:
            value /= Fraction(denominator)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def answers_match(predicted: str, truth: str) -> bool:
    predicted, truth = normalize(predicted), normalize(truth)
    if not predicted:
        return False
    a, b = to_number(predicted), to_number(truth)
    if a is not None and b is not None:
        return a == b
    return predicted == truth


class MathJudge:
    """Scores 1.0 when the final answer equals meta[answer_key], else 0.0.

    With ``boxed_only`` an unboxed response scores 0 instead of falling back to its last number.
    """

    def __init__(self, answer_key: str = "answer", boxed_only: bool = False) -> None:
        self.answer_key = answer_key
        self.boxed_only = boxed_only

    def __call__(self, prompt: Prompt, samples: list[Sample]) -> list[Reward]:
        truth = ground_truth(prompt, self.answer_key)
        # datasets such as MATH keep the whole solution as the answer: judge against its box
        truth = last_boxed(truth) or truth
        return [self.score(sample.text, truth) for sample in samples]

    def score(self, text: str, truth: str) -> Reward:
        answer, boxed = extract_answer(text)
        if self.boxed_only and not boxed:
            answer = None
        correct = answer is not None and answers_match(answer, truth)
        return {"score": 1.0 if correct else 0.0, "format": 1.0 if boxed else 0.0}
