"""One tool call in a process of its own: ``python -m rollstream.producer.agents.sandbox``
reads ``{"tool": "package.module:attr", "arguments": {...}}`` (JSON) on stdin, calls
the tool with the arguments as keywords, and writes ``{"result": ...}`` or
``{"error": "Type: message"}`` (JSON) on stdout. What the tool prints itself goes to
stderr, so that it cannot garble the reply.

The producer (tools.py) starts one per call and kills it at the call's timeout, so
that a tool that hangs, crashes the interpreter or leaks state cannot take the
producer with it. Only the standard library is imported here, and the tool's module:
the process starts in about a tenth of a second.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any


def load(spec: str) -> Any:
    """The object ``package.module:attr`` (or ``package.module.attr``) names."""
    module_name, _, attr_path = spec.partition(":") if ":" in spec else spec.rpartition(".")
    found: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        found = getattr(found, attr)
    return found


def main() -> int:
    reply_to = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the tool's own prints go to stderr
    try:
        request = json.loads(sys.stdin.buffer.read())
        result = load(request["tool"])(**request["arguments"])
        reply = json.dumps({"result": result}, ensure_ascii=False, default=str)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt of a tool are its errors too
        reply = json.dumps({"error": f"{type(exc).__name__}: {exc}"}, ensure_ascii=False)
    reply_to.write(reply)
    reply_to.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
