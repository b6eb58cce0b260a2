"""The HTTP engines (openai, sglang) against fake servers in the process: an
httpx.MockTransport routes each request to a FakeServer by host and port, and the
fake answers with replies recorded from the servers' contracts (tests/fixtures, see
its README). No network, no sleeps: held requests wait on events, the take-out clock
is moved by hand."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rollstream.producer.engines import http as http_engine
from rollstream.producer.engines import make_engine
from rollstream.producer.engines import openai as openai_engine
from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineError,
    SamplingParams,
)
from rollstream.producer.engines.http_client import server_path, token_versions
from rollstream.producer.engines.openai import OpenAIEngine, ties_lm_head
from rollstream.producer.engines.sglang import SGLangEngine
from rollstream.shared.engine_settings import EngineSettings, HTTPEngineSettings
from rollstream.shared.errors import SettingsError
from tests.helpers import wait_for_async

FIXTURES = Path(__file__).parent.parent / "fixtures"
KEY = "sk-secret-0123456789"
PROMPT = [0, 5, 6, 7]
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, seed=3)


def fixture(kind: str, name: str) -> Any:
    return json.loads((FIXTURES / kind / f"{name}.json").read_text())


# Every endpoint a vLLM server in dev mode with --enable-scale-out has that the engine uses
VLLM_FULL = {
    "/inference/v1/generate",
    "/inference/v1/abort_requests",
    "/abort_requests",
    "/pause",
    "/resume",
    "/is_paused",
    "/collective_rpc",
    "/update_weight_version",
    "/v1/completions",
    "/v1/models",
}
VLLM_PLAIN = {"/v1/completions", "/v1/models"}  # vLLM without dev mode or scale-out


class FakeServer:
    """One server. Answers from the fixtures, records what it was sent, and can hold
    generate requests until they are aborted or released."""

    def __init__(self, kind: str, paths: set[str] | None = None, schema: bool = True) -> None:
        self.kind = kind
        self.paths = paths if paths is not None else VLLM_FULL
        self.schema = schema  # serves /openapi.json
        self.down = False
        self.refused: list[str] = []  # paths of the requests refused while down
        self.calls: list[tuple[str, str, Any]] = []  # (method, path, json body or query)
        self.headers: list[httpx.Headers] = []
        self.hold = False  # generate requests wait for release() or an abort
        self.released = asyncio.Event()
        self.aborted = asyncio.Event()
        self.generate_reply: Any = None  # overrides the fixture
        self.generate_status = 200
        self.extension = True  # runs rollstream's vLLM worker extension
        self.error_echo = False  # errors repeat the Authorization header (a careless server)
        self.held = 0
        self.urls: list[httpx.URL] = []  # of every request, as the transport got it
        self.gates: dict[str, asyncio.Event] = {}  # requests to these paths wait for the event
        self.gated = 0
        self.timeouts: set[str] = set()  # requests to these paths end in a read timeout
        self.paused = False  # by /pause (/pause_generation) until /resume (/continue_generation)

    def paths_called(self) -> list[str]:
        return [path for _, path, _ in self.calls]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            self.refused.append(request.url.path)
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        path = request.url.path
        body = json.loads(request.content) if request.content else dict(request.url.params)
        self.calls.append((request.method, path, body))
        self.headers.append(request.headers)
        self.urls.append(request.url)
        gate = self.gates.get(path)
        if gate is not None:
            self.gated += 1
            try:
                await gate.wait()
            finally:
                self.gated -= 1
        if path in self.timeouts:
            raise httpx.ReadTimeout("timed out", request=request)
        if self.error_echo:
            return httpx.Response(
                400, json={"error": {"message": f"bad auth {request.headers['authorization']}"}}
            )
        if path == "/openapi.json":
            if not self.schema:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(
                200, json={"openapi": "3.1.0", "paths": {p: {} for p in sorted(self.paths)}}
            )
        if self.kind == "sglang":
            return await self._sglang(path, body)
        return await self._openai(path, body)

    async def _held(self, aborted_reply: Any, reply: Any) -> Any:
        if not self.hold:
            return reply
        self.held += 1
        waits = [asyncio.ensure_future(self.released.wait()), asyncio.ensure_future(self.aborted.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            self.held -= 1
        return aborted_reply if self.aborted.is_set() else reply

    async def _openai(self, path: str, body: Any) -> httpx.Response:
        if path not in self.paths:
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/inference/v1/generate":
            if "token_ids" not in body:  # a probe
                return httpx.Response(400, json={"error": {"message": "body.token_ids: Field required"}})
            if self.generate_status != 200:
                return httpx.Response(self.generate_status, json=self.generate_reply)
            reply = self.generate_reply or fixture("openai", "generate_text_n2")
            return httpx.Response(
                200, json=await self._held(fixture("openai", "generate_text_aborted"), reply)
            )
        if path == "/v1/completions":
            reply = self.generate_reply or fixture("openai", "completions_n2")
            return httpx.Response(200, json=await self._held(fixture("openai", "completions_aborted"), reply))
        if path in ("/inference/v1/abort_requests", "/abort_requests"):
            if body.get("request_ids") != ["rollstream-probe"]:
                self.aborted.set()
            return httpx.Response(200, json=fixture("openai", "abort_requests"))
        if path == "/collective_rpc":
            if "method" not in body:
                return httpx.Response(400, json={"error": {"message": "Missing 'method' in request body"}})
            if body["method"] == "rollstream_reload_weights" and not self.extension:
                message = (
                    "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has "
                    "no attribute 'rollstream_reload_weights'', please check the stack trace above"
                )
                return httpx.Response(500, json={"error": {"message": message, "code": 500}})
            return httpx.Response(200, json=fixture("openai", "collective_rpc"))
        if path == "/update_weight_version":
            if "new_version" not in body:
                return httpx.Response(400, json={"error": {"message": "body.new_version: Field required"}})
            return httpx.Response(200, json={"success": True, "new_version": body["new_version"]})
        if path in ("/pause", "/resume"):
            self.paused = path == "/pause"
            return httpx.Response(200, json=fixture("openai", path.strip("/")))
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": False})
        return httpx.Response(200, json={"object": "list", "data": []})

    async def _sglang(self, path: str, body: Any) -> httpx.Response:
        if path == "/generate":
            if self.generate_status != 200:
                return httpx.Response(self.generate_status, json=self.generate_reply)
            reply = self.generate_reply or fixture("sglang", "generate_n2")
            return httpx.Response(200, json=await self._held(fixture("sglang", "generate_n2_aborted"), reply))
        if path == "/abort_request":
            self.aborted.set()
            return httpx.Response(200)
        if path == "/update_weights_from_disk":
            if body["model_path"].endswith("missing"):
                return httpx.Response(400, json=fixture("sglang", "update_weights_from_disk_failed"))
            return httpx.Response(200, json=fixture("sglang", "update_weights_from_disk"))
        names = {
            "/pause_generation": "pause_generation",
            "/continue_generation": "continue_generation",
            "/update_weight_version": "update_weight_version",
            "/get_model_info": "get_model_info",
        }
        if path in ("/pause_generation", "/continue_generation"):
            self.paused = path == "/pause_generation"
        if path in names:
            return httpx.Response(200, json=fixture("sglang", names[path]))
        return httpx.Response(404, json={"detail": "Not Found"})


class Fleet:
    """Fake servers by base URL, behind one MockTransport."""

    def __init__(self, servers: dict[str, FakeServer]) -> None:
        self.servers = servers
        self._by_address = {_address(httpx.URL(url)): server for url, server in servers.items()}
        self.transport = httpx.MockTransport(self._route)

    async def _route(self, request: httpx.Request) -> httpx.Response:
        return await self._by_address[_address(request.url)].handle(request)


def _address(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.host}:{url.port}"


class Clock:
    def __init__(self) -> None:
        self.time = 1000.0

    def __call__(self) -> float:
        return self.time


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(http_engine, "_now", clock)
    return clock


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """A published weights directory as save_pretrained writes it for an untied model."""
    return published(tmp_path / "step-1", tied=False)


def published(directory: Path, tied: bool) -> Path:
    directory.mkdir(parents=True)
    names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for n in names}).encode()
    (directory / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    (directory / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return directory


def engine_for(
    cls: type[OpenAIEngine] | type[SGLangEngine], fleet: Fleet, model_step: int = 0, **settings: Any
) -> Any:
    settings.setdefault("urls", list(fleet.servers))
    settings.setdefault("api_key", KEY)
    return cls(HTTPEngineSettings(**settings), model_step=model_step, transport=fleet.transport)


def run(test: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(test())


# --- openai: generate ------------------------------------------------------------------


def test_openai_token_endpoint_generates_n_with_logprobs_text_and_versions() -> None:
    server = FakeServer("openai")
    fleet = Fleet({"http://a:8000": server})
    reply = fixture("openai", "generate_text_n2")

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, model_step=4, model="tiny")
        out = await engine.generate(PROMPT, PARAMS, n=2, request_id="r1")
        assert len(out) == 2
        for gen, choice in zip(out, reply["choices"], strict=True):
            assert gen.response_ids.tolist() == choice["token_ids"]
            assert gen.logprobs.tolist() == pytest.approx(
                [c["logprob"] for c in choice["logprobs"]["content"]]
            )
            assert gen.finish_reason == FINISH_LENGTH
            assert gen.text == choice["text"]
            # the server's initial label, "default", is the step the engine held
            assert gen.versions.tolist() == [4] * len(choice["token_ids"])
        method, path, body = server.calls[-1]
        assert (method, path) == ("POST", "/inference/v1/generate")
        assert body["token_ids"] == PROMPT and body["model"] == "tiny" and body["output_mode"] == "text"
        sampling = body["sampling_params"]
        assert sampling["n"] == 2 and sampling["logprobs"] == 0 and sampling["seed"] == 3
        assert sampling["max_tokens"] == 6 and "ignore_eos" not in sampling  # defaults not sent
        assert body["request_id"].endswith("-r1") and server.headers[-1]["x-request-id"] == body["request_id"]
        assert server.headers[-1]["authorization"] == f"Bearer {KEY}"
        await engine.aclose()

    run(test)


def test_openai_versions_come_from_the_weight_version_spans() -> None:
    server = FakeServer("openai")
    fleet = Fleet({"http://a:8000": server})
    server.generate_reply = fixture("openai", "generate_text_spanning")
    choices = server.generate_reply["choices"]

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, model_step=0)
        out = await engine.generate(PROMPT, PARAMS, n=2)
        for gen, choice in zip(out, choices, strict=True):
            expected = np.zeros(len(choice["token_ids"]), dtype=int)
            for span in choice["weight_versions"]:
                expected[span["start"] : span["end"]] = int(span["version"])
            assert gen.versions.tolist() == expected.tolist()
            assert set(gen.versions.tolist()) == {1, 2}  # the recording spans a weight update
        await engine.aclose()

    run(test)


def test_token_versions_reads_dicts_and_lists_and_fills_the_rest() -> None:
    spans = [
        {"version": "default", "start": 0, "end": 2},
        ["7", 2, 4],
        {"version": "8", "start": 4, "end": 9},
    ]
    assert token_versions(spans, 6, start_step=5).tolist() == [5, 5, 7, 7, 8, 8]
    assert token_versions(None, 3, start_step=2).tolist() == [2, 2, 2]
    assert token_versions([{"version": "x", "start": 0, "end": 1}], 2, 9).tolist() == [9, 9]


def test_openai_completions_when_the_server_has_no_token_endpoint() -> None:
    server = FakeServer("openai", paths=VLLM_PLAIN)
    fleet = Fleet({"http://a:8000": server})
    reply = fixture("openai", "completions_n2")

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, model_step=2)
        params = SamplingParams(max_tokens=6, temperature=1.0, stop=["four"], ignore_eos=True)
        out = await engine.generate(PROMPT, params, n=2)
        assert [g.response_ids.tolist() for g in out] == [c["token_ids"] for c in reply["choices"]]
        assert [g.logprobs.tolist() for g in out] == [
            pytest.approx(c["logprobs"]["token_logprobs"]) for c in reply["choices"]
        ]
        assert all(g.versions.tolist() == [2] * 6 for g in out)
        assert [g.text for g in out] == [c["text"] for c in reply["choices"]]
        _, path, body = server.calls[-1]
        assert path == "/v1/completions"
        assert body["prompt"] == PROMPT and body["n"] == 2 and body["logprobs"] == 0
        assert body["return_token_ids"] is True and body["ignore_eos"] is True
        assert body["stop"] == ["four"] and body["include_stop_str_in_output"] is True
        assert "model" not in body  # not set: the server's only model
        await engine.aclose()

    run(test)


def test_openai_server_without_token_ids_is_an_error_saying_so() -> None:
    server = FakeServer("openai", paths=VLLM_PLAIN)
    server.generate_reply = fixture("openai", "completions_n2")
    for choice in server.generate_reply["choices"]:
        del choice["token_ids"]
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        with pytest.raises(EngineError, match=r"http://a:8000/v1/completions returned no token ids"):
            await engine.generate(PROMPT, PARAMS, n=2)
        await engine.aclose()

    run(test)


def test_openai_token_endpoint_of_a_server_without_tokenizer_falls_back_to_ids_only() -> None:
    server = FakeServer("openai")
    text_reply = fixture("openai", "generate_text_n2")
    calls = []

    async def tokens_only(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        if request.url.path == "/inference/v1/generate" and "token_ids" in body:
            calls.append(body)
            if "output_mode" in body:
                message = "output_mode='text' requires sampling_params.detokenize to be true"
                return httpx.Response(400, json={"error": {"message": message}})
            return httpx.Response(200, json=fixture("openai", "generate_tokens_n2"))
        return await server.handle(request)

    engine = OpenAIEngine(
        HTTPEngineSettings(urls=["http://a:8000"]), transport=httpx.MockTransport(tokens_only)
    )

    async def test() -> None:
        out = await engine.generate(PROMPT, PARAMS, n=2)
        assert [g.response_ids.tolist() for g in out] == [c["token_ids"] for c in text_reply["choices"]]
        assert all(g.text == "" for g in out)
        await engine.generate(PROMPT, PARAMS, n=2)  # remembered: one request, ids only
        assert ["output_mode" in c for c in calls] == [True, False, False]
        await engine.aclose()

    run(test)


def test_openai_finds_endpoints_by_probing_when_there_is_no_schema() -> None:
    server = FakeServer("openai", schema=False)
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        await engine.generate(PROMPT, PARAMS, n=2)
        assert server.calls[-1][1] == "/inference/v1/generate"
        # the probe of the abort endpoint names an id no request has: it aborts nothing
        probes = [body for _, path, body in server.calls if path == "/abort_requests"]
        assert probes == [{"request_ids": ["rollstream-probe"]}]
        assert not server.aborted.is_set()
        engine.paused = False
        await engine.pause()  # /is_paused answered: /pause is there
        assert server.calls[-1][1] == "/pause"
        await engine.aclose()

    run(test)


# --- openai: abort ------------------------------------------------------------------


def test_openai_abort_returns_the_partial_tokens() -> None:
    server = FakeServer("openai")
    server.hold = True
    fleet = Fleet({"http://a:8000": server})
    partial = fixture("openai", "generate_text_aborted")["choices"]

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        task = asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2, request_id="r1"))
        await wait_for_async(lambda: server.held == 1)
        assert await engine.abort(["r1", "unknown"]) == 1
        out = await task
        assert [g.finish_reason for g in out] == [FINISH_ABORT, FINISH_ABORT]
        assert [g.response_ids.tolist() for g in out] == [c["token_ids"] for c in partial]
        assert all(len(g.logprobs) == len(g.response_ids) > 0 for g in out)
        aborts = [body for _, path, body in server.calls if path == "/inference/v1/abort_requests"]
        sent = [b for b in aborts if b["request_ids"] != ["rollstream-probe"]]
        assert sent and sent[0]["request_ids"][0].startswith("generate-tokens-")
        assert sent[0]["request_ids"][0].endswith("-r1")
        await engine.aclose()

    run(test)


def test_openai_abort_through_the_dev_endpoint_names_the_completion_id() -> None:
    server = FakeServer("openai", paths=VLLM_PLAIN | {"/abort_requests"})
    server.hold = True
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        tasks = [asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2, request_id=r)) for r in "xy"]
        await wait_for_async(lambda: server.held == 2)
        assert await engine.abort(None) == 2
        for task in tasks:
            assert {g.finish_reason for g in await task} == {FINISH_ABORT}
        ids = {i for _, path, body in server.calls if path == "/abort_requests" for i in body["request_ids"]}
        # vLLM's id of prompt 0 of a completion: "cmpl-<X-Request-Id>-0" (without "-0" nothing aborts)
        x_id = next(h["x-request-id"] for h in server.headers if h.get("x-request-id", "").endswith("-x"))
        assert f"cmpl-{x_id}-0" in ids
        await engine.aclose()

    run(test)


def test_openai_abort_without_an_endpoint_cuts_the_request_off(caplog: pytest.LogCaptureFixture) -> None:
    server = FakeServer("openai", paths=VLLM_PLAIN)
    server.hold = True
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, model_step=3)
        task = asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2, request_id="r1"))
        await wait_for_async(lambda: server.held == 1)
        await engine.abort(["r1"])
        out = await task
        assert [(g.finish_reason, len(g.response_ids)) for g in out] == [(FINISH_ABORT, 0)] * 2
        await wait_for_async(lambda: server.held == 0)  # the server saw the connection go
        assert (await engine.health()).outstanding == 0
        await engine.aclose()

    with caplog.at_level(logging.WARNING, logger=http_engine.__name__):
        run(test)
    assert "http://a:8000 has no abort endpoint" in caplog.text


# --- openai: pause, weights, resume ----------------------------------------------------


def test_openai_partial_sync_pauses_reloads_labels_and_resumes(weights: Path) -> None:
    server = FakeServer("openai")
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        await engine.generate(PROMPT, PARAMS, n=2)  # probes the endpoints
        start = len(server.calls)
        await engine.pause()
        await engine.update_weights(1, str(weights))
        await engine.resume()
        calls = server.calls[start:]
        assert [path for _, path, _ in calls] == [
            "/pause",
            "/collective_rpc",
            "/update_weight_version",
            "/resume",
        ]
        assert calls[0][2] == {"mode": "keep", "clear_cache": "false"}
        assert calls[1][2] == {"method": "rollstream_reload_weights", "args": [str(weights)]}
        assert calls[2][2] == {"new_version": "1"}
        assert engine.model_step == 1 and not engine.paused
        await engine.aclose()

    run(test)


def test_openai_update_outside_a_pause_holds_the_server_still(weights: Path) -> None:
    server = FakeServer("openai")
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        await engine.update_weights(2, str(weights))  # drain / abort modes: no pause before
        assert server.paths_called()[-4:] == [
            "/pause",
            "/collective_rpc",
            "/update_weight_version",
            "/resume",
        ]
        await engine.update_weights(3)  # no weights: a label only
        assert server.calls[-1] == ("POST", "/update_weight_version", {"new_version": "3"})
        assert engine.model_step == 3
        await engine.aclose()

    run(test)


def test_openai_partial_sync_without_pause_names_the_missing_capability() -> None:
    fleet = Fleet({"http://user:pw@a:8000": FakeServer("openai", paths=VLLM_PLAIN)})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        with pytest.raises(EngineError) as error:
            await engine.pause()
        message = str(error.value)
        assert "partial weight sync needs /pause on the server; http://user:***@a:8000 has none" in message
        assert "on_weight_sync = drain or abort" in message and "VLLM_SERVER_DEV_MODE=1" in message
        assert "pw" not in message.replace("***", "") and not engine.paused
        await engine.aclose()

    run(test)


def test_openai_weights_without_a_reload_endpoint_name_the_missing_capability(weights: Path) -> None:
    fleet = Fleet({"http://a:8000": FakeServer("openai", paths=VLLM_PLAIN)})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        with pytest.raises(EngineError, match=r"loading weights needs /collective_rpc .* has neither"):
            await engine.update_weights(1, str(weights))
        assert engine.model_step == 0
        await engine.aclose()

    run(test)


def test_openai_reload_without_the_worker_extension(tmp_path: Path, weights: Path) -> None:
    """vLLM's own reload_weights keeps the old lm_head of a tied model: refused for one,
    used for an untied one."""
    server = FakeServer("openai")
    server.extension = False
    fleet = Fleet({"http://a:8000": server})
    tied = published(tmp_path / "tied", tied=True)

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        with pytest.raises(EngineError, match=r"ties lm_head to the embeddings.*--worker-extension-cls"):
            await engine.update_weights(1, str(tied))
        assert engine.model_step == 0
        await engine.update_weights(1, str(weights))
        rpc = [body for _, path, body in server.calls if path == "/collective_rpc"]
        assert rpc[-1] == {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}
        assert engine.model_step == 1
        await engine.aclose()

    run(test)


def test_the_reload_method_is_the_one_of_rollstreams_worker_extension() -> None:
    from rollstream.producer.engines import vllm_worker  # imports nothing of vLLM

    extension = f"{vllm_worker.__name__}.{vllm_worker.WeightReloader.__name__}"
    assert extension == openai_engine.WORKER_EXTENSION
    assert callable(getattr(vllm_worker.WeightReloader, openai_engine.RELOAD_METHOD))


def test_each_server_kind_has_a_module_of_its_own_beside_the_base() -> None:
    for kind, cls in (("openai", OpenAIEngine), ("sglang", SGLangEngine)):
        engine = make_engine(EngineSettings(kind=kind, **{kind: HTTPEngineSettings(urls=["http://a:8000"])}))
        assert type(engine) is cls and cls.__module__ == f"rollstream.producer.engines.{kind}"
        assert issubclass(cls, http_engine.HTTPEngine)
    assert http_engine.HTTPEngine.__module__ == http_engine.__name__
    # one home per name: the server kinds' names are theirs, not the base's
    for name in ("OpenAIEngine", "WORKER_EXTENSION", "SGLangEngine", "sglang_from_settings"):
        assert not hasattr(http_engine, name), name


def test_ties_lm_head_reads_the_config_and_safetensors_headers(tmp_path: Path) -> None:
    assert ties_lm_head(str(published(tmp_path / "t", tied=True))) is True
    assert ties_lm_head(str(published(tmp_path / "u", tied=False))) is False
    assert ties_lm_head(str(tmp_path / "absent")) is None


def test_weights_that_are_not_there_are_refused_before_the_server_sees_them(tmp_path: Path) -> None:
    server = FakeServer("openai")
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        with pytest.raises(EngineError, match=r"no \*\.safetensors at .*weights_path_on_server"):
            await engine.update_weights(1, str(tmp_path / "step-1"))
        assert "/collective_rpc" not in server.paths_called()
        await engine.aclose()

    run(test)


def test_weights_path_on_server_maps_the_published_path(weights: Path) -> None:
    assert server_path("/ckpt/run/step-3", "") == "/ckpt/run/step-3"
    assert server_path("/ckpt/run/step-3", "/mnt/w") == "/mnt/w/step-3"
    assert server_path("/ckpt/run/step-3/", "/mnt/w/") == "/mnt/w/step-3"
    assert server_path("/ckpt/run/step-3", "/ckpt=/data/ckpt") == "/data/ckpt/run/step-3"
    with pytest.raises(EngineError, match=r"not under '/other'"):
        server_path("/ckpt/run/step-3", "/other=/data")
    server = FakeServer("openai")
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, weights_path_on_server="/remote")
        await engine.update_weights(1, str(weights))
        rpc = [body for _, path, body in server.calls if path == "/collective_rpc"]
        assert rpc[-1]["args"] == ["/remote/step-1"]
        await engine.aclose()

    run(test)


# --- several servers ----------------------------------------------------------------


def test_requests_go_to_the_server_with_the_fewest_outstanding() -> None:
    a, b = FakeServer("openai"), FakeServer("openai")
    a.hold = b.hold = True
    fleet = Fleet({"http://a:8000": a, "http://b:8000": b})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        tasks = [asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2)) for _ in range(4)]
        await wait_for_async(lambda: a.held + b.held == 4)
        assert (a.held, b.held) == (2, 2)
        a.released.set()
        await wait_for_async(lambda: a.held == 0)
        await asyncio.gather(*tasks[:1], *(t for t in tasks if t.done()))
        a.released.clear()
        more = [asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2)) for _ in range(2)]
        await wait_for_async(lambda: a.held + b.held == 4)
        assert (a.held, b.held) == (2, 2)  # both new ones went to a, which had none
        a.released.set()
        b.released.set()
        await asyncio.gather(*tasks, *more)
        await engine.aclose()

    run(test)


def test_a_dead_server_is_taken_out_and_retried_after_retry_s(clock: Clock) -> None:
    a, b = FakeServer("openai"), FakeServer("openai")
    a.down = True
    fleet = Fleet({"http://a:8000": a, "http://b:8000": b})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, retry_s=5.0)
        out = await engine.generate(PROMPT, PARAMS, n=2)  # a refuses: b serves it
        assert len(out) == 2 and len(b.paths_called()) > 0
        tried = len(a.calls)
        for _ in range(3):
            await engine.generate(PROMPT, PARAMS, n=2)
        assert len(a.calls) == tried  # out: not tried again
        health = await engine.health()
        assert health.healthy and "1 of 2 servers up" in health.detail and "http://a:8000" in health.detail
        a.down = False
        clock.time += 5.0
        health = await engine.health()  # a probe finds it back
        assert "2 of 2 servers up" in health.detail
        a.hold = b.hold = True
        tasks = [asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2)) for _ in range(2)]
        await wait_for_async(lambda: a.held + b.held == 2)
        assert (a.held, b.held) == (1, 1)
        a.released.set()
        b.released.set()
        await asyncio.gather(*tasks)
        await engine.aclose()

    run(test)


def test_a_server_back_from_out_gets_the_current_weights_first(clock: Clock, weights: Path) -> None:
    a, b = FakeServer("openai"), FakeServer("openai")
    fleet = Fleet({"http://a:8000": a, "http://b:8000": b})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, retry_s=1.0)
        await engine.update_weights(1, str(weights))
        a.down = True
        b.hold = True
        task = asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2))  # a refuses, b holds it
        await wait_for_async(lambda: b.held == 1)
        a.down = False
        clock.time += 1.0
        a.calls.clear()
        await engine.generate(PROMPT, PARAMS, n=2)  # a has the fewest outstanding now
        rpc = [
            (path, body) for _, path, body in a.calls if path in ("/collective_rpc", "/update_weight_version")
        ]
        assert rpc == [
            ("/collective_rpc", {"method": "rollstream_reload_weights", "args": [str(weights)]}),
            ("/update_weight_version", {"new_version": "1"}),
        ]
        assert a.paths_called()[-1] == "/inference/v1/generate"
        b.released.set()
        await task
        await engine.aclose()

    run(test)


def test_all_servers_down_is_an_error_naming_each_url_without_secrets(clock: Clock) -> None:
    a, b = FakeServer("openai"), FakeServer("openai")
    a.down = b.down = True
    fleet = Fleet({"http://a:8000": a, "https://admin:hunter2@b:8443": b})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, retry_s=7.0)
        with pytest.raises(EngineError) as error:
            await engine.generate(PROMPT, PARAMS, n=2)
        message = str(error.value)
        assert "no server answers" in message and "http://a:8000" in message
        assert "https://admin:***@b:8443" in message and "Connection refused" in message
        assert "hunter2" not in message and KEY not in message and "7.0 s" in message
        health = await engine.health()
        assert not health.healthy and "hunter2" not in health.detail
        with pytest.raises(EngineError, match="no server answers"):
            await engine.pause()
        await engine.aclose()

    run(test)


def test_server_errors_are_engine_errors_without_the_api_key() -> None:
    server = FakeServer("openai")
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        await engine.generate(PROMPT, PARAMS, n=2)
        server.generate_status, server.generate_reply = 400, fixture("openai", "error_bad_token")
        with pytest.raises(
            EngineError, match=r"http://a:8000/inference/v1/generate answered HTTP 400: Token id"
        ):
            await engine.generate(PROMPT, PARAMS, n=2)
        server.error_echo = True
        with pytest.raises(EngineError) as error:
            await engine.generate(PROMPT, PARAMS, n=2)
        assert "Bearer ***" in str(error.value) and KEY not in str(error.value)
        await engine.aclose()

    run(test)


def test_a_reply_with_the_wrong_number_of_choices_is_an_error() -> None:
    server = FakeServer("openai")
    server.generate_reply = fixture("openai", "generate_text_n2")
    server.generate_reply["choices"] = server.generate_reply["choices"][:1]
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        with pytest.raises(EngineError, match=r"not 2 choices"):
            await engine.generate(PROMPT, PARAMS, n=2)
        with pytest.raises(EngineError, match="empty prompt"):
            await engine.generate([], PARAMS, n=2)
        await engine.aclose()

    run(test)


# --- settings ----------------------------------------------------------------------


def test_settings_errors_name_the_setting() -> None:
    with pytest.raises(SettingsError, match=r"engines\.openai\.urls is empty"):
        OpenAIEngine(HTTPEngineSettings())
    with pytest.raises(SettingsError, match=r"engines\.sglang\.urls: 'ftp://u:\*\*\*@x' is not an http"):
        SGLangEngine(HTTPEngineSettings(urls=["ftp://u:pw@x"]))
    with pytest.raises(SettingsError, match="names a server twice"):
        OpenAIEngine(HTTPEngineSettings(urls=["http://a:1", "http://a:1/"]))


def test_make_engine_builds_the_http_kinds() -> None:
    openai = make_engine(EngineSettings(kind="openai", openai=HTTPEngineSettings(urls=["http://a:8000/v1"])))
    assert isinstance(openai, OpenAIEngine)
    assert [s.url for s in openai._servers] == ["http://a:8000"]  # an OpenAI client's base_url, /v1 off
    sglang = make_engine(EngineSettings(kind="sglang", sglang=HTTPEngineSettings(urls=["http://b:30000"])))
    assert isinstance(sglang, SGLangEngine)


# --- sglang ------------------------------------------------------------------------


def test_sglang_generates_n_as_a_batch_of_the_prompt() -> None:
    server = FakeServer("sglang")
    fleet = Fleet({"http://s:30000": server})
    reply = fixture("sglang", "generate_n2")

    async def test() -> None:
        engine = engine_for(SGLangEngine, fleet, model_step=2)
        params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=11, stop_token_ids=[1])
        out = await engine.generate(PROMPT, params, n=2, request_id="r1")
        for gen, item in zip(out, reply, strict=True):
            pairs = item["meta_info"]["output_token_logprobs"]
            assert gen.response_ids.tolist() == item["output_ids"] == [p[1] for p in pairs]
            assert gen.logprobs.tolist() == pytest.approx([p[0] for p in pairs])
            assert gen.finish_reason == FINISH_LENGTH and gen.text == item["text"]
            assert gen.versions.tolist() == [2] * len(pairs)
        _, path, body = server.calls[-1]
        assert path == "/generate"
        assert body["input_ids"] == [PROMPT, PROMPT] and body["return_logprob"] is True
        assert len(body["rid"]) == 2 and body["rid"][0].endswith("-r1-0") and body["rid"][1].endswith("-r1-1")
        sampling = body["sampling_params"]
        assert [s["sampling_seed"] for s in sampling] == [11, 12]  # one seed each, or n equal samples
        assert sampling[0]["max_new_tokens"] == 6 and sampling[0]["stop_token_ids"] == [1]
        assert sampling[0]["temperature"] == 0.7 and sampling[0]["top_p"] == 0.9
        assert server.headers[-1]["authorization"] == f"Bearer {KEY}"
        await engine.aclose()

    run(test)


def test_sglang_finish_reasons_and_spans() -> None:
    server = FakeServer("sglang")
    fleet = Fleet({"http://s:30000": server})

    async def test() -> None:
        engine = engine_for(SGLangEngine, fleet, model_step=0)
        server.generate_reply = fixture("sglang", "generate_n2_no_spans")
        out = await engine.generate(PROMPT, PARAMS, n=2)
        assert [g.finish_reason for g in out] == [FINISH_STOP, FINISH_LENGTH]
        assert out[0].response_ids.tolist()[-1] == 1 and out[0].versions.tolist() == [0] * 4
        server.generate_reply = fixture("sglang", "generate_n2_spanning")
        out = await engine.generate(PROMPT, PARAMS, n=2)
        assert out[0].versions.tolist() == [0, 0, 1, 1, 1, 1]
        assert out[1].versions.tolist() == [0, 0, 0, 0, 1, 1]
        server.generate_reply = fixture("sglang", "generate_n2")[:1]
        with pytest.raises(EngineError, match=r"http://s:30000/generate returned .* for a batch of 2"):
            await engine.generate(PROMPT, PARAMS, n=2)
        server.generate_status, server.generate_reply = 400, fixture("sglang", "error_bad_request")
        with pytest.raises(EngineError, match=r"answered HTTP 400: The input \(600 tokens\) is longer"):
            await engine.generate(PROMPT, PARAMS, n=2)
        await engine.aclose()

    run(test)


def test_sglang_abort_by_request_id_returns_the_partial_tokens() -> None:
    server = FakeServer("sglang")
    server.hold = True
    fleet = Fleet({"http://s:30000": server})
    partial = fixture("sglang", "generate_n2_aborted")

    async def test() -> None:
        engine = engine_for(SGLangEngine, fleet)
        task = asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2, request_id="r1"))
        await wait_for_async(lambda: server.held == 1)
        assert await engine.abort(None) == 1
        out = await task
        assert [g.finish_reason for g in out] == [FINISH_ABORT, FINISH_ABORT]
        assert [g.response_ids.tolist() for g in out] == [p["output_ids"] for p in partial]
        rids = [body["rid"] for _, path, body in server.calls if path == "/abort_request"]
        sent = next(body["rid"] for _, path, body in server.calls if path == "/generate")
        assert rids[:2] == sent  # each sample by its own id, never abort_all (others share the server)
        assert all("abort_all" not in body for _, path, body in server.calls if path == "/abort_request")
        await engine.aclose()

    run(test)


def test_sglang_partial_sync_retracts_loads_from_disk_and_continues(tmp_path: Path, weights: Path) -> None:
    server = FakeServer("sglang")
    fleet = Fleet({"http://s:30000": server})

    async def test() -> None:
        engine = engine_for(SGLangEngine, fleet, weights_path_on_server=f"{tmp_path}=/mnt")
        await engine.pause()
        await engine.update_weights(1, str(weights))
        await engine.resume()
        assert server.calls == [
            ("POST", "/pause_generation", {"mode": "retract"}),
            ("POST", "/update_weights_from_disk", {"model_path": "/mnt/step-1", "weight_version": "1"}),
            ("POST", "/continue_generation", {}),
        ]
        assert engine.model_step == 1
        await engine.update_weights(2)  # a label only; SGLang would abort everything by default
        assert server.calls[-1] == (
            "POST",
            "/update_weight_version",
            {"new_version": "2", "abort_all_requests": False},
        )
        with pytest.raises(
            EngineError, match=r"/update_weights_from_disk answered HTTP 400: .* does not exist"
        ):
            await engine.update_weights(3, f"{tmp_path}/missing")
        assert engine.model_step == 2
        await engine.aclose()

    run(test)


def test_sglang_health_probes_a_returning_server(clock: Clock) -> None:
    server = FakeServer("sglang")
    server.down = True
    fleet = Fleet({"http://s:30000": server})

    async def test() -> None:
        engine = engine_for(SGLangEngine, fleet, retry_s=2.0)
        with pytest.raises(EngineError, match=r"no server answers: http://s:30000 \(ConnectError"):
            await engine.generate(PROMPT, PARAMS, n=2)
        assert not (await engine.health()).healthy
        clock.time += 2.0
        health = await engine.health()  # due: probed, still down
        assert not health.healthy and server.refused[-1] == "/get_model_info"
        server.down = False
        clock.time += 2.0
        assert (await engine.health()).healthy
        out = await engine.generate(PROMPT, PARAMS, n=2)
        assert len(out) == 2
        await engine.aclose()

    run(test)


# --- take-out, pause, abort and timeout races ---------------------------------------


def started(coroutine: Coroutine[Any, Any, Any], flag: asyncio.Event) -> asyncio.Future[Any]:
    """A task of ``coroutine``; ``flag`` is set when it runs: once the test sees the flag,
    the coroutine has run up to where it first waits."""

    async def go() -> Any:
        flag.set()
        return await coroutine

    return asyncio.ensure_future(go())


def test_pause_takes_out_a_server_that_does_not_answer_and_pauses_it_when_back(clock: Clock) -> None:
    a, b = FakeServer("openai"), FakeServer("openai")
    a.down = True
    fleet = Fleet({"http://a:8000": a, "http://b:8000": b})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, retry_s=5.0)
        await engine.pause()  # a does not answer its probe: out, not an error; b paused
        assert engine.paused and b.paused and not a.calls
        health = await engine.health()
        assert "1 of 2 servers up" in health.detail and "Connection refused" in health.detail
        a.down = False
        clock.time += 5.0
        await engine.generate(PROMPT, PARAMS, n=2)  # a, back, is paused before it serves
        assert a.paused and a.paths_called()[-2:] == ["/pause", "/inference/v1/generate"]
        await engine.resume()
        assert not a.paused and not b.paused and not engine.paused
        await engine.aclose()

    run(test)


def test_resume_while_a_returning_server_is_paused_resumes_it_too(clock: Clock, weights: Path) -> None:
    a, b = FakeServer("openai"), FakeServer("openai")
    fleet = Fleet({"http://a:8000": a, "http://b:8000": b})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, retry_s=1.0)
        await engine.update_weights(1, str(weights))
        await engine.pause()
        a.down = True
        await engine.generate(PROMPT, PARAMS, n=2)  # a refuses: out; b serves
        a.down = False
        clock.time += 1.0
        gate = a.gates["/pause"] = asyncio.Event()
        task = asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2))  # a: paused and loaded first
        await wait_for_async(lambda: a.gated == 1)
        flag = asyncio.Event()
        resuming = started(engine.resume(), flag)
        await wait_for_async(flag.is_set)
        gate.set()
        await asyncio.gather(task, resuming)
        assert not engine.paused and not a.paused and not b.paused
        await engine.aclose()

    run(test)


def test_pause_during_the_hold_of_a_weight_load_waits_for_it(weights: Path) -> None:
    server = FakeServer("openai")
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        gate = server.gates["/collective_rpc"] = asyncio.Event()
        update = asyncio.ensure_future(engine.update_weights(1, str(weights)))  # drain / abort mode
        await wait_for_async(lambda: server.gated == 1)
        assert server.paused  # held still by the load itself
        flag = asyncio.Event()
        pausing = started(engine.pause(), flag)  # partial mode of a later sync
        await wait_for_async(flag.is_set)
        gate.set()
        await asyncio.gather(update, pausing)
        assert engine.paused and server.paused  # the load's own resume came before the pause
        await engine.resume()
        assert not server.paused
        await engine.aclose()

    run(test)


def test_an_abort_while_the_endpoints_are_probed_is_not_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(http_engine, "_ABORT_TRIES", 2)
    monkeypatch.setattr(http_engine, "_ABORT_RETRY_S", 0.01)
    server = FakeServer("openai")
    fleet = Fleet({"http://a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet)
        gate = server.gates["/openapi.json"] = asyncio.Event()
        task = asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2, request_id="r1"))
        await wait_for_async(lambda: server.gated == 1)
        assert await engine.abort(["r1"]) == 1
        await wait_for_async(lambda: "gave up asking the server to abort 'r1'" in caplog.text)
        gate.set()
        out = await task
        assert [(g.finish_reason, len(g.response_ids)) for g in out] == [(FINISH_ABORT, 0)] * 2
        assert "/inference/v1/generate" not in server.paths_called()  # never sent
        await engine.aclose()

    with caplog.at_level(logging.WARNING, logger=http_engine.__name__):
        run(test)


def test_an_abort_while_a_returning_server_loads_the_weights_is_not_lost(clock: Clock, weights: Path) -> None:
    server = FakeServer("sglang")
    fleet = Fleet({"http://s:30000": server})

    async def test() -> None:
        engine = engine_for(SGLangEngine, fleet, retry_s=1.0)
        await engine.update_weights(1, str(weights))
        server.down = True
        with pytest.raises(EngineError, match="no server answers"):
            await engine.generate(PROMPT, PARAMS, n=2)
        server.down = False
        clock.time += 1.0
        gate = server.gates["/update_weights_from_disk"] = asyncio.Event()
        task = asyncio.ensure_future(engine.generate(PROMPT, PARAMS, n=2, request_id="r1"))
        await wait_for_async(lambda: server.gated == 1)
        assert await engine.abort(["r1"]) == 1
        gate.set()
        out = await task
        assert [(g.finish_reason, len(g.response_ids)) for g in out] == [(FINISH_ABORT, 0)] * 2
        assert "/generate" not in server.paths_called()  # never sent
        await engine.aclose()

    run(test)


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_an_overloaded_or_unavailable_server_is_taken_out_and_the_request_served_elsewhere(
    clock: Clock, status: int
) -> None:
    a, b = FakeServer("openai"), FakeServer("openai")
    a.generate_status, a.generate_reply = status, {"error": {"message": "busy"}}
    fleet = Fleet({"http://a:8000": a, "http://b:8000": b})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, retry_s=5.0)
        for _ in range(3):  # whichever it tries first, b serves them all
            assert len(await engine.generate(PROMPT, PARAMS, n=2)) == 2
        health = await engine.health()
        assert "1 of 2 servers up" in health.detail and f"HTTP {status}" in health.detail
        await engine.aclose()

    run(test)


def test_a_server_that_cannot_load_the_weights_is_taken_out(
    clock: Clock, weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = FakeServer("openai"), FakeServer("openai")
    fleet = Fleet({"http://a:8000": a, "http://b:8000": b})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, retry_s=1.0)
        await engine.update_weights(1, str(weights))
        a.down = True
        await engine.generate(PROMPT, PARAMS, n=2)  # a refuses: out; b serves
        a.down, a.paths = False, VLLM_PLAIN  # back, restarted without dev mode: it cannot load
        clock.time += 1.0
        for _ in range(2):
            assert len(await engine.generate(PROMPT, PARAMS, n=2)) == 2  # b serves
        assert "/v1/completions" not in a.paths_called()
        health = await engine.health()
        assert (
            "1 of 2 servers up" in health.detail and "loading weights needs /collective_rpc" in health.detail
        )
        b.down = True
        with pytest.raises(EngineError) as error:
            await engine.generate(PROMPT, PARAMS, n=2)
        message = str(error.value)
        assert (
            "no server answers" in message
            and "http://a:8000 (loading weights needs /collective_rpc" in message
        )
        assert "http://b:8000 (ConnectError" in message
        await engine.aclose()

    with caplog.at_level(logging.WARNING, logger=http_engine.__name__):
        run(test)
    assert "http://a:8000 taken out for 1.0 s: loading weights needs /collective_rpc" in caplog.text


def test_a_generation_longer_than_timeout_s_is_aborted_and_its_server_stays_in() -> None:
    a, b = FakeServer("openai"), FakeServer("openai")
    a.timeouts.add("/inference/v1/generate")
    fleet = Fleet({"http://a:8000": a, "http://b:8000": b})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, timeout_s=30.0)
        with pytest.raises(
            EngineError,
            match=r"exceeded engines\.openai\.timeout_s = 30\.0 s; the server was asked to abort it",
        ):
            await engine.generate(PROMPT, PARAMS, n=2, request_id="r1")
        aborts = [body["request_ids"] for _, path, body in a.calls if path == "/inference/v1/abort_requests"]
        assert (
            len(aborts) == 1 and aborts[0][0].startswith("generate-tokens-") and aborts[0][0].endswith("-r1")
        )
        assert "/inference/v1/generate" not in b.paths_called()  # not started again elsewhere
        assert "2 of 2 servers up" in (await engine.health()).detail
        a.timeouts.clear()
        await engine.generate(PROMPT, PARAMS, n=2)
        assert a.paths_called()[-1] == "/inference/v1/generate"  # a serves on
        await engine.aclose()

    run(test)


def test_user_info_goes_as_basic_auth_never_in_a_request_url(caplog: pytest.LogCaptureFixture) -> None:
    server = FakeServer("openai")
    fleet = Fleet({"http://admin:hunter%402@a:8000": server})

    async def test() -> None:
        engine = engine_for(OpenAIEngine, fleet, api_key="")
        await engine.generate(PROMPT, PARAMS, n=2)
        assert server.urls and all(url.userinfo == b"" for url in server.urls)
        basic = httpx.BasicAuth("admin", "hunter@2")._auth_header  # the password percent-decoded
        assert {h["authorization"] for h in server.headers} == {basic}
        await engine.aclose()

    with caplog.at_level(logging.INFO, logger="httpx"):
        run(test)
    assert "HTTP Request" in caplog.text and "hunter" not in caplog.text
