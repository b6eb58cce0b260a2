"""Where the settings tree goes when `rollstream produce` runs: followed through calls.

An import count (which modules name the root ``Settings`` class) says little about where
the object itself travels: a module that never imports the class still receives the tree
when a caller hands it over, and a part that keeps ``self.settings`` reads it from
everywhere it is called. This runs a real `rollstream produce --local-engines --burst`
in this process, against an embedded redis-server with a few prompts fed, under a profile
hook on every thread, and records each call into a rollstream function whose frame holds
the root ``Settings`` object: as an argument or local, or kept by ``self``.

It prints:
- the modules the object entered;
- climbs: calls that carry the object from a lower layer up into a higher one (shared is
  the ground, producer and consumer above it, recipes above them, cli on top), as when a
  part down the stack calls back into the part that keeps the tree;
- returns: calls that carry it back into a module it had already left for another.

    python tools/settings_trace.py          # the figures; exit 1 over the limits

tests/unit/test_packaging.py holds the limits (issue 33: at most 10 modules, 4 climbs).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

MAX_MODULES = 10
MAX_CLIMBS = 4
LAYERS = {"shared": 0, "producer": 1, "consumer": 1, "recipes": 2, "cli": 3}
PROMPTS = 6


def layer(module: str) -> int:
    return LAYERS.get(module.split(".")[1], 0) if module.count(".") else 0


@dataclass
class Trace:
    """What the profile hook saw: the modules in the order the object entered them, and
    the calls that climbed or returned."""

    modules: list[str] = field(default_factory=list)
    climbs: list[tuple[str, str]] = field(default_factory=list)
    returns: list[tuple[str, str]] = field(default_factory=list)
    last: dict[int, str] = field(default_factory=dict)  # per thread: the last module that held it
    lock: threading.Lock = field(default_factory=threading.Lock)


def _holds(frame: FrameType, root: type) -> bool:
    for name, value in frame.f_locals.items():
        if type(value) is root:
            return True
        if name == "self" and any(type(held) is root for held in _attributes(value)):
            return True
    return False


def _attributes(obj: Any) -> list[Any]:
    """obj's attribute values, read without running any of obj's own code (no
    __getattr__, no property): what ``self`` keeps."""
    values: list[Any] = []
    with contextlib.suppress(AttributeError, TypeError):
        values += object.__getattribute__(obj, "__dict__").values()
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            with contextlib.suppress(AttributeError, TypeError):
                values.append(object.__getattribute__(obj, slot))
    return values


def _caller_module(frame: FrameType) -> str | None:
    caller = frame.f_back
    while caller is not None:
        name = str(caller.f_globals.get("__name__", ""))
        if name.startswith("rollstream."):
            return name
        caller = caller.f_back
    return None


def hook(trace: Trace, root: type) -> Any:
    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("rollstream.") or module == "rollstream.shared.settings":
            return
        if not _holds(frame, root):
            return
        caller = _caller_module(frame)
        with trace.lock:
            if module not in trace.modules:
                trace.modules.append(module)
            if caller is not None and caller != module:
                if layer(module) > layer(caller):
                    trace.climbs.append((caller, f"{module}.{frame.f_code.co_name}"))
                elif module in trace.modules[:-1] and trace.last.get(threading.get_ident()) != module:
                    trace.returns.append((caller, f"{module}.{frame.f_code.co_name}"))
            trace.last[threading.get_ident()] = module

    return profile


def run_produce(trace: Trace) -> int:
    """`rollstream produce --local-engines --burst` in this process, on a fresh embedded Redis
    with PROMPTS prompts fed; its exit status."""
    from rollstream.cli.main import main as rollstream
    from rollstream.shared.embedded import EmbeddedRedis
    from rollstream.shared.settings import Settings

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        prompts = Path(tmp, "prompts.jsonl")
        prompts.write_text(
            "".join(
                f'{{"prompt": "What is {i} + 1?", "meta": {{"answer": "{i + 1}"}}}}\n' for i in range(PROMPTS)
            )
        )
        env = {
            "ROLLSTREAM_REDIS__URL": server.url,
            "ROLLSTREAM_RUN": "settings-trace",
            "ROLLSTREAM_ENGINES__KIND": "sim",
            "ROLLSTREAM_METRICS__PORT": "0",
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                if rollstream(["feed", str(prompts), "--task", "default"]) != 0:
                    raise SystemExit("settings_trace: feeding the prompts failed")
            profile = hook(trace, Settings)
            threading.setprofile(profile)
            sys.setprofile(profile)
            try:
                return rollstream(["produce", "--local-engines", "--burst"])
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def main() -> int:
    trace = Trace()
    status = run_produce(trace)
    print(f"`rollstream produce` exited {status}")
    print(f"the settings tree entered {len(trace.modules)} modules (limit {MAX_MODULES}):")
    for name in trace.modules:
        print(f"  {name}")
    print(f"{len(trace.climbs)} climbs back up the layers (limit {MAX_CLIMBS}):")
    for caller, callee in trace.climbs:
        print(f"  {caller} -> {callee}")
    print(f"{len(trace.returns)} returns to a module it had left")
    over = len(trace.modules) > MAX_MODULES or len(trace.climbs) > MAX_CLIMBS
    return 1 if status != 0 or over else 0


if __name__ == "__main__":
    sys.exit(main())
