"""FailureLog: a failure that hits every group is said once, then counted, with an
injected clock."""

from __future__ import annotations

import logging

import pytest

from rollstream.producer.failures import FailureLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


OOM = "MemoryError: CUDA out of memory"


def test_the_same_failure_is_said_once_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    failures = FailureLog(logging.getLogger("test.failures"), interval_s=30, clock=clock)
    with caplog.at_level(logging.ERROR, logger="test.failures"):
        for i in range(5):
            failures.failed(f"math:q{i}", MemoryError("CUDA out of memory"))
        failures.failed("math:q9", ValueError("bad reply"))  # another failure: said at once
        assert _lines(caplog) == [
            f"group math:q0 failed: {OOM}",
            "group math:q9 failed: ValueError: bad reply",
        ]
        clock.now += 31  # the interval passed: the next one says the count
        failures.failed("math:q5", MemoryError("CUDA out of memory"))
        assert _lines(caplog)[-1] == f"5 more groups failed in 31 s (the last: math:q5): {OOM}"
        failures.failed("math:q6", MemoryError("CUDA out of memory"))
        failures.flush()  # at the stop: what was not said yet
        assert _lines(caplog)[-1] == f"1 more groups failed in 0 s (the last: math:q6): {OOM}"
        count = len(caplog.records)
        failures.flush()  # nothing new: nothing said
        assert len(caplog.records) == count
