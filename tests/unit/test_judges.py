"""Judges: math answer extraction and matching, exact and regex match, apply_rewards, the registry."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollstream.producer.judges import JudgeError, apply_rewards, load_judge
from rollstream.producer.judges.match import ExactMatchJudge, RegexJudge
from rollstream.producer.judges.math import MathJudge, answers_match, extract_answer, last_boxed
from rollstream.producer.plugins import load_callable
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import Prompt, Sample


def sample(text: str) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2], logprobs=[-0.1], response_versions=[0], text=text)


def prompt(**meta: object) -> Prompt:
    return Prompt(uid="u1", task="math", prompt="q", meta=dict(meta))


def scores(judge: object, p: Prompt, *texts: str) -> list[float]:
    assert callable(judge)
    return [reward["score"] for reward in judge(p, [sample(t) for t in texts])]


# --- math: extraction --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer", "boxed"),
    [
        (r"so the answer is \boxed{42}.", "42", True),
        (r"\boxed{1} at first, but finally \boxed{2}", "2", True),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", True),
        (r"\boxed{\boxed{7}}", "7", True),
        (r"\boxed{ {a}+{b} }", " {a}+{b} ", True),
        (r"\boxed {5}", "5", True),
        (r"\fbox{9}", "9", True),
        (r"\boxed{3} and an unclosed \boxed{4", "3", True),
        (r"cut off: \boxed{12", "12", False),  # no complete box: falls back to the last number
        ("The answer is 42.", "42", False),
        ("first 3, then 17 apples", "17", False),
        ("x = -5", "-5", False),
        ("it is -3.25!", "-3.25", False),
        ("(-7)", "-7", False),
        ("3-5", "5", False),  # a binary minus is not a sign
        ("total: 1,234,567 dollars", "1,234,567", False),
        ("a list 1,2,3", "3", False),
        ("is .5", ".5", False),
        ("answer 1/2.", "1/2", False),
        ("答案是5", "5", False),
        ("step2 of the plan", None, False),
        ("no answer here", None, False),
        ("", None, False),
    ],
)
def test_extract_answer(text: str, answer: str | None, boxed: bool) -> None:
    assert extract_answer(text) == (answer, boxed)


def test_last_boxed_ignores_text_after_the_box() -> None:
    assert last_boxed(r"\boxed{\sqrt{2}} is irrational, 1.41 approximately") == r"\sqrt{2}"


# --- math: matching ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [
        ("42", "42"),
        (" 42 ", "42"),
        ("$42$", "42"),
        ("42.", "42"),
        ("1,234", "1234"),
        ("1,234,567.5", "1234567.5"),
        ("1/2", "0.5"),
        (r"\frac{1}{2}", "0.5"),
        (r"\dfrac{3}{4}", "3/4"),
        (r"-\frac{3}{4}", "-0.75"),
        ("2.50", "2.5"),
        ("-0", "0"),
        ("x = 5", "5"),
        (r"50\%", "50"),
        (r"90^\circ", "90"),
        (r"\text{Paris}", "Paris"),
        (r"\sqrt{2}", r"\sqrt {2}"),
    ],
)
def test_answers_match(predicted: str, truth: str) -> None:
    assert answers_match(predicted, truth)


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [("41", "42"), ("1,2", "12"), ("0.33", "1/3"), ("", "0"), ("-5", "5"), ("paris", "Paris")],
)
def test_answers_differ(predicted: str, truth: str) -> None:
    assert not answers_match(predicted, truth)


def test_math_judge_scores_and_format() -> None:
    judge = MathJudge()
    rewards = judge(
        prompt(answer="1/2"),
        [sample(r"\boxed{0.5}"), sample("I think it is 0.5"), sample(r"\boxed{2}"), sample("no idea")],
    )
    assert rewards == [
        {"score": 1.0, "format": 1.0},
        {"score": 1.0, "format": 0.0},
        {"score": 0.0, "format": 1.0},
        {"score": 0.0, "format": 0.0},
    ]


def test_math_judge_numeric_ground_truth_and_boxed_solution() -> None:
    assert scores(MathJudge(), prompt(answer=1234), "so 1,234") == [1.0]
    assert scores(MathJudge(), prompt(answer=r"The sum is $\boxed{10}$."), r"\boxed{10}") == [1.0]


def test_math_judge_boxed_only() -> None:
    assert scores(MathJudge(boxed_only=True), prompt(answer="3"), "3", r"\boxed{3}") == [0.0, 1.0]


def test_math_judge_without_ground_truth_names_the_prompt() -> None:
    with pytest.raises(JudgeError, match=r"math:u1 has no meta\['answer'\]"):
        MathJudge()(prompt(), [sample("1")])


# --- exact and regex ---------------------------------------------------------------------


def test_exact_match_strips_by_default() -> None:
    assert scores(ExactMatchJudge(), prompt(answer="Paris"), " Paris\n", "paris", "Paris!") == [1.0, 0.0, 0.0]


def test_exact_match_casefold_and_no_strip() -> None:
    assert scores(ExactMatchJudge(casefold=True), prompt(answer="STRASSE"), "straße") == [1.0]
    assert scores(ExactMatchJudge(strip=False), prompt(answer="a"), "a", " a") == [1.0, 0.0]


def test_regex_search_and_fullmatch() -> None:
    p = prompt(pattern=r"\d+ apples")
    assert scores(RegexJudge(), p, "I have 3 apples today", "apples") == [1.0, 0.0]
    assert scores(RegexJudge(fullmatch=True), p, " 3 apples\n", "I have 3 apples") == [1.0, 0.0]


def test_regex_prompt_pattern_wins_over_configured_one() -> None:
    judge = RegexJudge(pattern="yes")
    assert scores(judge, prompt(), "yes", "no") == [1.0, 0.0]
    assert scores(judge, prompt(pattern="no"), "yes", "no") == [0.0, 1.0]


def test_regex_ignore_case() -> None:
    assert scores(RegexJudge(pattern="yes", ignore_case=True), prompt(), "YES") == [1.0]


def test_regex_errors() -> None:
    with pytest.raises(JudgeError, match="has no meta"):
        RegexJudge()(prompt(), [sample("x")])
    with pytest.raises(JudgeError, match="not a valid regex"):
        RegexJudge()(prompt(pattern="("), [sample("x")])
    with pytest.raises(JudgeError, match="configured pattern"):
        RegexJudge(pattern="[")


# --- apply_rewards -----------------------------------------------------------------------


def test_apply_rewards_sets_each_sample() -> None:
    samples = [sample("a"), sample("b")]
    apply_rewards(samples, [{"score": 1, "format": 1.0}, {"score": 0.0, "note": "text is kept"}])
    assert [s.reward for s in samples] == [
        {"score": 1.0, "format": 1.0},
        {"score": 0.0, "note": "text is kept"},
    ]
    assert isinstance(samples[0].reward["score"], float)


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        ([{"score": 1.0}], "1 rewards for 2 samples"),
        ([{"score": 1.0}, {"format": 1.0}], "reward 1 has no 'score'"),
        ([{"score": 1.0}, {"score": "high"}], "not a finite number"),
        ([{"score": 1.0}, {"score": float("nan")}], "not a finite number"),
    ],
)
def test_apply_rewards_refuses_bad_rewards_and_leaves_samples_untouched(
    rewards: list[dict[str, object]], message: str
) -> None:
    samples = [sample("a"), sample("b")]
    with pytest.raises(JudgeError, match=message):
        apply_rewards(samples, rewards)
    assert [s.reward for s in samples] == [{}, {}]


# --- registry ----------------------------------------------------------------------------


@pytest.fixture
def plugin_module() -> Iterator[types.ModuleType]:
    """A throwaway module with judges of each shape, importable by name."""
    module = types.ModuleType("rollstream_test_plugins")

    def constant_judge(p: Prompt, samples: list[Sample]) -> list[dict[str, float]]:
        return [{"score": 0.5} for _ in samples]

    class LengthJudge:
        def __call__(self, p: Prompt, samples: list[Sample]) -> list[dict[str, float]]:
            return [{"score": float(len(s.text))} for s in samples]

    class NeedsArgs:
        def __init__(self, threshold: float) -> None:
            self.threshold = threshold

        def __call__(self, p: Prompt, samples: list[Sample]) -> list[dict[str, float]]:
            return []

    class NotCallable:
        pass

    module.constant_judge = constant_judge  # type: ignore[attr-defined]
    module.LengthJudge = LengthJudge  # type: ignore[attr-defined]
    module.NeedsArgs = NeedsArgs  # type: ignore[attr-defined]
    module.NotCallable = NotCallable  # type: ignore[attr-defined]
    module.ANSWER = 42  # type: ignore[attr-defined]
    module.judges = types.SimpleNamespace(nested=constant_judge)  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


@pytest.mark.parametrize(
    ("name", "kind"), [("math", MathJudge), ("exact", ExactMatchJudge), ("regex", RegexJudge)]
)
def test_builtin_judges(name: str, kind: type) -> None:
    assert isinstance(load_judge(name), kind)
    assert isinstance(load_judge(f" {name} "), kind)


@pytest.mark.usefixtures("plugin_module")
@pytest.mark.parametrize(
    "spec",
    [
        "rollstream_test_plugins:constant_judge",
        "rollstream_test_plugins.constant_judge",
        "rollstream_test_plugins:judges.nested",
    ],
)
def test_dotted_path_to_a_function(spec: str) -> None:
    assert scores(load_judge(spec), prompt(), "a", "b") == [0.5, 0.5]


@pytest.mark.usefixtures("plugin_module")
def test_dotted_path_to_a_class_is_instantiated() -> None:
    assert scores(load_judge("rollstream_test_plugins:LengthJudge"), prompt(), "abc") == [3.0]


def test_dotted_path_into_a_real_package() -> None:
    assert isinstance(load_judge("rollstream.producer.judges.math:MathJudge"), MathJudge)
    assert isinstance(load_judge("rollstream.producer.judges.match.RegexJudge"), RegexJudge)


@pytest.mark.usefixtures("plugin_module")
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mathh", r"judge 'mathh': not a built-in judge \(math, exact, regex, reverse\)"),
        ("", "not a built-in judge"),
        ("no_such_pkg.mod:judge", "module 'no_such_pkg.mod' not found"),
        ("rollstream.producer.judges.nope:judge", "module 'rollstream.producer.judges.nope' not found"),
        ("rollstream.producer.judges.math:Nope", "'rollstream.producer.judges.math' has no attribute 'Nope'"),
        ("rollstream_test_plugins:judges.missing", "has no attribute 'missing'"),
        ("rollstream_test_plugins:ANSWER", "int object is not callable"),
        ("rollstream_test_plugins:NotCallable", "instances of NotCallable are not callable"),
        ("rollstream_test_plugins:NeedsArgs", "class NeedsArgs cannot be built with no arguments"),
        (":judge", "not a dotted path"),
        ("module:", "not a dotted path"),
    ],
)
def test_registry_errors_name_the_spec_and_the_problem(spec: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message) as info:
        load_judge(spec)
    assert repr(spec) in str(info.value)


def test_registry_reports_a_failing_import_of_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path
    (root / "rollstream_dep_plugin.py").write_text("import rollstream_missing_dependency\n")
    (root / "rollstream_raising_plugin.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(root))
    with pytest.raises(SettingsError, match="importing 'rollstream_dep_plugin' failed: No module named"):
        load_judge("rollstream_dep_plugin:judge")
    with pytest.raises(SettingsError, match="failed: RuntimeError: boom at import"):
        load_judge("rollstream_raising_plugin:judge")


def test_load_callable_names_the_kind() -> None:
    with pytest.raises(SettingsError, match=r"^filter 'x\.y:z'"):
        load_callable("x.y:z", "filter")
