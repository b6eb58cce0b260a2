"""The batch coordinator, for trainers that think in batches (Trinity-RFT's
RolloutCoordinator over rollstream's streams).

    submit_batch(batch_id, prompts, kind="train"|"eval", min_wait_num=None)
    finalize_train_batch(batch_id, timeout=None) / finalize_eval_batch(...)
    abort_batch(batch_id, reason, keep_partial_results=False)
    take_train_batch(batch_id, timeout=None) ... commit_train_batch(batch_id, train_step)

A batch lives in rs:{run}:batch:{id}: PENDING -> RUNNING -> FINALIZING ->
FINALIZED | ABORTED, or FINALIZING -> HANDED -> FINALIZED for a trainer that takes the
groups themselves and commits them after its optimizer step. Its prompts carry the
batch id in their meta and a uid prefixed by it. Train prompts go to the task's prompts
stream and their groups to the replay buffer as usual; eval prompts go to the task's
eval pool, which producers serve first, and their groups to rs:{run}:eval:{id}.

Finalizing moves RUNNING -> FINALIZING in one atomic step, so one caller does
the work; concurrent callers wait for its stored result, and later calls return
it (finalize is idempotent). With a timeout, fewer than min_wait_num results
raise BatchTimeout; at or above it, what finished is returned and the batch's
unclaimed prompts are removed (in-flight ones are discarded when they land).

``finalize_train_batch`` hands the groups over as it returns: acked and deleted, its result
names them. ``take_train_batch`` returns the groups and leaves them pending for this
coordinator's consumer in a HANDED batch; ``commit_train_batch`` acks and deletes them
once the step is done (an outside trainer's rollout function: consumer/integrations/).
A process that dies in between leaves them pending: its restart under the same consumer
name takes the HANDED batch again (its groups re-read from the pending entries), and
aborting it discards them, counted as dropped.

A finished batch submitted again with the same kind and prompts is answered from its
record (nothing fed; finalize returns the stored result); a finished id submitted with
other prompts starts a new batch. The uids a batch fed are kept in its own fed sets
while it runs (a feed sent again adds nothing) and deleted when it ends.

The finalizer holds the batch under a lease (the hash's owner and lease_until,
in Redis server time, so that machines need not agree on the clock) that it
renews while it works. A finalizer that dies stops renewing it: once the lease
has run out, the next finalize call, or one already waiting, takes the batch
over and finishes it (the groups the dead one had read come back to it after
claim_idle_ms). A finalizer that finds its lease gone hands nothing over and
returns the new owner's result. A caller waiting with a timeout raises
BatchTimeout when no result came in time, whoever is finalizing.

A coordinator takes its replay buffer (whose consumer name it reads under) and the run's
task names; ``rollstream.consumer.create_coordinator`` builds one from the settings.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import replace
from enum import StrEnum
from typing import Any

import orjson

from rollstream.consumer.batch_dead import BatchDeadLetters
from rollstream.consumer.metrics import eval_metrics
from rollstream.shared import codec
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import BATCH_META, Batch, BatchItem, default_consumer_name
from rollstream.shared.errors import BatchTimeout, DecodeError, ReplayBufferError
from rollstream.shared.keys import EVALS, GROUP_OF_KIND, POOLS, PROMPTS, Count, progress_field
from rollstream.shared.records import Group, Prompt, Status
from rollstream.shared.settings import validate_name

POLL_S = 0.05
LEASE_S = 10.0  # renewed every third of it; a dead finalizer's batch is taken over once it runs out
ACTIVE = ("pending", "running", "finalizing", "handed")
_DONE = ("finalized", "aborted")
log = logging.getLogger(__name__)

# KEYS: batch hash. ARGV: from status, to status. Returns 1 when it moved the batch.
_TRANSITION = """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
return 1
"""

_NOW_MS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

# KEYS: batch hash. ARGV: owner, lease ms. RUNNING -> FINALIZING under the owner's lease, or
# a FINALIZING batch whose lease ran out taken over. Returns the previous owner ('' when
# the batch was RUNNING), nil when the batch is not the caller's to finalize.
_BEGIN = (
    _NOW_MS
    + """
local status = redis.call('HGET', KEYS[1], 'status')
local previous = ''
if status == 'finalizing' then
    if tonumber(redis.call('HGET', KEYS[1], 'lease_until') or 0) > now then return false end
    previous = redis.call('HGET', KEYS[1], 'owner') or 'unknown'
elseif status ~= 'running' then
    return false
end
redis.call('HSET', KEYS[1], 'status', 'finalizing', 'owner', ARGV[1], 'lease_until', now + tonumber(ARGV[2]))
return previous
"""
)

# KEYS: batch hash. ARGV: owner, lease ms. Returns 0 when the batch is no longer the owner's.
_RENEW = (
    _NOW_MS
    + """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[2]))
return 1
"""
)

# KEYS: batch hash. ARGV: owner, then field, value, ... The owner's last word on its
# finalization (the result, or RUNNING again); returns 0, writing nothing, when the batch
# is no longer the owner's.
_END = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'owner', 'lease_until')
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""


class _LeaseLost(Exception):
    """Another caller took the batch over while this one was finalizing it."""


class BatchStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    FINALIZING = "finalizing"
    HANDED = "handed"  # its groups with a trainer, pending until commit_train_batch
    FINALIZED = "finalized"
    ABORTED = "aborted"


class BatchCoordinator:
    def __init__(self, buffer: ReplayBuffer, tasks: Sequence[str], lease_s: float = LEASE_S) -> None:
        self.client: Any = buffer.client  # replies are bytes (no decode_responses)
        self.buffer = buffer
        self.tasks = tuple(tasks)  # the run's task names: where results and prompts are looked for
        self.keys = self.buffer.keys
        self.lease_s = lease_s
        self._transition = self.client.register_script(_TRANSITION)
        self._begin = self.client.register_script(_BEGIN)
        self._renew_script = self.client.register_script(_RENEW)
        self._end = self.client.register_script(_END)
        self._held: dict[str, list[BatchItem]] = {}  # train groups read for another batch
        self._dead = BatchDeadLetters(self.client, self.keys.dead)  # settled with no result

    # --- the API -----------------------------------------------------------------------

    def submit_batch(
        self, batch_id: str, prompts: list[Prompt], kind: str = "train", min_wait_num: int | None = None
    ) -> int:
        """Feed the batch's prompts; returns how many. An id still active is an error.

        A finished id submitted again with the same kind and prompts (a trainer restarted
        in a step evaluates it again, say) is answered from its record: nothing is fed,
        0 is returned and finalize returns the stored result. With other prompts the id
        starts a new batch."""
        validate_name(batch_id, "batch id")
        if kind not in ("train", "eval"):
            raise ValueError(f"kind must be 'train' or 'eval', not {kind!r}")
        seen: set[tuple[str, str]] = set()
        for p in prompts:
            if (p.task, p.uid) in seen:  # one result per uid: the batch would wait for ever
                raise ValueError(f"batch {batch_id!r}: prompt {p.task}:{p.uid} is given twice")
            seen.add((p.task, p.uid))
        key = self.keys.batch(batch_id)
        signature = _signature(kind, prompts)
        if not self.client.hsetnx(key, "status", BatchStatus.PENDING.value):
            status = self._status(batch_id)
            if status in ACTIVE:
                raise ReplayBufferError(f"batch {batch_id!r} is still {status}: finalize or abort it first")
            if status in _DONE and self.client.hget(key, "prompts") == signature.encode():
                log.info("batch %r was %s already with these prompts: its record answers", batch_id, status)
                return 0
            self.client.delete(key, self.keys.eval(batch_id), *self._fed_sets(batch_id))
            self.client.hset(key, "status", BatchStatus.PENDING.value)
        tagged = [
            replace(p, uid=f"{batch_id}/{p.uid}", meta={**p.meta, BATCH_META: batch_id}) for p in prompts
        ]
        wait = len(tagged) if min_wait_num is None else min_wait_num
        tasks = orjson.dumps(sorted({p.task for p in prompts}))
        mapping = {
            "kind": kind,
            "total": len(tagged),
            "min_wait_num": wait,
            "prompts": signature,
            "tasks": tasks,
        }
        self.client.hset(key, mapping=mapping)
        self._dead.mark(key)
        self.buffer.feed(tagged, pool=EVALS if kind == "eval" else PROMPTS, batch=batch_id)
        self._transition(keys=[key], args=[BatchStatus.PENDING.value, BatchStatus.RUNNING.value])
        return len(tagged)

    def finalize_train_batch(self, batch_id: str, timeout: float | None = None) -> dict[str, Any]:
        return self._finalize(batch_id, "train", timeout)

    def finalize_eval_batch(self, batch_id: str, timeout: float | None = None) -> dict[str, Any]:
        return self._finalize(batch_id, "eval", timeout)

    def take_train_batch(self, batch_id: str, timeout: float | None = None) -> list[Group]:
        """Finalize a train batch without committing it: its groups, in the order of the
        result's ``group_ids``, stay pending for this consumer until ``commit_train_batch``.
        A batch HANDED already (by this process, or by one that died before its commit)
        is taken again: the groups come back from the pending entries. Raises BatchTimeout
        as finalize does, or when handed groups are not back by the deadline (pending for
        another consumer name: back once idle for claim_idle_ms)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        result = self._finalize(batch_id, "train", timeout, hand_over=True)
        if result["status"] != BatchStatus.HANDED:
            raise ReplayBufferError(f"batch {batch_id!r} is {result['status']}: its groups are gone")
        wanted = [str(i) for i in result["group_ids"]]
        while True:
            held = {g.group_id: g for g in self._collect(batch_id, "train")}
            missing = [i for i in wanted if i not in held]
            if not missing:
                return [held[i] for i in wanted]
            if deadline is not None and time.monotonic() >= deadline:
                raise BatchTimeout(
                    f"batch {batch_id!r}: {len(missing)} of its {len(wanted)} handed groups are not "
                    f"back after {timeout} s (pending elsewhere until claim_idle_ms), e.g. {missing[0]}"
                )
            time.sleep(POLL_S)

    def expire_taken(self, batch_id: str, group_ids: Collection[str], train_step: int = -1) -> int:
        """Send groups of a batch taken with ``take_train_batch`` back as too stale to train
        on: each to the expired pool as its prompt (the producers make it again, for this
        batch, under the same group id), acked and deleted here. The next take waits for
        the new groups. Returns how many went."""
        held = self._held.get(batch_id, [])
        stale = [item for item in held if item.group.group_id in group_ids]
        for item in stale:
            self.buffer.expire(item, train_step=train_step)
        self._held[batch_id] = [item for item in held if item not in stale]
        return len(stale)

    def commit_train_batch(self, batch_id: str, train_step: int = -1) -> dict[str, Any]:
        """Ack and delete the groups of a batch taken with ``take_train_batch``, once the
        train step that used them is done; HANDED -> FINALIZED. Returns the result."""
        status = self._status(batch_id)
        if status != BatchStatus.HANDED or batch_id not in self._held:
            raise ReplayBufferError(
                f"batch {batch_id!r} is {status or 'unknown'}, not taken here: nothing to commit"
            )
        held = self._held.pop(batch_id)
        for task in {item.entry.task for item in held}:
            self.buffer.commit(Batch(task, [item for item in held if item.entry.task == task]), train_step)
        result = dict(orjson.loads(self.client.hget(self.keys.batch(batch_id), "result")))
        result["status"] = BatchStatus.FINALIZED.value
        self._store(batch_id, result)
        return result

    def status(self, batch_id: str) -> str | None:
        """The batch's status (a BatchStatus value), None for an unknown id."""
        return self._status(batch_id)

    def submitted_with(self, batch_id: str, prompts: list[Prompt], kind: str = "train") -> bool:
        """Whether the batch was submitted with these prompts (their tasks and uids) and kind."""
        stored = self.client.hget(self.keys.batch(batch_id), "prompts")
        return bool(stored == _signature(kind, prompts).encode())

    def abort_batch(self, batch_id: str, reason: str, keep_partial_results: bool = False) -> dict[str, Any]:
        """Stop a batch: its unclaimed prompts are removed; what finished is returned
        with ``keep_partial_results`` (and committed: the caller trains on it), else
        discarded, counted as dropped. A HANDED batch's groups are discarded too."""
        key = self.keys.batch(batch_id)
        status = self._status(batch_id)
        if status not in (BatchStatus.PENDING, BatchStatus.RUNNING, BatchStatus.HANDED):
            raise ReplayBufferError(f"batch {batch_id!r} is {status or 'unknown'}: nothing to abort")
        self.client.hset(key, mapping={"status": BatchStatus.ABORTED.value, "reason": reason})
        removed = self._remove_unclaimed(batch_id)
        groups = self._collect(batch_id, self._kind(batch_id))
        if not keep_partial_results or status == BatchStatus.HANDED:
            for item in self._held.pop(batch_id, []):  # nobody trains on them
                self.buffer.discard(item, status=Status.ABORTED)
            groups = []
        result = self._result(batch_id, groups, BatchStatus.ABORTED)
        result.update(reason=reason, removed_prompts=removed)
        self._store(batch_id, result)
        self.client.delete(*self._fed_sets(batch_id))
        return result

    # --- the work ----------------------------------------------------------------------

    def _finalize(
        self, batch_id: str, kind: str, timeout: float | None, hand_over: bool = False
    ) -> dict[str, Any]:
        key = self.keys.batch(batch_id)
        if self._kind(batch_id) != kind:
            raise ReplayBufferError(f"batch {batch_id!r} is not a {kind} batch")
        deadline = None if timeout is None else time.monotonic() + timeout
        owner = f"{default_consumer_name(self.buffer.consumer)}-{uuid.uuid4().hex[:8]}"
        while True:
            previous = self._begin(keys=[key], args=[owner, self._lease_ms])
            if previous is not None:
                if previous:
                    log.warning(
                        "batch %r: %s took over from %s, whose lease ran out",
                        batch_id,
                        owner,
                        previous.decode(),
                    )
                try:
                    return self._finalize_as(owner, batch_id, kind, deadline, timeout, hand_over)
                except _LeaseLost:
                    log.warning("batch %r: %s lost its lease; waiting for the new owner", batch_id, owner)
                    continue
            raw = self.client.hget(key, "result")
            if raw is not None:
                return dict(orjson.loads(raw))
            status = self._status(batch_id)
            # RUNNING: a finalizer gave up (BatchTimeout) just now; the next turn takes it on
            if status not in (BatchStatus.RUNNING, BatchStatus.FINALIZING, *_DONE):
                raise ReplayBufferError(f"batch {batch_id!r} is {status or 'unknown'}: nothing to finalize")
            if deadline is not None and time.monotonic() >= deadline:
                holder = self.client.hget(key, "owner")
                raise BatchTimeout(
                    f"batch {batch_id!r}: no result after {timeout} s; "
                    f"{holder.decode() if holder else 'nobody'} is still finalizing it"
                )
            time.sleep(POLL_S)

    def _finalize_as(
        self,
        owner: str,
        batch_id: str,
        kind: str,
        deadline: float | None,
        timeout: float | None,
        hand_over: bool = False,
    ) -> dict[str, Any]:
        """The work of finalizing, under ``owner``'s lease."""
        key = self.keys.batch(batch_id)
        try:
            total = int(self.client.hget(key, "total") or 0)
            wanted = int(self.client.hget(key, "min_wait_num") or total)
            renewed = time.monotonic()
            groups = self._collect(batch_id, kind)
            dead = self._dead.of(batch_id, key)  # settled too: no result will come for them
            while len(groups) + len(dead) < total and (deadline is None or time.monotonic() < deadline):
                time.sleep(POLL_S)
                if time.monotonic() - renewed >= self.lease_s / 3:
                    self._renew(key, owner)
                    renewed = time.monotonic()
                groups, dead = self._collect(batch_id, kind), self._dead.of(batch_id, key)
            if dead:  # no result will come for them: what is waited for is capped by what can come
                log.warning("batch %r: %d of %d prompts dead-lettered", batch_id, len(dead), total)
            if len(groups) < min(wanted, total - len(dead)):
                self._end(keys=[key], args=[owner, "status", BatchStatus.RUNNING.value])  # may try again
                raise BatchTimeout(
                    f"batch {batch_id!r}: {len(groups)} of {total} results after {timeout} s, "
                    f"fewer than min_wait_num {wanted}"
                )
            self._renew(key, owner)  # handing over acks and deletes: never under a lease that ran out
            removed = self._remove_unclaimed(batch_id) if len(groups) < total else 0
            status = BatchStatus.HANDED if hand_over else BatchStatus.FINALIZED
            result = self._result(batch_id, groups, status)
            result["removed_prompts"], result["dead_prompts"] = removed, len(dead)
            self._dead.forget(batch_id)
            stored = self._end(
                keys=[key], args=[owner, "status", result["status"], "result", orjson.dumps(result)]
            )
            if not stored:  # ran out since the renewal, but the groups were handed to this caller
                log.error("batch %r: %s lost its lease while storing the result", batch_id, owner)
            self.client.delete(*self._fed_sets(batch_id))  # fed long since: they go with the batch
            return result
        except _LeaseLost:
            self._held.pop(batch_id, None)  # left pending: the new owner reclaims them
            raise
        except BatchTimeout:
            raise
        except BaseException:
            self._end(keys=[key], args=[owner, "status", BatchStatus.RUNNING.value])
            raise

    @property
    def _lease_ms(self) -> int:
        return max(1, round(self.lease_s * 1000))

    def _renew(self, key: str, owner: str) -> None:
        if not self._renew_script(keys=[key], args=[owner, self._lease_ms]):
            raise _LeaseLost(owner)

    def _eval_results(self, batch_id: str) -> list[Group]:
        """The eval batch's results; one that does not decode goes to the dead letters
        (its stream has no consumer group: it is deleted from there) and is not counted."""
        stream = self.keys.eval(batch_id)
        out = []
        for entry_id, fields in self.client.xrange(stream):
            try:
                out.append(codec.decode_group(fields))
            except DecodeError as exc:
                dead = {**fields, "reason": str(exc), "source": stream}
                cap = self.buffer.buffer_settings.dead_maxlen
                self.client.xadd(self.keys.dead, dead, maxlen=cap, approximate=True)
                self.client.xdel(stream, entry_id)
                log.warning("eval result %s of batch %s dead-lettered: %s", entry_id, batch_id, exc)
        return out

    def _collect(self, batch_id: str, kind: str) -> list[Group]:
        """Every result of the batch so far."""
        if kind == "eval":
            return self._eval_results(batch_id)
        for task in self.tasks:
            batch = self.buffer.read_batch(task, self.buffer.buffer_settings.read_count)
            for item in batch.items:
                owner = item.group.prompt.meta.get(BATCH_META)
                if not isinstance(owner, str):
                    # not a coordinator batch's: left pending, a streaming trainer reclaims it
                    continue
                if self._status(owner) in ACTIVE:
                    self._held.setdefault(owner, []).append(item)
                else:  # late result of a finalized or aborted batch: nobody trains on it
                    self.buffer.discard(item, status=Status.ABORTED)
        return [item.group for item in self._held.get(batch_id, [])]

    def _result(self, batch_id: str, groups: list[Group], status: BatchStatus) -> dict[str, Any]:
        kind = self._kind(batch_id)
        result: dict[str, Any] = {
            "batch_id": batch_id,
            "batch_type": kind,
            "status": status.value,
            "finished_task_count": len(groups),
        }
        if kind == "eval":
            name = batch_id.split("/", 1)[-1]
            result["metrics"] = eval_metrics(name, groups)
            result["groups"] = len(groups)
            self.client.delete(self.keys.eval(batch_id))
        else:
            held = [] if status == BatchStatus.HANDED else self._held.pop(batch_id, [])
            for task in {item.entry.task for item in held}:  # handed over: acked and deleted
                self.buffer.commit(Batch(task, [item for item in held if item.entry.task == task]))
            result["group_ids"] = [g.group_id for g in groups]
            result["metrics"] = {"rollout/finished_task_count": float(len(groups))}
        return result

    def _remove_unclaimed(self, batch_id: str) -> int:
        """Delete the batch's prompts that no producer has claimed yet."""
        prefix = f"{batch_id}/".encode()
        removed = 0
        for task in self.tasks:
            for pool in (EVALS, *POOLS):
                stream = self.keys.stream(pool, task)
                pending = {
                    p["message_id"]
                    for p in self.client.xpending_range(stream, GROUP_OF_KIND[pool], "-", "+", 100_000)
                }
                ids = [
                    i
                    for i, f in self.client.xrange(stream)
                    if f.get(b"uid", b"").startswith(prefix) and i not in pending
                ]
                if ids:
                    gone = int(self.client.xdel(stream, *ids))
                    # counted, so that `rollstream status` accounts for them as dropped
                    self.client.hincrby(self.keys.progress, progress_field(task, Count.REMOVED), gone)
                    removed += gone
        return removed

    def _store(self, batch_id: str, result: dict[str, Any]) -> None:
        self.client.hset(
            self.keys.batch(batch_id), mapping={"status": result["status"], "result": orjson.dumps(result)}
        )

    def _fed_sets(self, batch_id: str) -> list[str]:
        """The batch's fed sets: of the tasks its prompts had, and of the run's tasks."""
        raw = self.client.hget(self.keys.batch(batch_id), "tasks")
        tasks = set(self.tasks)
        if raw is not None:
            with contextlib.suppress(orjson.JSONDecodeError, TypeError):
                tasks.update(str(t) for t in orjson.loads(raw))
        return [self.keys.batch_fed(batch_id, t) for t in sorted(tasks)]

    def _status(self, batch_id: str) -> str | None:
        value = self.client.hget(self.keys.batch(batch_id), "status")
        return None if value is None else str(value.decode())

    def _kind(self, batch_id: str) -> str:
        value = self.client.hget(self.keys.batch(batch_id), "kind")
        if value is None:
            raise ReplayBufferError(f"no batch {batch_id!r} was submitted")
        return str(value.decode())


def _signature(kind: str, prompts: list[Prompt]) -> str:
    """What a batch was submitted with, to tell a re-submit of it from a new use of its id."""
    body = orjson.dumps([kind, sorted([p.task, p.uid] for p in prompts)])  # a uid names its prompt
    return hashlib.sha256(body).hexdigest()
