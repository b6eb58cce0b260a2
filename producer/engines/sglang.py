"""The ``sglang`` engine: SGLang's native API.

It sends the n samples as a batch of n identical prompts (SGLang's advice for n > 1,
and it gives each sample a request id of ours to abort it by), reads the logprobs from
``meta_info``, and controls the server with ``/abort_request``, ``/pause_generation``
(mode "retract": running requests keep their tokens and go back to the queue, their KV
cache is recomputed with the new weights), ``/update_weights_from_disk`` and
``/continue_generation``. What every HTTP engine shares is in http.py (servers,
take-outs, aborts) and http_client.py (the requests themselves).
"""

from __future__ import annotations

from typing import Any

from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_STOP,
    EngineError,
    Generation,
    SamplingParams,
)
from rollstream.producer.engines.http import HTTPEngine
from rollstream.producer.engines.http_client import (
    FROM_DISK,
    _Call,
    _check_success,
    _describe,
    _generation,
    _Server,
)
from rollstream.shared.engine_settings import EngineSettings


class SGLangEngine(HTTPEngine):
    """SGLang's native API: /generate with input_ids, logprobs from meta_info."""

    kind = "sglang"
    alive_path = "/get_model_info"
    # retract: running requests keep their tokens and wait in the queue; their KV cache
    # is recomputed with the new weights on continue (in_place would keep stale KV and
    # forbid the cache flush that the weight load does)
    pause_mode = "retract"

    async def _generate_on(
        self,
        server: _Server,
        call: _Call,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        start_step: int,
    ) -> list[Generation]:
        rids = [f"{call.server_id}-{i}" for i in range(n)]
        sampling = []
        for i in range(n):
            one: dict[str, Any] = {
                "max_new_tokens": params.max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "ignore_eos": params.ignore_eos,
                "skip_special_tokens": True,
                "no_stop_trim": True,  # the text keeps its stop string, as the ids keep the stop token
            }
            if params.stop:
                one["stop"] = list(params.stop)
            if params.stop_token_ids:
                one["stop_token_ids"] = list(params.stop_token_ids)
            if params.seed is not None:
                one["sampling_seed"] = params.seed + i  # one seed for all would make n equal samples
            sampling.append(one)
        body = {
            "input_ids": [prompt_ids] * n,  # SGLang's advice for n > 1: the same prompt n times
            "rid": rids,
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        call.abort_ids = rids
        reply = await self._request(server, "POST", "/generate", body, call=call)
        if isinstance(reply, dict):
            reply = [reply]
        if not isinstance(reply, list) or len(reply) != n:
            raise EngineError(
                f"sglang engine: {server.name}/generate returned {_describe(reply)} for a batch of {n}"
            )
        out = []
        for item in reply:
            meta = item.get("meta_info") or {}
            pairs = meta.get("output_token_logprobs") or []
            ids = item.get("output_ids")
            if ids is None:
                ids = [pair[1] for pair in pairs]
            logprobs = [pair[0] for pair in pairs]
            reason = meta.get("finish_reason")
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind is None:
                kind = FINISH_ABORT if call.aborted else FINISH_STOP
            versions = self._versions(meta.get("weight_versions"), len(ids), start_step)
            out.append(_generation(server, "/generate", ids, logprobs, versions, kind, item))
        return out

    async def _abort_on(self, server: _Server, call: _Call) -> bool | None:
        if not call.abort_ids:
            return None
        for rid in call.abort_ids:
            await self._request(server, "POST", "/abort_request", {"rid": rid}, timeout=self._control_timeout)
        return True

    async def _check_can_pause(self, server: _Server) -> None:
        return None  # the native API always has it

    async def _pause_on(self, server: _Server) -> None:
        await self._request(server, "POST", "/pause_generation", {"mode": self.pause_mode})

    async def _resume_on(self, server: _Server) -> None:
        await self._request(server, "POST", "/continue_generation", {})

    async def _load_on(self, server: _Server, model_step: int, path: str | None) -> None:
        version = str(model_step)
        if path is None:
            # abort_all_requests defaults to true there: the running requests stay
            body = {"new_version": version, "abort_all_requests": False}
            await self._request(server, "POST", "/update_weight_version", body)
        else:
            body = {"model_path": self._server_path(path), "weight_version": version}
            _check_success(await self._request(server, "POST", FROM_DISK, body), server, FROM_DISK)
        server.step = model_step


def sglang_from_settings(settings: EngineSettings) -> SGLangEngine:
    """The engine of ``engines.kind = "sglang"``."""
    return SGLangEngine(settings.sglang)
