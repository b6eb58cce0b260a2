"""The ``openai`` engine: an OpenAI-compatible server, vLLM's first of all.

It sends token ids to vLLM's token endpoint, ``/inference/v1/generate``
(``--enable-scale-out``), which also returns the weight version of every token;
otherwise ``/v1/completions`` with the prompt as token ids and ``return_token_ids``.
Abort, pause, weight loading and version labels go to vLLM's control endpoints
(``/abort_requests``, ``/pause``, ``/collective_rpc``, ``/update_weight_version``,
``/resume``; ``VLLM_SERVER_DEV_MODE=1``) where the server has them; where it has not,
the operation that needs one fails with an EngineError that names what is missing and
what to do instead. What every HTTP engine shares is in http.py (servers, take-outs,
aborts) and http_client.py (the requests themselves).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, ClassVar

from rollstream.producer.engines.base import (
    EngineError,
    Generation,
    SamplingParams,
)
from rollstream.producer.engines.http import HTTPEngine
from rollstream.producer.engines.http_client import (
    FROM_DISK,
    _aborted,
    _Call,
    _check_success,
    _describe,
    _generation,
    _HTTPStatus,
    _Server,
)
from rollstream.shared.engine_settings import EngineSettings

logger = logging.getLogger(__name__)

# vLLM's endpoints (the openai kind)
TOKENS = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
TOKENS_ABORT = "/inference/v1/abort_requests"  # beside the token endpoint (--enable-scale-out)
DEV_ABORT = "/abort_requests"  # dev mode (VLLM_SERVER_DEV_MODE=1)
PAUSE = "/pause"
RESUME = "/resume"
RPC = "/collective_rpc"
WEIGHT_VERSION = "/update_weight_version"
# rollstream's vLLM worker extension (vllm_worker.py), a reload that also moves a tied
# lm_head: a server started with --worker-extension-cls WORKER_EXTENSION has the method
WORKER_EXTENSION = "rollstream.producer.engines.vllm_worker.WeightReloader"
RELOAD_METHOD = "rollstream_reload_weights"


class OpenAIEngine(HTTPEngine):
    """An OpenAI-compatible server: vLLM's token endpoint when there, else /v1/completions."""

    kind = "openai"
    alive_path = "/v1/models"

    # endpoint -> a probe that changes nothing on a server that has it
    _CANDIDATES: ClassVar[dict[str, tuple[str, str, Any]]] = {
        TOKENS: ("POST", TOKENS, {}),
        TOKENS_ABORT: ("POST", TOKENS_ABORT, {"request_ids": ["rollstream-probe"]}),
        DEV_ABORT: ("POST", DEV_ABORT, {"request_ids": ["rollstream-probe"]}),
        PAUSE: ("GET", "/is_paused", None),  # /pause and /resume come with it
        RESUME: ("GET", "/is_paused", None),
        RPC: ("POST", RPC, {}),
        WEIGHT_VERSION: ("POST", WEIGHT_VERSION, {}),
        FROM_DISK: ("POST", FROM_DISK, {}),
    }

    async def _generate_on(
        self,
        server: _Server,
        call: _Call,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        start_step: int,
    ) -> list[Generation]:
        paths = await self._paths(server, self._CANDIDATES)
        if call.aborted:  # while the endpoints were probed: not sent at all
            return [_aborted(start_step) for _ in range(n)]
        headers = {"X-Request-Id": call.server_id}  # vLLM takes it as the request's id
        try:
            if TOKENS in paths:
                return await self._tokens(server, call, prompt_ids, params, n, start_step, headers)
            return await self._completions(server, call, prompt_ids, params, n, start_step, headers)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.aborted and not (task is not None and task.cancelling()):
                return [_aborted(start_step) for _ in range(n)]  # cut off: no endpoint to abort with
            raise

    async def _tokens(
        self,
        server: _Server,
        call: _Call,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        start_step: int,
        headers: dict[str, str],
    ) -> list[Generation]:
        sampling: dict[str, Any] = {"n": n, "logprobs": 0, **_vllm_sampling(params)}
        body: dict[str, Any] = {
            "request_id": call.server_id,
            "token_ids": prompt_ids,
            "sampling_params": sampling,
        }
        if self.settings.model:
            body["model"] = self.settings.model
        call.abort_ids = [f"generate-tokens-{call.server_id}"]
        if server.text_mode:
            body["output_mode"] = "text"  # the text too, for the judges (vLLM >= 0.32)
        try:
            reply = await self._request(server, "POST", TOKENS, body, headers=headers, call=call)
        except _HTTPStatus as exc:
            if not (server.text_mode and exc.status == 400 and "output_mode" in str(exc)):
                raise
            server.text_mode = False  # a server without a tokenizer: ids only
            del body["output_mode"]
            reply = await self._request(server, "POST", TOKENS, body, headers=headers, call=call)
        choices = _choices(reply, server, TOKENS, n)
        out = []
        for choice in choices:
            ids = choice.get("token_ids") or []
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [entry["logprob"] for entry in content]
            versions = self._versions(choice.get("weight_versions"), len(ids), start_step)
            out.append(
                _generation(server, TOKENS, ids, logprobs, versions, choice.get("finish_reason"), choice)
            )
        return out

    async def _completions(
        self,
        server: _Server,
        call: _Call,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        start_step: int,
        headers: dict[str, str],
    ) -> list[Generation]:
        body: dict[str, Any] = {"prompt": prompt_ids, "n": n, "logprobs": 0, "return_token_ids": True}
        body.update(_vllm_sampling(params))
        if self.settings.model:
            body["model"] = self.settings.model
        call.abort_ids = [f"cmpl-{call.server_id}-0"]  # vLLM's id of prompt 0 of the request
        reply = await self._request(server, "POST", COMPLETIONS, body, headers=headers, call=call)
        out = []
        for choice in _choices(reply, server, COMPLETIONS, n):
            ids = choice.get("token_ids")
            if ids is None:
                raise EngineError(
                    f"openai engine: {server.name}{COMPLETIONS} returned no token ids (it ignores "
                    "return_token_ids): rollstream needs the server's own token ids — run vLLM, or "
                    'SGLang with engines.kind = "sglang"'
                )
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            versions = self._versions(None, len(ids), start_step)
            out.append(
                _generation(server, COMPLETIONS, ids, logprobs, versions, choice.get("finish_reason"), choice)
            )
        return out

    async def _reload(self, server: _Server, path: str, target: str) -> None:
        """Reload through rollstream's worker extension when the server runs it, else
        through vLLM's own reload_weights — which keeps the old lm_head of a model that
        ties it to the embeddings, so that is refused for such a model."""
        if server.extension is not False:
            try:
                await self._request(server, "POST", RPC, {"method": RELOAD_METHOD, "args": [target]})
                server.extension = True
                return
            except _HTTPStatus as exc:
                if f"no attribute '{RELOAD_METHOD}'" not in str(exc):
                    raise
                server.extension = False
                logger.info("%s engine: %s runs without %s", self.kind, server.name, WORKER_EXTENSION)
        tied = ties_lm_head(path)
        if tied:
            raise EngineError(
                f"openai engine: the model at {path!r} ties lm_head to the embeddings; {server.name} has "
                "only vLLM's reload_weights, which keeps the old lm_head of such a model (output "
                f"would not match the weights): start the server with --worker-extension-cls "
                f"{WORKER_EXTENSION} (rollstream installed beside vLLM)"
            )
        if tied is None:
            self._warn_once(
                "tied",
                f"openai engine: cannot read the weights at {path!r} here to tell whether the model "
                f"ties lm_head to the embeddings; if it does, vLLM's reload_weights on {server.name} "
                f"keeps the old lm_head — start the server with --worker-extension-cls {WORKER_EXTENSION}",
            )
        await self._request(
            server, "POST", RPC, {"method": "reload_weights", "kwargs": {"weights_path": target}}
        )

    async def _abort_on(self, server: _Server, call: _Call) -> bool | None:
        if server.paths is None or not call.abort_ids:
            return None  # the request is not on its way yet
        paths = server.paths
        endpoint = TOKENS_ABORT if TOKENS_ABORT in paths else DEV_ABORT if DEV_ABORT in paths else None
        if endpoint is None:
            return False
        await self._request(
            server, "POST", endpoint, {"request_ids": call.abort_ids}, timeout=self._control_timeout
        )
        return True

    async def _check_can_pause(self, server: _Server) -> None:
        if PAUSE not in await self._paths(server, self._CANDIDATES):
            raise EngineError(
                f"partial weight sync needs {PAUSE} on the server; {server.name} has none — use "
                "rollout.on_weight_sync = drain or abort, or start vLLM with VLLM_SERVER_DEV_MODE=1"
            )

    async def _pause_on(self, server: _Server) -> None:
        # keep: running requests stay, with their KV cache, and go on with the new weights
        await self._request(server, "POST", PAUSE, params={"mode": "keep", "clear_cache": "false"})

    async def _resume_on(self, server: _Server) -> None:
        await self._request(server, "POST", RESUME)

    async def _load_on(self, server: _Server, model_step: int, path: str | None) -> None:
        paths = await self._paths(server, self._CANDIDATES)
        version = str(model_step)
        if path is not None:
            target = self._server_path(path)
            if RPC in paths:
                # hold the server still while its weights change, unless a pause already does
                hold = not self.paused and PAUSE in paths
                if hold:
                    await self._pause_on(server)
                try:
                    await self._reload(server, path, target)
                    if WEIGHT_VERSION in paths:
                        await self._request(server, "POST", WEIGHT_VERSION, {"new_version": version})
                finally:
                    if hold:
                        await self._resume_on(server)
                server.step = model_step
                return
            if FROM_DISK in paths:
                reply = await self._request(
                    server, "POST", FROM_DISK, {"model_path": target, "weight_version": version}
                )
                _check_success(reply, server, FROM_DISK)
                server.step = model_step
                return
            raise EngineError(
                f"loading weights needs {RPC} (vLLM started with VLLM_SERVER_DEV_MODE=1) or "
                f"{FROM_DISK} on the server; {server.name} has neither"
            )
        if WEIGHT_VERSION in paths:
            await self._request(server, "POST", WEIGHT_VERSION, {"new_version": version})
        server.step = model_step


def ties_lm_head(path: str) -> bool | None:
    """Whether the model published at ``path`` ties its lm_head to the embeddings and
    its files leave the lm_head out (what save_pretrained does); None when the
    directory cannot be read here. Reads only the config and the safetensors headers."""
    directory = Path(path)
    try:
        config = json.loads((directory / "config.json").read_text())
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            return None
        names: set[str] = set()
        for file in files:
            with file.open("rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                names.update(json.loads(handle.read(size)))
    except (OSError, ValueError):
        return None
    # PretrainedConfig ties by default: a config that does not say is a tied one
    return bool(config.get("tie_word_embeddings", True)) and "lm_head.weight" not in names


def _vllm_sampling(params: SamplingParams) -> dict[str, Any]:
    """vLLM's sampling parameters; non-default ones only, so that other
    OpenAI-compatible servers see no field they might refuse."""
    out: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.stop:
        out["stop"] = list(params.stop)
        out["include_stop_str_in_output"] = True  # as the ids keep the stop token
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        out["ignore_eos"] = True
    if params.seed is not None:
        out["seed"] = params.seed
    return out


def _choices(reply: Any, server: _Server, path: str, n: int) -> list[dict[str, Any]]:
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices):
        raise EngineError(f"{server.name}{path} returned {_describe(reply)}, not {n} choices")
    return sorted(choices, key=lambda c: c.get("index", 0))


def openai_from_settings(settings: EngineSettings) -> OpenAIEngine:
    """The engine of ``engines.kind = "openai"``."""
    return OpenAIEngine(settings.openai)
