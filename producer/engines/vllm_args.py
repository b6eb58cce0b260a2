"""What the vLLM engine (producer/engines/vllm.py) hands vLLM and reads back from it,
apart from the engine's life (requests, pauses, weight updates, death, trust):

- the engine arguments made of ``engines.vllm`` (``extra_args`` last, so they win) and
  the defaults of vLLM's environment, each left alone when the user set it;
- the worker extension that reloads published weights in place (producer/engines/
  vllm_worker.py) and the method the engine calls on it;
- a request's sampling parameters: n samples, each sampled token's raw logprob, one
  output per request;
- each sampled token's logprob out of vLLM's outputs, in either of its layouts;
- the stat logger that keeps the scheduler's counts of running and waiting sequences.

vLLM is imported inside the functions that need it, so importing this imports no vLLM.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rollstream.producer.engines.base import SamplingParams
from rollstream.shared.engine_settings import VLLMEngineSettings
from rollstream.shared.records import LOGPROB_DTYPE

__all__ = [
    "RELOAD_METHOD",
    "WORKER_EXTENSION",
    "engine_args",
    "environment",
    "sampled_logprobs",
    "sampling_params",
    "stat_logger",
]

WORKER_EXTENSION = "rollstream.producer.engines.vllm_worker.WeightReloader"
RELOAD_METHOD = "rollstream_reload_weights"


def engine_args(settings: VLLMEngineSettings) -> dict[str, Any]:
    """vLLM's engine arguments from the settings; ``extra_args`` last, so they win."""
    args: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        "enforce_eager": settings.enforce_eager,
        "seed": settings.seed,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if settings.max_model_len:
        args["max_model_len"] = settings.max_model_len
    if settings.kv_cache_memory_bytes:
        args["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    args.update(settings.extra_args)
    return args


def environment(args: dict[str, Any]) -> None:
    """Defaults for vLLM's environment, each left alone when the user set it. vLLM
    reads them when the engine starts, and its processes inherit them."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage reports from every actor
    if args.get("distributed_executor_backend") != "ray":
        # An engine on one machine talks to its own processes: on loopback. Otherwise
        # vLLM binds its internal queues to the machine's outward address (found by
        # routing towards a public IP), which a machine without a route lacks.
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def sampling_params(params: SamplingParams, n: int, max_tokens: int) -> Any:
    """vLLM's sampling parameters of a request for ``n`` samples of up to ``max_tokens``."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VLLMSamplingParams

    return VLLMSamplingParams(
        n=n,
        max_tokens=max(max_tokens, 0),
        temperature=params.temperature,
        top_p=params.top_p,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos,
        seed=params.seed,
        logprobs=0,  # the sampled token's own logprob, raw (before temperature)
        include_stop_str_in_output=True,  # like EOS: ids and text keep what stopped them
        output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, aborts included
    )


def sampled_logprobs(logprobs: Any, token_ids: Any) -> np.ndarray:
    """The logprob of each sampled token: vLLM gives one entry per position (logprobs=0),
    as dicts token -> Logprob, or flattened (FlatLogprobs) in newer versions."""
    if logprobs is None:
        return np.zeros(len(token_ids), dtype=LOGPROB_DTYPE)
    flat = getattr(logprobs, "logprobs", None)
    starts = getattr(logprobs, "start_indices", None)
    if flat is not None and starts is not None:
        return np.asarray([flat[s] for s in starts], dtype=LOGPROB_DTYPE)
    return np.asarray(
        [position[t].logprob for position, t in zip(logprobs, token_ids, strict=True)], LOGPROB_DTYPE
    )


def stat_logger(sink: dict[str, int]) -> Any:
    """A vLLM stat logger (per-engine factory) that keeps the scheduler's latest counts
    of running and waiting sequences in ``sink``: cheap, they come with every step."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Counts(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                sink["running"] = int(getattr(scheduler_stats, "num_running_reqs", 0))
                sink["waiting"] = int(getattr(scheduler_stats, "num_waiting_reqs", 0))

        def log_engine_initialized(self) -> None:
            pass

    return Counts
