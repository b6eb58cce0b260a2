"""Joining Ray without giving it this process's SIGTERM and SIGINT.

A process that a process manager (or a user's Ctrl-C) stops keeps its own handlers
(the cli's ``stop_on_signals``, a recipe caller's): they finish what is in flight and
exit 0. ``ray.init`` takes SIGTERM twice over unless told not to:

- its Python handlers: ``sys.exit(15)`` for a driver, and for the local cluster it
  starts a handler that kills that cluster's processes and exits 1, so a SIGTERM during
  the seconds ``ray.init`` takes, or any time after, ended the process with 15 or 1;
- the core worker's failure-signal handler (C level, under Python's), which prints a
  stack trace for a SIGTERM and, when ``ray.shutdown`` removes it (also at exit), leaves
  SIGTERM at its default action while Python still names our handler: a SIGTERM after
  the shutdown killed the process (rc -15).

``init_ray_keeping_signals`` installs neither, and puts back the handlers of SIGTERM
and SIGINT that were there before, at the C level too.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from rollstream.producer.fleet.actors import init_ray

__all__ = ["init_ray_keeping_signals", "signals_kept_from_ray"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def signals_kept_from_ray() -> Iterator[None]:
    """Within: Ray's ``ray.init`` installs no signal handler of its own (and its core
    worker none later, in this process: the switch is read when the core worker starts,
    and stays off). After: SIGTERM and SIGINT are handled as they were before."""
    import ray._private.ray_constants as ray_constants
    import ray._private.utils as ray_utils

    main = threading.current_thread() is threading.main_thread()  # handlers belong to it alone
    before = {sig: signal.getsignal(sig) for sig in SIGNALS} if main else {}
    install = getattr(ray_utils, "set_sigterm_handler", None)
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    if install is not None:  # every one of Ray's SIGTERM handlers goes through it
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if install is not None:
            ray_utils.set_sigterm_handler = install
        for sig, handler in before.items():
            if handler is not None:  # None: not installed from Python; nothing to put back
                # again even when Python still names it: what a C-level handler replaced
                signal.signal(sig, handler)


def init_ray_keeping_signals(address: str = "", *, local: bool = False) -> str:
    """``init_ray`` (producer/fleet/actors.py) with this process's SIGTERM and SIGINT left as
    they are (``signals_kept_from_ray``); returns the cluster's GCS address."""
    with signals_kept_from_ray():
        return init_ray(address, local=local)
