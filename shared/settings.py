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
shared/settings_errors.py writes those lines.

Each plug-in family owns its settings model beside this module, and the tree here
composes them: the engines' in shared/engine_settings.py, the trainer-side
algorithm's in shared/algorithm_settings.py, the weight transports' in
shared/transports.py. Each of their names is imported from its own module.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.exceptions import SettingsError as PydanticSettingsError

from rollstream.shared import redisurl
from rollstream.shared.algorithm_settings import AlgorithmSettings
from rollstream.shared.engine_settings import EngineSettings
from rollstream.shared.errors import SettingsError
from rollstream.shared.settings_errors import (
    CONFIG_ENV,
    ENV_PREFIX,
    Sources,
    check_env,
    config_path,
    describe,
    read_toml,
)
from rollstream.shared.transports import TransportSettings

# Names end up inside Redis keys and SCAN patterns: no braces, colons or glob characters.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)
REDIS_SCHEMES = ("redis", "rediss", "unix")
# Redis numbers its databases from 0 and allows at most INT_MAX of them (16 by default).
_MAX_DB = 2**31 - 2


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
    # and commit return only once N replicas have them (WAIT). Safe by default where there
    # is a failover: 1 with a redis+sentinel:// URL (_default_wait_replicas), else 0.
    wait_replicas: int = Field(
        default=0,
        ge=0,
        le=64,
        description=(
            "replicas that must hold a trainer's reads and commit (WAIT); 0: none. "
            "Default: 1 with a redis+sentinel:// URL, else 0"
        ),
    )
    wait_timeout_ms: int = Field(
        default=1_000,
        ge=1,
        description="how long one WAIT for redis.wait_replicas waits (retried until redis.outage_limit_s)",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_wait_replicas(cls, data: Any) -> Any:
        """redis.wait_replicas not set: 1 where Sentinels fail the primary over (a failover
        otherwise loses the trainer's last commits, and groups are trained twice: README
        "Redis high availability"), 0 elsewhere. Set it to 0 to run without, on purpose."""
        if isinstance(data, dict) and "wait_replicas" not in data:
            url = data.get("url")
            if isinstance(url, str) and redisurl.scheme_of(url) in redisurl.SENTINELS:
                return {**data, "wait_replicas": 1}
        return data

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
    # Caps (XADD MAXLEN ~) of the run's dead-letter and filtered streams: readers must not
    # rely on entries older than the cap (docs/stream-format.md); a dead group keeps its payload.
    dead_maxlen: int = Field(default=10_000, ge=1, description="dead letters kept (MAXLEN ~)")
    filtered_maxlen: int = Field(default=100_000, ge=1, description="filtered records kept (MAXLEN ~)")


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
    idle_poll_max_s: float = Field(
        default=1.0, ge=0.05, description="longest wait between empty looks for work (0.05 s, doubling)"
    )
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

    @model_validator(mode="after")
    def _adapters_reach_the_engines(self) -> Settings:
        kind = self.engines.kind
        if self.algorithm.lora_rank and kind not in ("hf", "vllm", "sim"):
            raise ValueError(
                f"algorithm.lora_rank is {self.algorithm.lora_rank}: weight syncs then carry a LoRA adapter "
                f"only, which hf and vllm engines merge; engines.kind {kind!r} cannot take it yet: use "
                "engines.kind 'hf' or 'vllm', or lora_rank 0 (full weights)"
            )
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
        # The file is read by read_toml rather than TomlConfigSettingsSource, so that a broken
        # file is one SettingsError line (file:line) even for a Settings() built directly.
        toml_data = read_toml(config_path())[0]
        return (init_settings, env_settings, InitSettingsSource(settings_cls, toml_data))


def load_settings(**overrides: Any) -> Settings:
    """Build the settings, or raise SettingsError naming every problem, one line each."""
    config = os.environ.get(CONFIG_ENV)
    if config and not Path(config).is_file():
        raise SettingsError(f"{CONFIG_ENV} names {config!r}, which is not a file")
    # pydantic-settings matches variable names case-insensitively: so does the check.
    names = {name.upper(): name for name in os.environ if name.upper().startswith(ENV_PREFIX)}
    env = {upper: os.environ[name] for upper, name in names.items()}
    problems = check_env(Settings, env, names)
    reported = {upper for _, upper in problems}
    path = config_path()
    try:
        toml = read_toml(path)
    except SettingsError as exc:
        raise SettingsError("\n".join([*(line for line, _ in problems), str(exc)])) from None
    lines = [line for line, _ in problems]
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        sources = Sources(overrides, env, path, toml)
        for error in exc.errors():
            line, where = describe(Settings, error, sources)
            if where not in reported:  # an unknown variable is already named above
                lines.append(line)
    except PydanticSettingsError as exc:  # a section or list variable that is not JSON
        if not lines:  # check_env names these; this is a fallback
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
