"""A real `rollstream produce` in this process: where the settings tree goes (issue 33),
and what the process leaves behind when it returns."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_the_settings_tree_stays_at_the_edge_of_a_running_producer() -> None:
    """Followed through calls, not imports (tools/settings_trace.py): a real `rollstream
    produce` with local engines on an embedded Redis. The tree enters the command, the
    process wrapper, the producer's composition root and runconfig, and no part of the
    produce loop; it never climbs back up the layers."""
    spec = importlib.util.spec_from_file_location("settings_trace", ROOT / "tools" / "settings_trace.py")
    assert spec is not None and spec.loader is not None
    trace_tool = importlib.util.module_from_spec(spec)
    sys.modules["settings_trace"] = trace_tool  # its dataclasses look their module up
    try:
        spec.loader.exec_module(trace_tool)
    finally:
        del sys.modules["settings_trace"]
    trace = trace_tool.Trace()
    assert trace_tool.run_produce(trace) == 0
    assert "rollstream.producer.assembly" in trace.modules, trace.modules  # the hook saw the root
    parts = [m for m in trace.modules if m.split(".")[1] in ("producer", "consumer", "shared")]
    assert set(parts) <= {"rollstream.producer.assembly", "rollstream.shared.runconfig"}, trace.modules
    assert len(trace.modules) <= trace_tool.MAX_MODULES, trace.modules
    assert len(trace.climbs) <= trace_tool.MAX_CLIMBS and trace.climbs == [], trace.climbs
    # a command that returned on its own leaves no watcher asking a Redis it no longer uses
    # (the run-identity thread went on once a second, and warned for 120 s once Redis was gone)
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "run-identity"], timeout=30)
