"""Every Redis key, stream, consumer-group and hash-field name of rollstream, but the
fields of a coordinator batch's hash, which consumer/coordinator.py alone reads and
writes (stream entries' fields are the codec's).

Nothing else spells a key (tests/unit/test_names.py checks). All keys of one
run share the hash tag ``{run}`` so that they land on one Redis Cluster slot
and one Lua script may touch several of them.

    rs:{run}:evals:{task}     stream  eval prompts: first      group "producers"
    rs:{run}:prompts:{task}   stream  fresh prompts            group "producers"
    rs:{run}:aborted:{task}   stream  interrupted groups       group "producers"
    rs:{run}:expired:{task}   stream  expired prompts          group "producers"
    rs:{run}:groups:{task}    stream  the replay buffer        group "trainer"
    rs:{run}:eval:{batch}     stream  eval results of one eval batch
    rs:{run}:batch:{batch}    hash    a coordinator batch: status, kind, counts, result
    rs:{run}:batch:{batch}:fed:{task}  set  uids fed by the batch (idempotence); gone when it ends
    rs:{run}:adapter:{name}   hash    an outside trainer's adapter (consumer/integrations): its
                                      batch in flight, the step its weights were last published for
    rs:{run}:events           stream  weight-sync and control events
    rs:{run}:dead             stream  dead letters
    rs:{run}:filtered         stream  one small record per group the filter dropped (its uid)
    rs:{run}:trained:{task}   stream  a small entry per group the trainer committed, for the
                                      archiver (group "archive"); capped; archive.keep > 0 only
    rs:{run}:state            hash    model_step, train_step, settings, ray_address, paused,
                                      format, run_id, lost, producer:{name} heartbeats,
                                      feeder:{task}:cursor
    rs:{run}:alive:{role}:{name}  string  a process's heartbeat JSON; expires by itself
    rs:{run}:rq:*             rq's keys: the judge queue, its jobs, registries and workers
    rs:{run}:progress         hash    cumulative counts per task: {task}:{counter}
    rs:{run}:metrics          stream  per-step metrics, capped
    rs:{run}:fed:{task}       set     uids fed by one-shot feeds (idempotence)
    rs:{run}:fence:{kind}:{task}  counter  bumped when entries of a stream change owner
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from rollstream.shared.settings import validate_name

PREFIX = "rs"

# Consumer groups
PRODUCERS = "producers"
TRAINER = "trainer"
# The consumer name of the bundled trainer unless it is given one: stable, so that a
# restarted trainer re-reads its own pending groups.
TRAINER_CONSUMER = "trainer"
# The archiver's consumer group, on the trained log, the dead letters and the filtered records
ARCHIVE = "archive"

# Kinds of per-task streams, rs:{run}:{kind}:{task}
EVALS = "evals"  # eval prompts: claimed before any training work, outside the admission bound
PROMPTS = "prompts"  # fresh prompts
ABORTED = "aborted"  # groups interrupted by a weight sync or pause, with any samples kept
EXPIRED = "expired"  # the prompts of groups too stale to train on
GROUPS = "groups"  # the replay buffer
# The pools producers claim from, in claim order (the expired pool only when asked).
POOLS = (ABORTED, EXPIRED, PROMPTS)
STREAM_KINDS = (EVALS, *POOLS, GROUPS)
GROUP_OF_KIND = {
    EVALS: PRODUCERS, PROMPTS: PRODUCERS, ABORTED: PRODUCERS, EXPIRED: PRODUCERS, GROUPS: TRAINER,
}  # fmt: skip

# Fields of rs:{run}:state
MODEL_STEP = "model_step"
TRAIN_STEP = "train_step"
FORMAT = "format"  # the stream-format version the run was written in (docs/stream-format.md)
RUN_SETTINGS = "settings"  # the settings every process of the run must share (JSON)
RAY_ADDRESS = "ray_address"  # the Ray cluster the run's engines live on
PAUSED = "paused"  # "1" while the run is paused
STOPPED = "stopped"  # when the run's stop event was published (epoch seconds): the run is over
REPLICATED = "replicated"  # a counter the trainer bumps before each WAIT (redis.wait_replicas)
PRODUCER_BEAT = "producer:"  # + a producer's name: its heartbeat JSON (model_step, inflight, ts)
RUN_ID = "run_id"  # the run's identity, made once by its first process: a Redis that lost it shows
RUN_LOST = "lost"  # set by the process that found the run's data gone: what was lost (JSON)
REWOUND = "rewound"  # set by the trainer that found committed steps gone (shared/rewind.py): JSON


class Count(StrEnum):
    """The cumulative counters of rs:{run}:progress, one field ``{task}:{counter}`` per
    task (:func:`progress_field`). Each is incremented in the same script or transaction
    that moves the entries it counts, so counters and streams never disagree."""

    FED = "fed"
    """Prompts appended by a feed (a uid already fed is not)."""
    COMPLETED = "completed"
    """Completed groups appended to the groups stream."""
    PRODUCED_SAMPLES = "produced_samples"
    """Samples of those groups (n each)."""
    PRODUCED_TOKENS = "produced_tokens"
    """Response tokens of those groups."""
    REWARD_COUNT = "reward_count"
    """Samples of those groups with a score."""
    REWARD_SUM = "reward_sum"
    """The sum of those scores: the one counter that is not an integer (HINCRBYFLOAT)."""
    EVAL_COMPLETED = "eval_completed"
    """Eval results appended to their eval batch's stream."""
    ABORTED = "aborted"
    """Claims sent back to the aborted (or eval) pool."""
    FILTERED = "filtered"
    """Groups the producer's filter rejected: dropped."""
    DEAD = "dead"
    """Entries moved to the dead letters, from any stream."""
    GROUPS_DEAD = "groups_dead"
    """Of those, the groups dead-lettered from the groups stream."""
    CONSUMED = "consumed"
    """Groups a trainer committed (acked and deleted) after their train step."""
    EXPIRED = "expired"
    """Groups too stale to train on whose prompts went to the expired pool."""
    EXPIRED_DROPPED = "expired_dropped"
    """Groups too stale to train on, dropped (tail_batch_trigger_size -1)."""
    ABORTED_DROPPED = "aborted_dropped"
    """Late results of a coordinator batch already finished, discarded."""
    REMOVED = "removed"
    """Unclaimed prompts of a coordinator batch deleted when it finished."""


# Groups that left the groups stream without being trained: subtracted from `completed`
# wherever producers count the groups that can still be trained (admission). A group
# dead-lettered or dropped there must not keep a producer's place for ever.
UNTRAINABLE = (Count.EXPIRED, Count.EXPIRED_DROPPED, Count.ABORTED_DROPPED, Count.GROUPS_DEAD)
# Prompts that left the pipeline on purpose without a result (`rollstream status`)
DROPPED = (Count.EXPIRED_DROPPED, Count.ABORTED_DROPPED, Count.REMOVED)


class Role(StrEnum):
    """Roles of processes in liveness keys and `rollstream status`."""

    ENGINES = "engines"
    PRODUCER = "producer"
    TRAINER = "trainer"
    FEEDER = "feeder"
    JUDGE = "judge"
    METRICS = "metrics"
    ARCHIVER = "archiver"


ROLES = tuple(Role)


def progress_field(task: str, counter: Count) -> str:
    """A cumulative counter in rs:{run}:progress, e.g. ``math:completed``."""
    try:
        name = Count(counter).value
    except ValueError:
        raise ValueError(f"unknown progress counter {counter!r}; known: {', '.join(Count)}") from None
    return f"{task}:{name}"


def feeder_cursor_field(task: str) -> str:
    """The feeder cursor of a task in rs:{run}:state, e.g. ``feeder:math:cursor``."""
    return f"feeder:{task}:cursor"


def feeder_write_field(task: str) -> str:
    """The token of the feeder's last cursor write in rs:{run}:state and the prompts it
    appended (``<token> <count>``), e.g. ``feeder:math:write``: a write sent again after
    its reply was lost is told from another feeder's by it."""
    return f"feeder:{task}:write"


def producer_beat_field(producer: str) -> str:
    """A producer's heartbeat in rs:{run}:state, e.g. ``producer:producer-host-42``."""
    return PRODUCER_BEAT + producer


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
        return self.stream(PROMPTS, task)

    def aborted(self, task: str) -> str:
        return self.stream(ABORTED, task)

    def expired(self, task: str) -> str:
        return self.stream(EXPIRED, task)

    def groups(self, task: str) -> str:
        return self.stream(GROUPS, task)

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

    def batch_fed(self, batch: str, task: str) -> str:
        """The uids a coordinator batch fed (rs:{run}:fed:{task} is for one-shot feeds
        and never shrinks): deleted when the batch ends."""
        return f"{self.batch(batch)}:fed:{validate_name(task, 'task name')}"

    def eval(self, batch: str) -> str:
        return f"{self.base}:eval:{validate_name(batch, 'batch id')}"

    def adapter(self, name: str) -> str:
        """The record of an outside trainer's adapter named ``name`` (consumer/integrations):
        what its restart needs to find again (the batch in flight, the trainer step of the
        weights it last published)."""
        return f"{self.base}:adapter:{validate_name(name, 'adapter name')}"

    @property
    def events(self) -> str:
        return f"{self.base}:events"

    @property
    def dead(self) -> str:
        return f"{self.base}:dead"

    @property
    def filtered(self) -> str:
        return f"{self.base}:filtered"

    def trained(self, task: str) -> str:
        """The trained log of a task: an entry per group the trainer committed (its id in
        the groups stream, the train step), for the archiver; capped at archive.keep."""
        return f"{self.base}:trained:{validate_name(task, 'task name')}"

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
