"""The agents' example plug-ins, importable by dotted path from any process (the
tool's sandbox imports ``calculator`` from here: standard library only).

- ``GuessNumber`` (``multi_turn``): the environment of guess-the-number. The secret is
  the prompt's ``meta["answer"]``; each model turn guesses (the last ``\\boxed{}``,
  else the last number, digits or a word from one to ten), and the environment says
  ``higher``, ``lower`` or ``correct`` (reward 1, done). examples/agents/guess.jsonl.
- ``calculator`` (``tool``): arithmetic on an expression, safely (no eval): numbers,
  ``+ - * / // % **`` and parentheses. examples/agents/calculator.jsonl.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
_NUMBER = re.compile(r"-?\d+")
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_WORD = re.compile(r"\b(" + "|".join(WORDS) + r")\b", re.IGNORECASE)


def read_guess(text: str) -> int | None:
    """The number a model turn guesses: its last \\boxed{n}, else its last number, else its
    last number word (zero to ten); None when it names none."""
    for pattern in (_BOXED, _NUMBER):
        found = pattern.findall(text)
        if found:
            return int(found[-1])
    words = _WORD.findall(text)
    return WORDS.index(words[-1].lower()) if words else None


class GuessNumber:
    """Guess-the-number: ``higher`` / ``lower`` until the guess is right."""

    def __init__(self, intro: str = "") -> None:
        self.intro = intro  # a first observation, if the prompt does not say it all
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, prompt: Any) -> str:
        self.secret = int(str(prompt.meta["answer"]).strip())
        self.guesses = 0
        return self.intro

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.secret is None:
            raise RuntimeError("step before reset")
        self.guesses += 1
        guess = read_guess(action)
        if guess is None:
            return "say a number", 0.0, False
        if guess == self.secret:
            return "correct", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 10 ** 10 ** 10 would take the process down: the sandbox's timeout's job,
# but a calculator should refuse it first


def calculator(expression: str) -> Any:
    """The value of an arithmetic expression. Anything else (names, calls, strings) is a
    ValueError, which the model reads as the tool's error."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be text, got {type(expression).__name__}")
    tree = ast.parse(expression.strip(), mode="eval")
    return _value(tree.body)


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is above {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")
