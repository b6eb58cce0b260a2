"""The batch coordinator, for trainers that think in batches (Trinity-RFT's
RolloutCoordinator over rollstream's streams).

    submit_batch(batch_id, prompts, kind="train"|"eval", min_wait_num=None)
    finalize_train_batch(batch_id, timeout=None) / finalize_eval_batch(...)
    abort_batch(batch_id, reason, keep_partial_results=False)

A batch lives in rs:{run}:batch:{id}: PENDING -> RUNNING -> FINALIZING ->
FINALIZED | ABORTED. Its prompts carry the batch id in their meta and a uid
prefixed by it. Train prompts go to the task's prompts stream and their groups
to the replay buffer as usual; eval prompts go to the task's eval pool, which
producers serve first, and their groups to rs:{run}:eval:{id}.

Finalizing moves RUNNING -> FINALIZING in one atomic step, so one caller does
the work; concurrent callers wait for its stored result, and later calls return
it (finalize is idempotent). With a timeout, fewer than min_wait_num results
raise BatchTimeout; at or above it, what finished is returned and the batch's
unclaimed prompts are removed (in-flight ones are discarded when they land).
"""

from __future__ import annotations

import time
from dataclasses import replace
from enum import StrEnum
from typing import Any

import orjson
import redis

from consumer.metrics import eval_metrics
from shared import codec
from shared.buffer import BATCH_META, Batch, BatchItem, ReplayBuffer
from shared.errors import BatchTimeout, ReplayBufferError
from shared.keys import EVALS
from shared.records import Group, Prompt, Status
from shared.settings import Settings, validate_name

POLL_S = 0.05
ACTIVE = ("pending", "running", "finalizing")

# KEYS: batch hash. ARGV: from status, to status. Returns 1 when it moved the batch.
_TRANSITION = """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
return 1
"""


class BatchStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    FINALIZING = "finalizing"
    FINALIZED = "finalized"
    ABORTED = "aborted"


class BatchCoordinator:
    def __init__(self, client: redis.Redis, settings: Settings, consumer: str = "coordinator") -> None:
        self.client: Any = client  # replies are bytes (no decode_responses)
        self.settings = settings
        self.buffer = ReplayBuffer(client, settings, consumer)
        self.keys = self.buffer.keys
        self._transition = client.register_script(_TRANSITION)
        self._held: dict[str, list[BatchItem]] = {}  # train groups read for another batch

    # --- the API -----------------------------------------------------------------------

    def submit_batch(
        self, batch_id: str, prompts: list[Prompt], kind: str = "train", min_wait_num: int | None = None
    ) -> int:
        """Feed the batch's prompts; an id still active is an error. Returns how many."""
        validate_name(batch_id, "batch id")
        if kind not in ("train", "eval"):
            raise ValueError(f"kind must be 'train' or 'eval', not {kind!r}")
        key = self.keys.batch(batch_id)
        if not self.client.hsetnx(key, "status", BatchStatus.PENDING.value):
            status = self._status(batch_id)
            if status in ACTIVE:
                raise ReplayBufferError(f"batch {batch_id!r} is still {status}: finalize or abort it first")
            self.client.delete(key, self.keys.eval(batch_id))
            self.client.hset(key, "status", BatchStatus.PENDING.value)
        tagged = [
            replace(p, uid=f"{batch_id}/{p.uid}", meta={**p.meta, BATCH_META: batch_id}) for p in prompts
        ]
        wait = len(tagged) if min_wait_num is None else min_wait_num
        self.client.hset(key, mapping={"kind": kind, "total": len(tagged), "min_wait_num": wait})
        self.buffer.feed(tagged, pool=EVALS if kind == "eval" else "prompts")
        self._transition(keys=[key], args=[BatchStatus.PENDING.value, BatchStatus.RUNNING.value])
        return len(tagged)

    def finalize_train_batch(self, batch_id: str, timeout: float | None = None) -> dict[str, Any]:
        return self._finalize(batch_id, "train", timeout)

    def finalize_eval_batch(self, batch_id: str, timeout: float | None = None) -> dict[str, Any]:
        return self._finalize(batch_id, "eval", timeout)

    def abort_batch(self, batch_id: str, reason: str, keep_partial_results: bool = False) -> dict[str, Any]:
        """Stop a batch: its unclaimed prompts are removed; what finished is returned
        with ``keep_partial_results``, else discarded."""
        key = self.keys.batch(batch_id)
        status = self._status(batch_id)
        if status not in (BatchStatus.PENDING, BatchStatus.RUNNING):
            raise ReplayBufferError(f"batch {batch_id!r} is {status or 'unknown'}: nothing to abort")
        self.client.hset(key, mapping={"status": BatchStatus.ABORTED.value, "reason": reason})
        removed = self._remove_unclaimed(batch_id)
        groups = self._collect(batch_id, self._kind(batch_id))
        result = self._result(batch_id, groups if keep_partial_results else [], BatchStatus.ABORTED)
        result.update(reason=reason, removed_prompts=removed)
        self._store(batch_id, result)
        return result

    # --- the work ----------------------------------------------------------------------

    def _finalize(self, batch_id: str, kind: str, timeout: float | None) -> dict[str, Any]:
        key = self.keys.batch(batch_id)
        if self._kind(batch_id) != kind:
            raise ReplayBufferError(f"batch {batch_id!r} is not a {kind} batch")
        moved = self._transition(keys=[key], args=[BatchStatus.RUNNING.value, BatchStatus.FINALIZING.value])
        if not moved:
            return self._await_result(batch_id)
        try:
            total = int(self.client.hget(key, "total") or 0)
            wanted = int(self.client.hget(key, "min_wait_num") or total)
            deadline = None if timeout is None else time.monotonic() + timeout
            groups = self._collect(batch_id, kind)
            while len(groups) < total and (deadline is None or time.monotonic() < deadline):
                time.sleep(POLL_S)
                groups = self._collect(batch_id, kind)
            if len(groups) < wanted:
                self.client.hset(key, "status", BatchStatus.RUNNING.value)  # a later finalize may try again
                raise BatchTimeout(
                    f"batch {batch_id!r}: {len(groups)} of {total} results after {timeout} s, "
                    f"fewer than min_wait_num {wanted}"
                )
            removed = self._remove_unclaimed(batch_id) if len(groups) < total else 0
            result = self._result(batch_id, groups, BatchStatus.FINALIZED)
            result["removed_prompts"] = removed
            self._store(batch_id, result)
            return result
        except BatchTimeout:
            raise
        except BaseException:
            self.client.hset(key, "status", BatchStatus.RUNNING.value)
            raise

    def _collect(self, batch_id: str, kind: str) -> list[Group]:
        """Every result of the batch so far."""
        if kind == "eval":
            return [codec.decode_group(fields) for _, fields in self.client.xrange(self.keys.eval(batch_id))]
        for task in (t.name for t in self.settings.tasks):
            batch = self.buffer.read_batch(task, self.settings.buffer.read_count)
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
            held = self._held.pop(batch_id, [])
            for task in {item.entry.task for item in held}:  # handed over: acked and deleted
                self.buffer.commit(Batch(task, [item for item in held if item.entry.task == task]))
            result["group_ids"] = [g.group_id for g in groups]
            result["metrics"] = {"rollout/finished_task_count": float(len(groups))}
        return result

    def _remove_unclaimed(self, batch_id: str) -> int:
        """Delete the batch's prompts that no producer has claimed yet."""
        prefix = f"{batch_id}/".encode()
        removed = 0
        for task in (t.name for t in self.settings.tasks):
            for pool in (EVALS, "prompts", "aborted", "expired"):
                stream = self.keys.stream(pool, task)
                pending = {
                    p["message_id"]
                    for p in self.client.xpending_range(stream, "producers", "-", "+", 100_000)
                }
                ids = [
                    i
                    for i, f in self.client.xrange(stream)
                    if f.get(b"uid", b"").startswith(prefix) and i not in pending
                ]
                if ids:
                    removed += int(self.client.xdel(stream, *ids))
        return removed

    def _store(self, batch_id: str, result: dict[str, Any]) -> None:
        self.client.hset(
            self.keys.batch(batch_id), mapping={"status": result["status"], "result": orjson.dumps(result)}
        )

    def _await_result(self, batch_id: str) -> dict[str, Any]:
        while True:
            raw = self.client.hget(self.keys.batch(batch_id), "result")
            if raw is not None:
                return dict(orjson.loads(raw))
            status = self._status(batch_id)
            if status not in (BatchStatus.FINALIZING, BatchStatus.FINALIZED, BatchStatus.ABORTED):
                raise ReplayBufferError(f"batch {batch_id!r} is {status or 'unknown'}: nothing to finalize")
            time.sleep(POLL_S)

    def _status(self, batch_id: str) -> str | None:
        value = self.client.hget(self.keys.batch(batch_id), "status")
        return None if value is None else str(value.decode())

    def _kind(self, batch_id: str) -> str:
        value = self.client.hget(self.keys.batch(batch_id), "kind")
        if value is None:
            raise ReplayBufferError(f"no batch {batch_id!r} was submitted")
        return str(value.decode())
