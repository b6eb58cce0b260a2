"""The plug-in loader: the object a dotted path in the settings names.

Engines (``engines.kind``), judges (``producer.judge``), filters (``producer.is_valid``,
``producer.should_continue``), agents (``producer.agent``) and an agent's environment
(``producer.agent_options``) are each a built-in name or a dotted path,
"package.module:attr" or "package.module.attr"; every family resolves its dotted paths
here. Every failure is a SettingsError that names the kind, the spec and what is wrong
with it, since a spec comes from the settings and fails once, at start-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from rollstream.shared.errors import SettingsError

__all__ = ["import_object", "load_callable"]


def _import_module(spec: str, kind: str, module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # the named module missing, or a module it imports missing: say which
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise SettingsError(f"{kind} {spec!r}: module {module_name!r} not found") from exc
        raise SettingsError(f"{kind} {spec!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise SettingsError(
            f"{kind} {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


def import_object(spec: str, kind: str) -> object:
    """The object a dotted path names; ``kind`` ("judge", "filter", ...) goes into the error messages."""
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    else:
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path:
        raise SettingsError(
            f"{kind} {spec!r}: not a dotted path; expected 'package.module:attr' or 'package.module.attr'"
        )
    found = _import_module(spec, kind, module_name)
    for attr in attr_path.split("."):
        if not hasattr(found, attr):
            owner = getattr(found, "__name__", type(found).__name__)
            raise SettingsError(f"{kind} {spec!r}: {owner!r} has no attribute {attr!r}")
        found = getattr(found, attr)
    return found


def load_callable(spec: str, kind: str) -> Callable[..., object]:
    """A callable from a dotted path: classes are instantiated with no arguments."""
    found = import_object(spec, kind)
    if isinstance(found, type):
        try:
            found = found()
        except Exception as exc:
            raise SettingsError(
                f"{kind} {spec!r}: class {found.__name__} cannot be built with no arguments: {exc}"
            ) from exc
        if not callable(found):
            raise SettingsError(f"{kind} {spec!r}: instances of {type(found).__name__} are not callable")
    elif not callable(found):
        raise SettingsError(f"{kind} {spec!r}: {type(found).__name__} object is not callable")
    return cast(Callable[..., object], found)
