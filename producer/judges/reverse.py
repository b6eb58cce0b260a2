"""The judge of the reverse task (rollstream.recipes.reverse): write the prompt's symbols back
to front, then stop. ``"c a m >"`` asks for ``"m a c"`` and the end of the response.

A partial reward per position, so that a policy at chance still sees which of its
samples were better (an all-or-nothing reward would give a random 16-token policy a
signal once in 16^4 samples): with an answer of k symbols there are k + 1 positions,
the k symbols and the end, and the score is the share of them that are right.
Position i < k is right when the response's i-th symbol is the answer's; the end is
right when the response has exactly k symbols and stopped (its engine's finish reason
is "stop": the model wrote its end-of-sequence token, which the text leaves out).

Symbols are single characters and spaces do not count, so the text's spacing (a
word-level tokenizer joins tokens with spaces; a partial rollout continued later
concatenates two texts) changes nothing.

Rewards: ``score`` (the partial reward, or the exact one for a prompt whose
``meta["scoring"]`` is ``"exact"``: how greedy accuracy is measured through an eval
batch) and ``exact`` (1.0 when every position is right).
"""

from __future__ import annotations

from rollstream.producer.engines.base import FINISH_STOP
from rollstream.producer.judges.base import JudgeError, Reward, ground_truth
from rollstream.shared.records import Prompt, Sample

SCORING_KEY = "scoring"  # meta key: "partial" (the default) or "exact"
SCORINGS = ("partial", "exact")


def symbols(text: str) -> list[str]:
    """The symbols of a text: its characters other than white space."""
    return [c for c in text if not c.isspace()]


def partial_reward(answer: list[str], response: list[str], stopped: bool) -> float:
    """The share of the k + 1 positions (k answer symbols, then the end) the response has right."""
    right = sum(1 for got, want in zip(response, answer, strict=False) if got == want)
    right += int(stopped and len(response) == len(answer))
    return right / (len(answer) + 1)


class ReverseJudge:
    """Scores each sample against ``meta["answer"]`` (the prompt's symbols reversed)."""

    def __init__(self, answer_key: str = "answer") -> None:
        self.answer_key = answer_key

    def __call__(self, prompt: Prompt, samples: list[Sample]) -> list[Reward]:
        answer = symbols(ground_truth(prompt, self.answer_key))
        if not answer:
            raise JudgeError(f"prompt {prompt.group_id} has an empty meta[{self.answer_key!r}]")
        scoring = prompt.meta.get(SCORING_KEY, "partial")
        if scoring not in SCORINGS:
            raise JudgeError(
                f"prompt {prompt.group_id}: meta[{SCORING_KEY!r}] is {scoring!r}; "
                f"allowed: {', '.join(SCORINGS)}"
            )
        rewards = []
        for sample in samples:
            partial = partial_reward(answer, symbols(sample.text), sample.finish_reason == FINISH_STOP)
            exact = 1.0 if partial == 1.0 else 0.0
            rewards.append({"score": exact if scoring == "exact" else partial, "exact": exact})
        return rewards
