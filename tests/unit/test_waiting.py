"""rollstream.shared.waiting: bounded waits with back-off, a warning naming what and why, a
timeout, and a stop flag that ends the wait at once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from rollstream.shared import waiting as shared_waiting
from rollstream.shared.errors import WaitTimeout
from rollstream.shared.waiting import BASE_S, CAP_S, NotYet, backoff, wait_until

LOGGER = "rollstream.shared.waiting"


def failing(times: int, value: object = "ready", reason: str = "not there yet") -> Callable[[], object]:
    """A probe that raises NotYet ``times`` times, then returns ``value``; it counts its calls."""
    calls = {"n": 0}

    def probe() -> object:
        calls["n"] += 1
        if calls["n"] <= times:
            raise NotYet(f"{reason} (try {calls['n']})")
        return value

    probe.calls = calls  # type: ignore[attr-defined]
    return probe


class NoWait(threading.Event):
    """A stop flag that is never set and whose wait returns at once: a wait through many
    tries without the back-off's real pauses."""

    def wait(self, timeout: float | None = None) -> bool:
        return False


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_waiting, "backoff", lambda attempt, *a, **k: 0.001)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_ready_probe_returns_its_value_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    probe = failing(0, value={"client": 1})
    assert wait_until(probe, "the thing", timeout_s=5) == {"client": 1}
    assert probe.calls["n"] == 1  # type: ignore[attr-defined]
    assert [r for r in caplog.records if r.name == LOGGER] == []


def test_the_value_comes_back_once_ready_and_the_wait_is_logged_with_its_reason(
    caplog: pytest.LogCaptureFixture, fast_backoff: None
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    probe = failing(3, value=42, reason="connection refused")
    assert wait_until(probe, "Redis at redis://h:1/0", timeout_s=30) == 42
    assert probe.calls["n"] == 4  # type: ignore[attr-defined]
    warned = warnings_of(caplog)
    # one warning for the wait (the next would come only after warn_every_s), naming what and why
    assert len(warned) == 1
    assert warned[0].startswith("waiting for Redis at redis://h:1/0: connection refused (try 1)")
    infos = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert len(infos) == 1 and infos[0].startswith("Redis at redis://h:1/0: ready after")


def test_a_long_wait_warns_again_every_warn_every_s(
    caplog: pytest.LogCaptureFixture, fast_backoff: None
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert wait_until(failing(3), "x", timeout_s=30, warn_every_s=0) == "ready"
    assert len(warnings_of(caplog)) == 3  # every failed try, when the period is 0


def test_the_warnings_go_to_the_given_logger(caplog: pytest.LogCaptureFixture, fast_backoff: None) -> None:
    mine = logging.getLogger("tests.waiting.mine")
    caplog.set_level(logging.WARNING)
    assert wait_until(failing(1), "engines", timeout_s=30, logger=mine) == "ready"
    assert [r.getMessage()[:20] for r in caplog.records if r.name == "tests.waiting.mine"] == [
        "waiting for engines:"
    ]
    assert warnings_of(caplog) == []


def test_past_the_timeout_wait_timeout_names_what_and_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as excinfo:
        wait_until(failing(10**9, reason="no address recorded"), "the Ray address", timeout_s=0.05)
    message = str(excinfo.value)
    assert "the Ray address" in message
    assert "no address recorded" in message
    assert "0.05 s" in message
    assert time.monotonic() - started < 10  # generous: it gives up, it does not hang
    assert warnings_of(caplog)  # the wait was announced before it gave up


def test_an_error_that_is_not_not_yet_ends_the_wait_at_once() -> None:
    calls = {"n": 0}

    def probe() -> None:
        calls["n"] += 1
        raise PermissionError("wrong password")

    with pytest.raises(PermissionError, match="wrong password"):
        wait_until(probe, "Redis", timeout_s=30)
    assert calls["n"] == 1


def test_a_set_stop_returns_none_at_once() -> None:
    stop = threading.Event()
    stop.set()
    probe = failing(10**9)
    started = time.monotonic()
    assert wait_until(probe, "Redis", timeout_s=0, stop=stop) is None  # 0: no timeout at all
    assert probe.calls["n"] == 1  # type: ignore[attr-defined]
    assert time.monotonic() - started < 5


def test_a_stop_set_during_the_wait_ends_it() -> None:
    stop = threading.Event()

    def probe() -> None:
        stop.set()  # SIGTERM while the process waits
        raise NotYet("nothing listens")

    assert wait_until(probe, "Redis", timeout_s=0, stop=stop) is None


def test_a_stop_that_stays_clear_does_not_end_the_wait(fast_backoff: None) -> None:
    assert wait_until(failing(2, value="v"), "x", timeout_s=30, stop=threading.Event()) == "v"


def test_timeout_zero_waits_for_ever(fast_backoff: None) -> None:
    probe = failing(50, value="late")
    assert wait_until(probe, "x", timeout_s=0) == "late"
    assert probe.calls["n"] == 51  # type: ignore[attr-defined]


def test_a_wait_for_ever_survives_more_than_a_thousand_tries() -> None:
    # timeout_s 0 waits for ever: after ~1024 tries (about 25 minutes at the 2 s cap) the
    # back-off must still be a pause, not an OverflowError that kills the waiting process.
    probe = failing(1100, value="up at last")
    assert wait_until(probe, "Redis", timeout_s=0, stop=NoWait(), warn_every_s=3600) == "up at last"


def test_backoff_stays_within_its_cap_and_has_jitter() -> None:
    for attempt in range(60):
        ceiling = min(CAP_S, BASE_S * 2.0**attempt)
        for _ in range(20):
            pause = backoff(attempt)
            assert ceiling / 2 <= pause <= ceiling
            assert pause <= CAP_S
    assert len({backoff(3) for _ in range(20)}) > 1  # jitter: processes do not retry in step


def test_backoff_grows_with_the_attempt() -> None:
    # attempt 0 lies in [0.05, 0.1], attempt 3 in [0.4, 0.8]: every draw of the later is longer
    assert max(backoff(0) for _ in range(50)) < min(backoff(3) for _ in range(50))
    assert max(backoff(2, base_s=1.0, cap_s=100.0) for _ in range(50)) <= 4.0
    assert min(backoff(5, base_s=1.0, cap_s=100.0) for _ in range(50)) >= 16.0


def test_backoff_uses_its_own_cap() -> None:
    assert all(0.25 <= backoff(20, base_s=0.1, cap_s=0.5) <= 0.5 for _ in range(50))


def test_backoff_of_a_very_late_attempt_is_still_capped() -> None:
    # 2.0**attempt alone overflows from 1024 on: the cap must hold for any attempt
    for attempt in (1023, 1024, 1100, 10**6):
        assert CAP_S / 2 <= backoff(attempt) <= CAP_S
