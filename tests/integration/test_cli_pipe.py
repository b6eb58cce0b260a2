"""`rollstream show … | head -1`, as the README writes it: when the reader of the output
goes away, rollstream stops quietly as a Unix tool does (the status of one killed by
SIGPIPE), never with a BrokenPipeError traceback."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import prompts

pytestmark = pytest.mark.integration


def test_show_into_head_closes_quietly(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> None:
    settings = load_settings(run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}])
    client = connect(settings.redis)
    # far more output than a pipe holds (64 KiB), so the writer meets the closed pipe
    assert open_buffer(client, settings, "feeder").feed(prompts("math", 2000)).added == 2000
    client.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env |= {"ROLLSTREAM_REDIS__URL": redis_server.url, "ROLLSTREAM_RUN": run_name}
    err = tmp_path / "stderr"
    show = shlex.join(
        [sys.executable, "-m", "rollstream.cli.main", "show", "prompts", "--task", "math", "--count", "2000"]
    )
    done = subprocess.run(
        ["bash", "-c", f'{show} 2>{shlex.quote(str(err))} | head -1; echo "status ${{PIPESTATUS[0]}}"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    first, status = done.stdout.splitlines()
    assert first.startswith(f"rs:{{{run_name}}}:prompts:math: 2000 of 2000 entries")
    assert err.read_text() == ""  # no traceback, no "Exception ignored" at exit
    assert status == "status 141"
