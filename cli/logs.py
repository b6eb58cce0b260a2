"""Logging for every rollstream process: one line per record on stderr, as text for
people or as JSON objects for log collectors (``log.format = "json"``).

Process managers (honcho, systemd, Kubernetes) prefix and collect stderr, so a
process logs there and nowhere else; progress bars are drawn only on a terminal.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
# Libraries that log a line per request at INFO
QUIET = ("ray", "urllib3", "filelock", "rq.worker", "httpx", "httpcore")

# Attributes every LogRecord has; anything else came in through ``extra=`` and is kept.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, the ``extra`` fields, and
    the exception text when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def setup_logging(level: str | int = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once per process (a second call replaces the first)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    numeric = logging.getLevelName(level) if isinstance(level, str) else level
    for name in QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, int(numeric)))


def on_terminal() -> bool:
    """Progress bars only where a person watches: never into a process manager's log."""
    return sys.stderr.isatty()


class Ticker:
    """True once every ``every_s`` seconds: progress lines at a steady pace."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return False
        self.last = now
        return True
