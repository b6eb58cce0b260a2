"""The public API is four modules, each with an ``__all__``, and the README shows them:
their exports, the signatures the README uses, and the imports its examples write are
pinned here, so that a change to either side is a change to both. A type in a public
signature is itself public, so that nobody needs a private import to call it."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

import pytest

from rollstream import consumer
from rollstream.producer import engines, filters, judges
from tests.helpers import documentation

README = documentation()  # the README and the site's pages (docs/)
API_SECTION = README.partition("\n## Python API\n")[2].partition("\n## ")[0]

PUBLIC: dict[str, list[str]] = {
    "rollstream.consumer": [
        "Batch", "BatchCoordinator", "BatchReader", "BatchStream", "BatchTimeout", "Group", "Loggers",
        "Prompt", "RolloutWorker", "RunControl", "Sample", "Settings", "StepLogger", "SyncTimeout",
        "TrainBatch", "TrlRollout", "WeightPublisher", "WeightTransfer", "connect", "control_for",
        "create_async_grpo", "create_batch_stream", "create_coordinator", "create_reader",
        "create_trl_rollout", "load_settings", "open_loggers", "publish_weights", "rollstream_reward",
        "step_figures", "wait_for_producers",
    ],
    "rollstream.producer.engines": [
        "BUILTIN_ENGINES", "FINISH_ABORT", "FINISH_ERROR", "FINISH_LENGTH", "FINISH_STOP", "Engine",
        "EngineError", "EngineHealth", "EngineSettings", "Generation", "SamplingParams", "make_engine",
    ],
    "rollstream.producer.judges": [
        "BUILTIN_JUDGES", "ExactMatchJudge", "Judge", "JudgeError", "MathJudge", "Prompt", "RegexJudge",
        "Reward", "Sample", "apply_rewards", "ground_truth", "load_judge",
    ],
    "rollstream.producer.filters": [
        "BUILTIN_FILTERS", "BUILTIN_SHOULD_CONTINUE", "Group", "IsValid", "Prompt", "Sample",
        "ShouldContinue", "below_target", "keep_all", "load_filter", "load_should_continue",
        "nonzero_reward_std",
    ],
}  # fmt: skip
# documented as the reference of every setting (README: "see shared/settings.py")
PUBLIC_HOMES = {"rollstream.shared.settings"}
# signatures left out of the closure check, and why
NOT_CHECKED = {
    "BatchReader.__init__": "made from its parts by create_reader (consumer/assembly.py)",
    "BatchCoordinator.__init__": "made from its parts by create_coordinator (consumer/assembly.py)",
    "Batch.__init__": "made by get_batch, not by a trainer",
    "TrainBatch.__init__": "made by get_batch, not by a trainer",
    "RunControl.__init__": "made by control_for or BatchReader",
    "RunControl.events": "the processes' event follower",
    "RunControl.producers": "what wait_for_producers reads",
    "RunControl.heartbeat": "the producers' own",
    "Group.__init__": "made by producers and the codec",
    "Sample.__init__": "made by producers and the codec",
    "Sample.of_arrays": "the codec's",
    "TrlRollout.__init__": "made from its parts by create_trl_rollout (consumer/assembly.py)",
    "RolloutWorker.__init__": "made from its parts by create_async_grpo (consumer/assembly.py)",
    "BatchStream.__init__": "made from its parts by create_batch_stream (consumer/assembly.py)",
    "WeightPublisher.__init__": "made from the weights settings by the create_* doors (consumer/assembly.py)",
}


def params(function: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize("name", list(PUBLIC))
def test_each_public_module_exports_what_the_readme_lists(name: str) -> None:
    module = importlib.import_module(name)
    assert sorted(module.__all__) == sorted(PUBLIC[name])
    assert len(set(module.__all__)) == len(module.__all__)
    for attr in module.__all__:
        assert getattr(module, attr) is not None, f"{name}.{attr}"
    assert f"`{name}`" in API_SECTION


def _classes(annotation: Any) -> set[type]:
    """The classes an annotation names, through unions and generics."""
    found: set[type] = set()
    origin = typing.get_origin(annotation)
    if origin is None and isinstance(annotation, type):
        found.add(annotation)
    elif isinstance(origin, type):
        found.add(origin)
    for arg in typing.get_args(annotation):
        if isinstance(arg, list):  # Callable[[A, B], R]
            for item in arg:
                found |= _classes(item)
        else:
            found |= _classes(arg)
    return found


def _signatures(name: str, value: Any) -> list[tuple[str, Any]]:
    """(label, annotation) of every parameter and return of what ``value`` offers a caller:
    a function; a rollstream class's __init__, __call__ and public methods and properties;
    the alias itself for a type alias."""
    if typing.get_origin(value) is not None:  # IsValid, Reward, ...
        return [(name, value)]
    if isinstance(value, type):
        if not value.__module__.startswith("rollstream."):
            return []
        out = []
        for attr, member in vars(value).items():
            if attr.startswith("_") and attr not in ("__init__", "__call__"):
                continue
            label = f"{value.__name__}.{attr}"
            if label in NOT_CHECKED:
                continue
            member = member.fget if isinstance(member, property) else member
            member = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            if inspect.isfunction(member):
                out += [(label, hint) for hint in typing.get_type_hints(member).values()]
        return out
    if inspect.isfunction(value):
        return [(name, hint) for hint in typing.get_type_hints(value).values()]
    return []


@pytest.mark.parametrize("name", list(PUBLIC))
def test_every_type_in_a_public_signature_is_public(name: str) -> None:
    module = importlib.import_module(name)
    exported = [getattr(module, attr) for attr in module.__all__]
    private = set()
    checked = 0
    for attr, value in zip(module.__all__, exported, strict=True):
        for label, annotation in _signatures(attr, value):
            checked += 1
            for cls in _classes(annotation):
                home = cls.__module__
                if home.startswith("rollstream.") and home not in PUBLIC_HOMES and cls not in exported:
                    private.add(f"{label}: {home}.{cls.__qualname__}")
    assert checked > 10
    assert not private, sorted(private)


def _readme_imports() -> list[tuple[str, str]]:
    """(module, name) of every ``from rollstream... import`` in the README's Python blocks."""
    found = []
    for block in re.findall(r"```python\n(.*?)```", README, re.S):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollstream"):
                found += [(node.module or "", alias.name) for alias in node.names]
    return found


def test_the_readme_imports_only_public_names() -> None:
    imports = _readme_imports()
    assert {module for module, _ in imports} == set(PUBLIC)
    for module, name in imports:
        assert name in PUBLIC[module], f"the README imports {name} from {module}, which does not export it"


def test_the_trainer_signatures_the_readme_shows() -> None:
    assert params(consumer.create_reader) == ["settings", "client", "consumer"]
    assert params(consumer.create_coordinator)[:3] == ["settings", "client", "consumer"]
    assert params(consumer.BatchReader.get_batch)[:2] == ["self", "train_step"]
    assert params(consumer.TrainBatch.commit) == ["self"]
    assert params(consumer.publish_weights) == ["control", "model_step", "uri"]
    assert params(consumer.control_for) == ["client", "settings"]
    assert params(consumer.connect) == ["settings"]
    overrides = inspect.signature(consumer.load_settings).parameters["overrides"]
    assert overrides.kind is inspect.Parameter.VAR_KEYWORD  # load_settings() reads the environment
    assert params(consumer.RunControl.train_step) == params(consumer.RunControl.model_step) == ["self"]
    assert isinstance(inspect.getattr_static(consumer.TrainBatch, "groups"), property)
    assert params(consumer.open_loggers)[:3] == ["spec", "logdir", "name"]
    assert params(consumer.step_figures)[:6] == [
        "step_s",
        "wait_s",
        "groups",
        "scores",
        "staleness",
        "expired",
    ]
    assert params(consumer.Loggers.log) == ["self", "step", "figures"]
    for shown in (
        'open_loggers("tensorboard,wandb", "runs/exp1", "exp1")',
        "figures = step_figures(",
        "trackers.log(step, figures)",
    ):
        assert shown in API_SECTION, shown
    coordinator = consumer.BatchCoordinator
    for method in ("submit_batch", "finalize_train_batch", "finalize_eval_batch", "abort_batch"):
        assert callable(getattr(coordinator, method)) and f"`{method}`" in README
    for shown in (
        "`BatchReader.get_batch(step)`",
        "`batch.commit()`",
        "`publish_weights(control, step, uri)`",
        "`publish_weights(control_for(connect(settings), settings), step, uri)`",
        "reader = create_reader(settings)",
        "reader.control.train_step()",
        "reader.control.model_step()",
        "batch = reader.get_batch(step)",
        "batch.commit()",
        "publish_weights(reader.control, step,",
    ):
        assert shown in README, shown


def test_the_engine_signatures_the_readme_shows() -> None:
    protocol = engines.Engine
    assert params(protocol.generate) == ["self", "prompt_ids", "params", "n", "request_id"]
    assert params(protocol.abort) == ["self", "request_ids"]
    assert params(protocol.pause) == params(protocol.resume) == params(protocol.health) == ["self"]
    assert params(protocol.update_weights) == ["self", "model_step", "path"]
    methods = ["generate", "abort", "pause", "resume", "update_weights", "health"]
    assert all(inspect.iscoroutinefunction(getattr(protocol, m)) for m in methods)
    assert all(f"`{m}`" in API_SECTION for m in methods)
    assert params(engines.make_engine) == ["settings"]
    assert params(engines.Generation)[:4] == ["response_ids", "logprobs", "versions", "finish_reason"]
    health = inspect.signature(engines.EngineHealth).parameters.values()
    required = [p.name for p in health if p.default is p.empty]
    shown = ["healthy", "model_step", "paused", "outstanding", "running", "queued", "busy_fraction"]
    assert required == shown
    assert {"kind", "options"} <= set(engines.EngineSettings.model_fields)
    assert "max_tokens" in params(engines.SamplingParams)
    for shown in ('kind = "mypkg.engine:make"', "options = {", "def make(settings: EngineSettings)"):
        assert shown in API_SECTION, shown


def test_the_judge_and_filter_signatures_the_readme_shows() -> None:
    assert params(judges.Judge.__call__) == ["self", "prompt", "samples"]
    assert params(judges.load_judge) == ["spec"]
    assert params(judges.ground_truth)[:1] == ["prompt"]
    assert typing.get_origin(judges.Reward) is dict
    assert params(filters.load_filter) == params(filters.load_should_continue) == ["spec"]
    assert typing.get_args(filters.IsValid) == ([filters.Group], bool)
    assert typing.get_args(filters.ShouldContinue) == ([int, int], bool)
    for shown in (
        'judge = "mypkg.judge:contains_answer"',
        "def contains_answer(prompt: Prompt, samples: list[Sample]) -> list[Reward]:",
        'is_valid = "mypkg.filters:long_enough"',
        "def long_enough(group: Group) -> bool:",
    ):
        assert shown in API_SECTION, shown


def test_the_package_docstring_imports_public_names() -> None:
    import rollstream

    lines = [line.strip() for line in (rollstream.__doc__ or "").splitlines()]
    imports = [ast.parse(line).body[0] for line in lines if line.startswith("from rollstream")]
    assert imports
    for node in imports:
        assert isinstance(node, ast.ImportFrom)
        if node.module in PUBLIC:
            assert {a.name for a in node.names} <= set(PUBLIC[node.module]), ast.unparse(node)
