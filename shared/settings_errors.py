"""How a settings problem is told: one line per problem, naming where the value came
from (the environment variable, the file and line, or the flag), the setting as a dotted
path, the value with any password masked, and what is allowed, with a "did you mean"
for a misspelt name.

shared/settings.py's load_settings builds the tree and hands what went wrong here. This
module knows the sources by name (the ``ROLLSTREAM_`` variables, the settings file,
which it also reads, so that a broken file is one line with its position) and walks
the root model it is given, never importing it: the settings tree composes the families'
models (engines, algorithm, transports) and sits above this module. ``redact_url``,
the masking, serves every message and log line that shows a Redis or server URL.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeGuard, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from rollstream.shared.errors import SettingsError

ENV_PREFIX = "ROLLSTREAM_"
CONFIG_ENV = "ROLLSTREAM_CONFIG"
DEFAULT_CONFIG_FILE = "rollstream.toml"

# ROLLSTREAM_ variables that are not settings yet must not be refused as unknown ones.
# ROLLSTREAM_CONFIG names the settings file; the Procfile reads the next seven (and .env
# sets some of them for it); bench/common.py reads ROLLSTREAM_BENCH_RESULTS.
NON_SETTING_ENV = frozenset(
    {
        CONFIG_ENV,
        "ROLLSTREAM_STEPS",
        "ROLLSTREAM_PROMPTS",
        "ROLLSTREAM_EPOCHS",
        "ROLLSTREAM_TASK",
        "ROLLSTREAM_TRAIN_ARGS",
        "ROLLSTREAM_REDIS_DIR",
        "ROLLSTREAM_TRAINER_RECORD",
        "ROLLSTREAM_BENCH_RESULTS",
    }
)

_QUERY_PASSWORD_RE = re.compile(r"(?i)([?&;](?:sentinel_)?password=)[^&#\s'\"]*")


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (user names are kept).

    Works on the text rather than on urlsplit, which raises on a bad port and
    splits a password holding a raw '/' or '@' at the wrong place: everything
    between the first ':' of the user part and the last '@' is masked.
    """
    scheme_end = url.find("://")
    start = scheme_end + 3 if scheme_end >= 0 else 0
    at = url.rfind("@")
    if at >= start:
        colon = url.find(":", start, at)
        if colon >= 0:
            url = f"{url[: colon + 1]}***{url[at:]}"
    elif scheme_end >= 0:
        # Without an '@', what follows the last ':' of the host part is a port; when it is not a
        # number it may be a password whose '@host' was left out.
        end = min((i for i in (url.find(c, start) for c in "/?#") if i >= 0), default=len(url))
        netloc = url[start:end]
        colon = netloc.rfind(":")
        port = netloc[colon + 1 :]
        if colon >= 0 and port and not port.isdigit() and not netloc.endswith("]"):
            url = f"{url[: start + colon + 1]}***{url[end:]}"
    # redis-py passes unknown query parameters to the connection: ?password= is one;
    # redis+sentinel:// URLs carry the Sentinels' own as ?sentinel_password=.
    return _QUERY_PASSWORD_RE.sub(r"\1***", url)


def config_path() -> Path:
    """The settings file: the one ``ROLLSTREAM_CONFIG`` names, else rollstream.toml here."""
    return Path(os.environ.get(CONFIG_ENV, DEFAULT_CONFIG_FILE))


# tomllib's messages end with the position: "Invalid value (at line 3, column 5)".
_TOML_AT_RE = re.compile(
    r"^(?P<what>.*?)\s*\(at (?:line (?P<line>\d+), column (?P<column>\d+)|end of document)\)$"
)


def read_toml(path: Path) -> tuple[dict[str, Any], str]:
    """The settings file as data and text; ``({}, "")`` when there is none."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        raise SettingsError(f"{path}: the settings file cannot be read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        raise SettingsError(
            f"{path}:{line}: not a TOML file: byte {raw[exc.start]:#04x} at column {column} is not UTF-8 "
            "(a settings file is UTF-8 text)"
        ) from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        # tomllib names at most a key or one character, never a value (which could be a password).
        found = _TOML_AT_RE.match(str(exc))
        if found is None:
            raise SettingsError(f"{path}: not valid TOML: {exc}") from None
        if found["line"] is None:
            where, at = str(text.count("\n") + 1), "at the end of the file"
        else:
            where, at = found["line"], f"column {found['column']}"
        raise SettingsError(f"{path}:{where}: not valid TOML: {found['what']} ({at})") from None


# A key line of a TOML file (`a.b = ...`) and a table header (`[a.b]`, `[[tasks]]`).
_TOML_KEY = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""
_TOML_KEY_RE = re.compile(rf"^\s*({_TOML_KEY}(?:\s*\.\s*{_TOML_KEY})*)\s*=")
_TOML_TABLE_RE = re.compile(rf"^\s*(\[\[?)\s*({_TOML_KEY}(?:\s*\.\s*{_TOML_KEY})*)\s*\]\]?\s*(?:#.*)?$")


def _toml_line(text: str, loc: Sequence[str | int]) -> int | None:
    """Best guess of the line that sets ``loc``: tomllib keeps no positions.

    The line of the key itself, else of the closest enclosing table or inline
    value (a header ``[rollout]``, ``tasks = [...]``), else the first line inside.
    """
    target = [str(p) for p in loc]
    table: list[str] = []
    arrays: dict[tuple[str, ...], int] = {}
    best: tuple[int, int] | None = None  # (score, line)
    for number, line in enumerate(text.splitlines(), 1):
        if header := _TOML_TABLE_RE.match(line):
            table = [k.strip("\"'") for k in re.findall(_TOML_KEY, header[2])]
            if header[1] == "[[":
                arrays[tuple(table)] = arrays.get(tuple(table), -1) + 1
                table = [*table, str(arrays[tuple(table)])]
            here = table
        elif key := _TOML_KEY_RE.match(line):
            here = table + [k.strip("\"'") for k in re.findall(_TOML_KEY, key[1])]
        else:
            continue
        if here == target:
            return number
        if here == target[: len(here)]:
            score = len(here)
        elif target == here[: len(target)]:
            score = 0
        else:
            continue
        if best is None or score > best[0]:
            best = (score, number)
    return None if best is None else best[1]


def _is_model(kind: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _model_at(root: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The settings class of the section (or list item) at ``loc``, if it is one."""
    kind: Any = root
    for part in loc:
        if isinstance(part, int) or part.isdigit():
            if get_origin(kind) is not list:
                return None
            kind = get_args(kind)[0]
        elif _is_model(kind) and part in kind.model_fields:
            kind = kind.model_fields[part].annotation
        else:
            return None
    return kind if _is_model(kind) else None


def _env_variables(root: type[BaseModel]) -> dict[str, tuple[str, ...]]:
    """Every settings variable, upper case, with its path; a section's own variable takes JSON."""
    found: dict[str, tuple[str, ...]] = {}

    def walk(model: type[BaseModel], path: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            sub = (*path, name)
            found[ENV_PREFIX + "__".join(sub).upper()] = sub
            if _is_model(inner := field.annotation):
                walk(inner, sub)

    walk(root, ())
    return found


def _show(value: Any) -> str:
    """A value as an error message shows it: any password masked."""
    if isinstance(value, str):
        return repr(redact_url(value))
    if isinstance(value, dict | BaseModel):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return repr(value)


# A task as the messages show one: its name is required, so it has no default to show.
_TASK_EXAMPLE = {"name": "math", "n": 8}


def _example(model: type[BaseModel]) -> dict[str, Any]:
    name, field = next(iter(model.model_fields.items()))
    return {name: field.get_default(call_default_factory=True)}


def _allowed_here(model: type[BaseModel] | None, path: Sequence[str | int], name: str) -> str:
    """'did you mean x?' for a misspelt ``name`` inside ``path``, else the names allowed there."""
    if model is None:
        return ""
    fields = list(model.model_fields)
    where = ".".join(str(p) for p in path)
    close = difflib.get_close_matches(name, fields, n=1)
    if close:
        return f"; did you mean {where + '.' if where else ''}{close[0]}?"
    return f"; {where} has: {', '.join(fields)}" if where else f"; the settings are: {', '.join(fields)}"


# The command line's flags that become keyword overrides (declared in cli/parser.py, made overrides
# by cli/dispatch.py's _settings): an error in one names it.
_FLAGS = {"run": "--run", "redis.url": "--redis-url"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


class Sources:
    """Where each value came from, to name it in an error: the same order as the settings."""

    def __init__(
        self,
        overrides: Mapping[str, Any],
        env: Mapping[str, str],
        path: Path,
        toml: tuple[dict[str, Any], str],
    ) -> None:
        self.overrides = overrides
        self.env = env  # upper-case name -> value
        self.path = path
        self.toml_data, self.toml_text = toml

    @staticmethod
    def _holds(data: Any, loc: Sequence[str | int]) -> bool:
        for part in loc:
            if not isinstance(data, dict):
                return True  # a scalar or a list where loc goes on: this source gave the container
            if part not in data:
                return False
            data = data[part]
        return True

    def origin(self, loc: Sequence[str | int]) -> tuple[Literal["keyword", "env", "toml", "default"], str]:
        """The source of the value at ``loc`` and how to name it: a flag, a variable, file:line."""
        names = [str(p) for p in loc]
        if loc and self._holds(self.overrides, loc):
            dotted = ".".join(names)
            flag = f"flag {_FLAGS[dotted]} or " if dotted in _FLAGS else ""
            return "keyword", f"{flag}keyword argument {names[0]}"
        # A list's items have no variable of their own: the list is one JSON variable.
        head = names[: next((i for i, p in enumerate(loc) if isinstance(p, int)), len(loc))]
        for depth in range(len(head), 0, -1):
            variable = ENV_PREFIX + "__".join(head[:depth]).upper()
            if variable not in self.env:
                continue
            if depth == len(loc):
                return "env", variable
            try:
                data = json.loads(self.env[variable])
            except ValueError:
                return "env", variable
            if self._holds(data, loc[depth:]):
                return "env", variable
        # A section that variables below it built (ROLLSTREAM_TASKS__NAME makes tasks an object).
        below = ENV_PREFIX + "__".join(head).upper() + "__"
        if head and len(head) == len(loc):
            for variable in self.env:
                if variable.startswith(below):
                    return "env", variable
        if loc and self._holds(self.toml_data, loc):
            line = _toml_line(self.toml_text, loc)
            return "toml", f"{self.path}:{line}" if line else str(self.path)
        return "default", ENV_PREFIX + "__".join(head).upper()


def _must_be_section(root: type[BaseModel], model: type[BaseModel], dotted: str, source: str) -> str:
    if model is _model_at(root, ("tasks", 0)):
        return f"must be a task, as in {json.dumps(_TASK_EXAMPLE)}"
    example = _example(model)
    key, value = next(iter(example.items()))
    if source == "env":
        variable = ENV_PREFIX + dotted.replace(".", "__").upper()
        return (
            f"must be a JSON object of {dotted}'s settings, as in {json.dumps(example)} "
            f"(or set {variable}__{key.upper()} and the like instead)"
        )
    if source == "toml":
        line = f"{key} = {json.dumps(value)}"
        return f"must be a table of {dotted}'s settings, as in [{dotted}] with {line} under it"
    return f"must be a dict of {dotted}'s settings, as in {json.dumps(example)}"


def _must_be_list(source: str) -> str:
    if source == "env":
        return f"must be a JSON list of tasks, as in [{json.dumps(_TASK_EXAMPLE)}]"
    if source == "toml":
        return 'must be an array of tables, as in [[tasks]] with name = "math" under it, one per task'
    return f"must be a list of tasks, as in [{json.dumps(_TASK_EXAMPLE)}]"


def describe(root: type[BaseModel], error: ErrorDetails, sources: Sources) -> tuple[str, str]:
    """One line for one validation error, and the source's name (to leave out repeats)."""
    loc = error["loc"]
    dotted = ".".join(str(p) for p in loc) or "settings"
    source, where = sources.origin(loc)
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    hint = ""
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        message = f"must be {_BOUNDS[kind]} {bound}"
    elif kind == "string_pattern_mismatch":
        message = f"must match the pattern {ctx.get('pattern')} (letters, digits, '_', '.', '-')"
    elif kind == "extra_forbidden":
        message = "is not a setting"
        hint = _allowed_here(_model_at(root, loc[:-1]), loc[:-1], str(loc[-1]))
    elif kind == "missing":
        message = "is required"
    elif kind == "model_type" and (model := _model_at(root, loc)) is not None:
        message = _must_be_section(root, model, dotted, source)
    elif kind == "list_type" and tuple(loc) == ("tasks",):
        message = _must_be_list(source)
    else:
        message = str(error["msg"]).removeprefix("Value error, ").replace("Input should be", "must be", 1)
    shown = ""
    if kind != "missing" and (kind in ("model_type", "list_type") or not isinstance(value, dict | list)):
        shown = f", got {_show(value)}"
    return f"invalid setting {dotted} ({where}): {message}{shown}{hint}", where


def check_env(
    root: type[BaseModel], env: Mapping[str, str], names: Mapping[str, str]
) -> list[tuple[str, str]]:
    """Unknown ROLLSTREAM_ variables and section or list variables that are not JSON.

    pydantic-settings (2.16) ignores an unknown top-level variable and reports a
    nested one as an unknown key, so a misspelt name would silently do nothing.
    """
    known = _env_variables(root)
    problems: list[tuple[str, str]] = []
    for upper, value in env.items():
        variable = names[upper]
        if upper in NON_SETTING_ENV:
            continue
        path = known.get(upper)
        if path is None:
            parts = upper.removeprefix(ENV_PREFIX).lower().split("__")
            dotted = ".".join(parts) or "''"
            problems.append(
                (
                    f"invalid setting {dotted} ({variable}): is not a setting, got {_show(value)}"
                    + _unknown_hint(root, upper, parts, known),
                    upper,
                )
            )
            continue
        model = _model_at(root, path)
        if model is None and path != ("tasks",):
            continue
        try:
            json.loads(value)
        except ValueError as exc:
            dotted = ".".join(path)
            allowed = _must_be_list("env") if model is None else _must_be_section(root, model, dotted, "env")
            problems.append(
                (
                    f"invalid setting {dotted} ({variable}): not valid JSON ({exc}); "
                    f"expected {allowed.removeprefix('must be ')}, got {_show(value)}",
                    upper,
                )
            )
    return problems


def _unknown_hint(
    root: type[BaseModel], upper: str, parts: list[str], known: Mapping[str, tuple[str, ...]]
) -> str:
    # Inside a known section, compare with that section's names only: a whole-name match would
    # offer the section itself for any unknown name in it.
    section = ENV_PREFIX + "__".join(parts[:-1]).upper()
    if len(parts) > 1 and section in known and (model := _model_at(root, known[section])) is not None:
        close = difflib.get_close_matches(parts[-1], list(model.model_fields), n=1)
        if close:
            return f"; did you mean {section}__{close[0].upper()}?"
        return f"; {'.'.join(parts[:-1])} has: {', '.join(model.model_fields)}"
    candidates = {name.removeprefix(ENV_PREFIX): name for name in [*known, *NON_SETTING_ENV]}
    close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), list(candidates), n=1)
    if close:
        return f"; did you mean {candidates[close[0]]}?"
    return f"; the settings are: {', '.join(root.model_fields)}"
