"""`rollstream status --watch`: refreshed in place under a pseudo-terminal (rich), plain
blocks of lines into a file; Ctrl-C leaves it with exit status 0. A one-shot feed of a
big file: a progress bar on a terminal, none into a file."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import redis

from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import prompts, wait_for

pytestmark = pytest.mark.integration


def fed_env(redis_server: EmbeddedRedis, run_name: str) -> dict[str, str]:
    settings = load_settings(run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}])
    open_buffer(redis.Redis.from_url(redis_server.url), settings, "feed").feed(prompts("math", 5))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "PORT"))}
    env.update(
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_REDIS__URL=redis_server.url,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
        TERM="xterm-256color",
    )
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    return env


WATCH = [sys.executable, "-m", "rollstream.cli.main", "status", "--watch", "--interval", "0.2"]


def test_under_a_terminal_the_view_is_redrawn_in_place(redis_server: EmbeddedRedis, run_name: str) -> None:
    env = fed_env(redis_server, run_name)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 140, 0, 0))
    proc = subprocess.Popen(WATCH, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    seen = b""
    try:

        def read() -> bytes:
            nonlocal seen
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                with contextlib.suppress(OSError):  # the child closed its side
                    seen += os.read(master, 65536)
            return seen

        headline = f"run {run_name}: train_step".encode()
        wait_for(lambda: read().count(headline) >= 3 or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, seen[-3000:]
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            read()
        assert proc.wait(timeout=5) == 0, seen[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    # redrawn: the cursor goes back up over the previous view (rich's Live), not a scroll of copies
    assert b"\x1b[1A" in seen or b"\x1b[2K" in seen, seen[-2000:]
    assert b"prompts" in seen and b"no producer alive" in seen


def test_into_a_file_it_writes_plain_blocks(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = fed_env(redis_server, run_name)
    out = tmp_path / "watch.log"
    with out.open("w") as handle:
        proc = subprocess.Popen(WATCH, stdout=handle, stderr=subprocess.PIPE, env=env, text=True)
    try:
        headline = f"run {run_name}: train_step"
        wait_for(lambda: out.read_text().count(headline) >= 2 or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    text = out.read_text()
    assert "\x1b[" not in text
    assert "  prompts:math length 5 pending 0 lag 5" in text
    assert "  WARNING no producer alive" in text


def test_a_one_shot_feed_of_a_big_file_shows_its_progress_on_a_terminal(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    env = fed_env(redis_server, run_name)
    path = tmp_path / "big.jsonl"
    path.write_text("".join(f'{{"uid": "b{i}", "prompt": "What is {i} + 1?"}}\n' for i in range(12_000)))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 140, 0, 0))
    feed = [sys.executable, "-m", "rollstream.cli.main", "feed", str(path), "--task", "math"]
    proc = subprocess.Popen(feed, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    seen = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.5)
            chunk = b""
            if ready:
                with contextlib.suppress(OSError):
                    chunk = os.read(master, 65536)
            seen += chunk
            if not chunk and proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0, seen[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    text = seen.decode(errors="replace")
    assert "feed math: 100%" in text and "12000/12000" in text, text[-2000:]
    assert "12000 prompts added to task 'math', 0 already there" in text
    # into a file (a process manager's log): the counts, no bar
    done = subprocess.run(feed, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0 prompts added to task 'math', 12000 already there" in done.stdout
    assert "feed math:" not in done.stderr
