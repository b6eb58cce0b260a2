"""The one settings tree of rollstream.

Sources, highest priority first: keyword arguments, environment variables
(``ROLLSTREAM_`` prefix, ``__`` between levels: ``ROLLSTREAM_REDIS__URL``),
then ``rollstream.toml`` in the working directory (or the file that
``ROLLSTREAM_CONFIG`` names), then the defaults below.

An invalid value fails in :func:`load_settings` with a :class:`SettingsError`
that names the setting, both as a dotted path and as its environment
variable, and what is allowed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings.exceptions import SettingsError as PydanticSettingsError

from shared.errors import SettingsError

ENV_PREFIX = "ROLLSTREAM_"
CONFIG_ENV = "ROLLSTREAM_CONFIG"
DEFAULT_CONFIG_FILE = "rollstream.toml"

# Names end up inside Redis keys and SCAN patterns: no braces, colons or glob characters.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)
REDIS_SCHEMES = ("redis", "rediss", "unix")


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (user names are kept)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


class RedisSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="redis://[user:password@]host:port/db, rediss:// for TLS, or unix:///path",
    )
    socket_timeout_s: float = Field(default=30.0, gt=0)
    outage_limit_s: float = Field(
        default=120.0, ge=0, description="how long a process retries through a Redis outage; 0: not at all"
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in REDIS_SCHEMES:
            raise ValueError(f"the scheme must be one of {', '.join(REDIS_SCHEMES)}")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("a host is required, as in redis://host:6379/0")
        try:
            parts.port  # noqa: B018 - urlsplit parses the port lazily and raises here
        except ValueError as exc:
            raise ValueError(f"invalid port: {exc}") from None
        return value


class TaskSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="letters, digits, '_', '.', '-'")
    weight: float = Field(default=1.0, gt=0, description="share of each batch")
    n: int = Field(default=8, ge=1, le=4096, description="responses per prompt (group size)")


class BufferSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    claim_idle_ms: int = Field(default=60_000, ge=1, description="idle time before reclaim")
    max_attempts: int = Field(default=3, ge=1, le=1000, description="deliveries before dead-letter")
    read_count: int = Field(default=64, ge=1, le=10_000, description="entries per XREADGROUP")
    block_ms: int = Field(default=1_000, ge=0, description="longest wait of one blocking read")


class SimEngineSettings(BaseModel):
    """The simulated engine: a continuous-batching GPU server's timing, without a GPU."""

    model_config = ConfigDict(extra="forbid")

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
    model_config = ConfigDict(extra="forbid")

    model: str = Field(default="", description="directory of a Hugging Face model (config, safetensors)")
    device: str = Field(default="cpu", description="torch device: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["sim", "hf"] = "sim"
    count: int = Field(default=1, ge=1, le=4096, description="engine actors to start")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs per engine actor")
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs per engine actor")
    max_restarts: int = Field(default=3, ge=-1, description="restarts of a dead actor (-1: forever)")
    sim: SimEngineSettings = Field(default_factory=SimEngineSettings)
    hf: HFEngineSettings = Field(default_factory=HFEngineSettings)


class RolloutSettings(BaseModel):
    """What producers and trainer agree on: batches, staleness, weight syncs."""

    model_config = ConfigDict(extra="forbid")

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
    model_config = ConfigDict(extra="forbid")

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
    heartbeat_s: float = Field(default=2.0, gt=0)
    sync_timeout_s: float = Field(default=30.0, gt=0, description="wait for engines to confirm a weight sync")


class RaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str = Field(
        default="",
        description=(
            "host:port of the run's Ray cluster; empty: `engines` starts a local one and records "
            "its address in the run's state, where producers find it"
        ),
    )


class ProcessSettings(BaseModel):
    """How every process of a run waits, reports and stops."""

    model_config = ConfigDict(extra="forbid")

    wait_timeout_s: float = Field(
        default=600.0, ge=0, description="longest wait for Redis, engines or a Ray address; 0 = forever"
    )
    liveness_ttl_s: float = Field(default=10.0, gt=0, description="a silent process drops out after this")
    progress_s: float = Field(default=5.0, gt=0, description="seconds between progress log lines")
    stop_timeout_s: float = Field(default=10.0, gt=0, description="longest clean stop after SIGTERM")


class LogSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = Field(default="text", description="json: one object per line")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
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

    @model_validator(mode="after")
    def _unique_tasks(self) -> Settings:
        names = [t.name for t in self.tasks]
        if not names:
            raise ValueError("tasks: at least one task is required")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tasks: names must be unique, repeated: {', '.join(dupes)}")
        return self

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
        toml_path = Path(os.environ.get(CONFIG_ENV, DEFAULT_CONFIG_FILE))
        return (
            init_settings,
            env_settings,
            TomlConfigSettingsSource(settings_cls, toml_file=toml_path),
        )


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _describe(error: dict[str, Any]) -> str:
    loc = [str(p) for p in error["loc"]]
    dotted = ".".join(loc) or "settings"
    # List items (tasks.0.n) have no variable of their own: the list is one JSON variable.
    head = loc[: next((i for i, p in enumerate(loc) if p.isdigit()), len(loc))]
    env = ENV_PREFIX + "__".join(p.upper() for p in head)
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        message = f"must be {_BOUNDS[kind]} {bound}"
    elif kind == "string_pattern_mismatch":
        message = f"must match the pattern {ctx.get('pattern')} (letters, digits, '_', '.', '-')"
    elif kind == "extra_forbidden":
        message = "is not a setting"
    else:
        message = str(error["msg"]).removeprefix("Value error, ")
    value = error.get("input")
    shown = "" if isinstance(value, dict | list) or kind == "missing" else f", got {value!r}"
    return f"invalid setting {dotted} ({env}): {message}{shown}"


def load_settings(**overrides: Any) -> Settings:
    """Build the settings, or raise SettingsError naming every invalid field."""
    config = os.environ.get(CONFIG_ENV)
    if config and not Path(config).is_file():
        raise SettingsError(f"{CONFIG_ENV} names {config!r}, which is not a file")
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError("\n".join(_describe(e) for e in exc.errors())) from None  # type: ignore[arg-type]
    except PydanticSettingsError as exc:  # a value that is not JSON where JSON is expected, a bad file
        found = re.search(r'field "(\w+)" from source "(\w+)"', str(exc))
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        if found is None:
            raise SettingsError(f"{exc}{cause}") from None
        field, source = found.groups()
        where = f"{ENV_PREFIX}{field.upper()}" if source.startswith("Env") else source
        raise SettingsError(f"invalid setting {field} ({where}): not valid JSON{cause}") from None
    return settings


def validate_name(value: str, what: str) -> str:
    """Check a name that ends up inside a key (task, batch id) at the point of use."""
    if not _NAME_RE.match(value):
        raise SettingsError(
            f"invalid {what} {value!r}: use 1-64 of letters, digits, '_', '.', '-' "
            "(starting with a letter or digit)"
        )
    return value
