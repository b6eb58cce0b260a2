"""The engine plug-in point: what an engine implements, and ``make_engine``, which
builds the one ``engines.kind`` names. Engine authors import from here only.

Built-in kinds: ``sim`` (simulated), ``hf`` (Hugging Face transformers), ``vllm``
(vLLM's AsyncLLM in the engine actor), ``openai`` (an OpenAI-compatible server the
user runs) and ``sglang`` (SGLang's native HTTP API). Any other ``engines.kind`` is a
dotted path, ``package.module:factory``, to a callable that takes the run's
:class:`EngineSettings` (its ``options`` hold the plug-in's own settings) and returns
an :class:`Engine`. Each kind imports what it needs only when chosen, in the process
that hosts the engine (a Ray actor, or the producer in a one-process run).

    from rollstream.producer.engines import EngineSettings, Generation, ...

    def make(settings: EngineSettings) -> MyEngine:     # engines.kind = "mypkg.engine:make"
        return MyEngine(**settings.options)             # [engines.options] in rollstream.toml
"""

from __future__ import annotations

import importlib
from typing import Any

from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    EngineError,
    EngineHealth,
    Generation,
    SamplingParams,
)
from rollstream.shared.engine_settings import BUILTIN_ENGINES, EngineSettings
from rollstream.shared.errors import SettingsError

__all__ = [
    "BUILTIN_ENGINES",
    "FINISH_ABORT",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Engine",
    "EngineError",
    "EngineHealth",
    "EngineSettings",
    "Generation",
    "SamplingParams",
    "make_engine",
]

# kind -> (module, factory): the factory takes the EngineSettings
_BUILTIN = {
    "sim": ("rollstream.producer.engines.sim", "from_settings"),
    "hf": ("rollstream.producer.engines.hf", "from_settings"),
    "vllm": ("rollstream.producer.engines.vllm", "from_settings"),
    "openai": ("rollstream.producer.engines.openai", "openai_from_settings"),
    "sglang": ("rollstream.producer.engines.sglang", "sglang_from_settings"),
}
_ALLOWED = f"one of {', '.join(BUILTIN_ENGINES)}, or a dotted path 'package.module:factory'"
_METHODS = ("generate", "abort", "pause", "resume", "update_weights", "health")


def _invalid(what: str) -> SettingsError:
    """The error of a kind that loads no engine: like the settings' own, it names the
    setting, its variable and what is allowed."""
    return SettingsError(
        f"invalid setting engines.kind (ROLLSTREAM_ENGINES__KIND): {what}; it must be {_ALLOWED}"
    )


def make_engine(settings: EngineSettings) -> Engine:
    """The engine ``settings.kind`` names, built from the settings. A kind that names
    nothing importable, a factory that is not callable, or one that builds something
    without the Engine methods is a SettingsError naming ``engines.kind``."""
    kind = settings.kind
    if kind in _BUILTIN:
        module_name, attr = _BUILTIN[kind]
        factory: Any = getattr(importlib.import_module(module_name), attr)
    elif "." not in kind and ":" not in kind:
        raise _invalid(f"{kind!r} is not a built-in engine and not a dotted path")
    else:
        from rollstream.producer.plugins import import_object

        try:
            factory = import_object(kind, "engine")
        except SettingsError as exc:
            raise _invalid(str(exc)) from None
        if not callable(factory):
            raise _invalid(f"engine {kind!r}: {type(factory).__name__} object is not callable")
    engine = factory(settings)
    missing = [m for m in _METHODS if not callable(getattr(engine, m, None))]
    if missing or not isinstance(engine, Engine):
        raise _invalid(
            f"engine {kind!r}: the factory returned a {type(engine).__name__}, which lacks the Engine "
            f"methods {', '.join(missing)} (an Engine has {', '.join(_METHODS)})"
        )
    return engine
