"""Every Redis key, stream, consumer-group and hash-field name of rollstream.

Nothing else spells a key. All keys of one run share the hash tag ``{run}``
so that they land on one Redis Cluster slot and one Lua script may touch
several of them.

    rs:{run}:evals:{task}     stream  eval prompts: first      group "producers"
    rs:{run}:prompts:{task}   stream  fresh prompts            group "producers"
    rs:{run}:aborted:{task}   stream  interrupted groups       group "producers"
    rs:{run}:expired:{task}   stream  expired prompts          group "producers"
    rs:{run}:groups:{task}    stream  the replay buffer        group "trainer"
    rs:{run}:eval:{batch}     stream  eval results of one eval batch
    rs:{run}:batch:{batch}    hash    a coordinator batch: status, kind, counts, result
    rs:{run}:events           stream  weight-sync and control events
    rs:{run}:dead             stream  dead letters
    rs:{run}:state            hash    model_step, train_step, feeder cursors, settings,
                                      ray_address, paused, format
    rs:{run}:alive:{role}:{name}  string  a process's heartbeat JSON; expires by itself
    rs:{run}:rq:*             rq's keys: the judge queue, its jobs, registries and workers
    rs:{run}:progress         hash    cumulative counts per task
    rs:{run}:metrics          stream  per-step metrics, capped
    rs:{run}:fed:{task}       set     uids fed by one-shot feeds (idempotence)
    rs:{run}:fence:{kind}:{task}  counter  bumped when entries of a stream change owner
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.settings import validate_name

PREFIX = "rs"

PRODUCERS = "producers"
TRAINER = "trainer"

# The pools producers claim from, in claim order (the expired pool only when asked).
POOLS = ("aborted", "expired", "prompts")
# Eval prompts are claimed before any training work and stay outside the admission bound.
EVALS = "evals"
STREAM_KINDS = (EVALS, *POOLS, "groups")
GROUP_OF_KIND = {
    EVALS: PRODUCERS, "prompts": PRODUCERS, "aborted": PRODUCERS, "expired": PRODUCERS, "groups": TRAINER,
}  # fmt: skip

# Fields of rs:{run}:state
MODEL_STEP = "model_step"
TRAIN_STEP = "train_step"
FORMAT = "format"  # the stream-format version the run was written in (docs/stream-format.md)
RUN_SETTINGS = "settings"  # the settings every process of the run must share (JSON)
RAY_ADDRESS = "ray_address"  # the Ray cluster the run's engines live on
PAUSED = "paused"  # "1" while the run is paused

# Counters of groups that left the groups stream without being trained: subtracted from
# `completed` wherever producers count the groups that can still be trained (admission).
# A group dead-lettered or dropped there must not keep a producer's place for ever.
UNTRAINABLE = ("expired", "expired_dropped", "aborted_dropped", "groups_dead")

# Roles of processes in liveness keys and `rollstream status`
ROLES = ("engines", "producer", "trainer", "feeder", "judge")


def progress_field(task: str, counter: str) -> str:
    """A cumulative counter in rs:{run}:progress, e.g. ``math:completed``."""
    return f"{task}:{counter}"


def feeder_field(task: str, item: str) -> str:
    """A feeder cursor item in rs:{run}:state, e.g. ``feeder:math:epoch``."""
    return f"feeder:{task}:{item}"


@dataclass(frozen=True, slots=True)
class Keys:
    """The keys of one run."""

    run: str

    def __post_init__(self) -> None:
        validate_name(self.run, "run name")

    @property
    def base(self) -> str:
        return f"{PREFIX}:{{{self.run}}}"

    def stream(self, kind: str, task: str) -> str:
        if kind not in STREAM_KINDS:
            raise ValueError(f"unknown stream kind {kind!r}; known: {', '.join(STREAM_KINDS)}")
        return f"{self.base}:{kind}:{validate_name(task, 'task name')}"

    def prompts(self, task: str) -> str:
        return self.stream("prompts", task)

    def aborted(self, task: str) -> str:
        return self.stream("aborted", task)

    def expired(self, task: str) -> str:
        return self.stream("expired", task)

    def groups(self, task: str) -> str:
        return self.stream("groups", task)

    def fed(self, task: str) -> str:
        return f"{self.base}:fed:{validate_name(task, 'task name')}"

    def fence(self, stream: str) -> str:
        """The counter that a settle of ``stream``'s entries WATCHes: reclaims bump it."""
        parsed = self.parse_stream(stream)
        if parsed is None:
            raise ValueError(f"{stream!r} is not a per-task stream of run {self.run!r}")
        kind, task = parsed
        return f"{self.base}:fence:{kind}:{task}"

    def evals(self, task: str) -> str:
        return self.stream(EVALS, task)

    def batch(self, batch: str) -> str:
        return f"{self.base}:batch:{validate_name(batch, 'batch id')}"

    def eval(self, batch: str) -> str:
        return f"{self.base}:eval:{validate_name(batch, 'batch id')}"

    @property
    def events(self) -> str:
        return f"{self.base}:events"

    @property
    def dead(self) -> str:
        return f"{self.base}:dead"

    @property
    def state(self) -> str:
        return f"{self.base}:state"

    @property
    def progress(self) -> str:
        return f"{self.base}:progress"

    @property
    def metrics(self) -> str:
        return f"{self.base}:metrics"

    def alive(self, role: str, name: str) -> str:
        """The heartbeat key of one process; it expires unless the process renews it."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
        return f"{self.base}:alive:{role}:{name}"

    @property
    def rq_prefix(self) -> str:
        """rq's key prefix for this run (rq reads RQ_KEY_PREFIX when it is imported): the
        judge queue, its jobs and workers live under the run's prefix and hash slot."""
        return f"{self.base}:rq"

    @property
    def alive_pattern(self) -> str:
        return f"{self.base}:alive:*"

    @property
    def pattern(self) -> str:
        """SCAN pattern matching every key of the run."""
        return f"{self.base}:*"

    def parse_stream(self, key: str) -> tuple[str, str] | None:
        """(kind, task) for a per-task stream key of this run, else None."""
        head = f"{self.base}:"
        if not key.startswith(head):
            return None
        kind, _, task = key[len(head) :].partition(":")
        if kind not in STREAM_KINDS or not task:
            return None
        return kind, task
