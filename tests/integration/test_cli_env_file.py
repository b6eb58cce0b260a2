"""`rollstream --env-file .env status`: a command typed beside a `make run` formation reads
the run's settings from the Procfile's .env, as honcho gives them to its processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import prompts

pytestmark = pytest.mark.integration


def status(env_file: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rollstream.cli.main",
            "--env-file",
            str(env_file),
            *flags,
            "status",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_takes_the_runs_settings_from_the_env_file(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    settings = load_settings(run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 4}])
    client = connect(settings.redis)
    assert open_buffer(client, settings, "feeder").feed(prompts("math", 3)).added == 3
    client.close()
    env_file = tmp_path / ".env"
    env_file.write_text(
        "# the Procfile's settings\n"
        f"ROLLSTREAM_RUN={run_name}\n"
        f"ROLLSTREAM_REDIS__URL={redis_server.url}\n"
        "ROLLSTREAM_STEPS=20\n"
        """ROLLSTREAM_TASKS='[{"name": "math", "n": 4}]'\n"""
    )
    done = status(env_file)
    assert done.returncode == 0, done.stderr
    shown = orjson.loads(done.stdout)
    assert shown["run"] == run_name
    assert shown["accounts"]["math"]["fed"] == 3
    # a flag still wins over the file
    other = status(env_file, "--run", f"{run_name}-other")
    assert other.returncode == 0, other.stderr
    assert orjson.loads(other.stdout)["run"] == f"{run_name}-other"


def test_a_missing_env_file_is_an_input_error_naming_it(tmp_path: Path) -> None:
    done = status(tmp_path / "nowhere.env")
    assert done.returncode == 2
    assert done.stderr.strip() == f"rollstream: --env-file {tmp_path / 'nowhere.env'}: no such file"
