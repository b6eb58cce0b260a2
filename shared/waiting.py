"""Waiting for what a process needs: bounded exponential back-off with jitter, a
warning every few seconds saying what it waits for and why, a timeout, and a stop
flag (SIGTERM) that ends the wait at once.

Process managers start every process of a run at the same time, so "not there
yet" is normal at start-up: a process waits instead of exiting.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from rollstream.shared.errors import WaitTimeout

T = TypeVar("T")
log = logging.getLogger(__name__)

BASE_S = 0.1
CAP_S = 2.0
WARN_EVERY_S = 5.0


class NotYet(Exception):
    """Raised by a probe: what it waits for is not there yet; the message says why."""


def backoff(attempt: int, base_s: float = BASE_S, cap_s: float = CAP_S) -> float:
    """Seconds before try ``attempt`` (0-based): exponential up to ``cap_s``, with full
    jitter so that many processes do not retry in step."""
    # the exponent is bounded: a wait for ever counts attempts past where 2.0**n overflows
    return random.uniform(0.5, 1.0) * min(cap_s, base_s * 2.0 ** min(attempt, 64))


def wait_until(
    probe: Callable[[], T],
    what: str,
    timeout_s: float,
    stop: threading.Event | None = None,
    *,
    logger: logging.Logger = log,
    warn_every_s: float = WARN_EVERY_S,
) -> T | None:
    """Call ``probe`` until it returns instead of raising NotYet; None if ``stop`` is set
    first. ``timeout_s`` 0 waits for ever; past it, WaitTimeout names what and why."""
    started = time.monotonic()
    warned = started
    attempt = 0
    while True:
        try:
            value = probe()
        except NotYet as exc:
            reason = str(exc)
        else:
            if attempt:
                logger.info("%s: ready after %.1f s", what, time.monotonic() - started)
            return value
        now = time.monotonic()
        if attempt == 0 or now - warned >= warn_every_s:
            logger.warning("waiting for %s: %s (%.0f s so far)", what, reason, now - started)
            warned = now
        if timeout_s and now - started >= timeout_s:
            raise WaitTimeout(f"gave up waiting for {what} after {timeout_s:g} s: {reason}")
        pause = backoff(attempt)
        if stop is None:
            time.sleep(pause)
        elif stop.wait(pause):
            return None
        attempt += 1
