"""rollstream.cli.logs: one JSON object per record, the text/JSON setup of the root logger, and
the progress ticker."""

from __future__ import annotations

import io
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from rollstream.cli import logs as cli_logs
from rollstream.cli.logs import QUIET, JsonFormatter, Ticker, setup_logging


@pytest.fixture
def json_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger of its own whose records go, formatted by JsonFormatter, into a buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tests.logs.json")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, out
    logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


def test_one_json_object_per_record_with_level_logger_and_message(
    json_log: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = json_log
    before = time.time()
    logger.info("fed %d prompts to %s", 12, "math")
    logger.warning("slow\nengine")  # a newline in the message stays inside the one line
    first, second = lines(out)
    assert first["level"] == "INFO"
    assert first["logger"] == "tests.logs.json"
    assert first["message"] == "fed 12 prompts to math"
    assert before - 1 <= first["ts"] <= time.time() + 1
    assert len(first["time"]) == len("2024-01-01T00:00:00")
    assert "exception" not in first
    assert second["level"] == "WARNING" and second["message"] == "slow\nengine"
    assert len(out.getvalue().splitlines()) == 2


def test_extra_fields_are_kept_and_the_standard_attributes_are_not(
    json_log: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = json_log
    logger.info("step done", extra={"step": 7, "task": "math", "loss": 0.25, "when": object()})
    (entry,) = lines(out)
    assert entry["step"] == 7 and entry["task"] == "math" and entry["loss"] == 0.25
    assert entry["when"].startswith("<object object")  # not JSON: written as its str()
    for standard in ("args", "msg", "levelno", "pathname", "lineno", "funcName", "thread", "exc_text"):
        assert standard not in entry
    assert set(entry) == {"ts", "time", "level", "logger", "message", "step", "task", "loss", "when"}


def test_the_exception_text_is_there_when_exc_info_is_set(
    json_log: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = json_log
    try:
        raise ValueError("bad group 17")
    except ValueError:
        logger.exception("handling failed")
    (entry,) = lines(out)
    assert entry["level"] == "ERROR"
    assert entry["message"] == "handling failed"
    assert entry["exception"].startswith("Traceback (most recent call last):")
    assert entry["exception"].rstrip().endswith("ValueError: bad group 17")


@pytest.fixture
def saved_logging() -> Iterator[None]:
    """setup_logging replaces the root logger's handlers: put everything back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    quiet = {name: logging.getLogger(name).level for name in QUIET}
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    for name, old in quiet.items():
        logging.getLogger(name).setLevel(old)


def test_setup_logging_json_writes_json_lines_to_stderr(
    saved_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("INFO", "json")
    root = logging.getLogger()
    assert len(root.handlers) == 1
    assert isinstance(root.handlers[0].formatter, JsonFormatter)
    assert root.level == logging.INFO
    logging.getLogger("tests.logs.setup").info("hello", extra={"run": "r1"})
    logging.getLogger("tests.logs.setup").debug("not shown")
    err = capsys.readouterr().err.splitlines()
    assert [orjson.loads(line)["message"] for line in err] == ["hello"]
    assert orjson.loads(err[0])["run"] == "r1"


def test_setup_logging_twice_replaces_the_handler_and_quiets_chatty_libraries(saved_logging: None) -> None:
    setup_logging("DEBUG", "json")
    setup_logging("DEBUG", "text")
    root = logging.getLogger()
    assert len(root.handlers) == 1
    assert root.handlers[0].stream is sys.stderr  # type: ignore[attr-defined]
    assert not isinstance(root.handlers[0].formatter, JsonFormatter)
    assert root.level == logging.DEBUG
    assert all(logging.getLogger(name).level == logging.WARNING for name in QUIET)
    setup_logging("ERROR")
    assert all(logging.getLogger(name).level == logging.ERROR for name in QUIET)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_ticker_is_due_once_per_period(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(cli_logs, "time", clock)
    ticker = Ticker(5.0)
    assert not ticker.due()  # a period starts when the ticker is made
    clock.now += 4.9
    assert not ticker.due()
    clock.now += 0.1
    assert ticker.due()
    assert not ticker.due()  # once per period, however often it is asked
    clock.now += 4.0
    assert not ticker.due()  # the period counts from the last due, not from the start
    clock.now += 1.0
    assert ticker.due()
    clock.now += 60.0
    assert ticker.due()
    assert not ticker.due()  # a long gap gives one tick, not a backlog


def test_a_zero_period_ticker_is_always_due() -> None:
    ticker = Ticker(0.0)
    assert ticker.due() and ticker.due()
