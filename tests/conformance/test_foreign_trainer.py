"""Conformance of docs/stream-format.md: a trainer written from that page alone trains
30 steps against two real `rollstream produce` processes, syncing weights after every
step. The trainer (the first half of this file) uses redis-py, numpy and orjson and
imports nothing of rollstream; only the harness (the second half) uses the test
helpers, the `redis_server` fixture and `python -m cli.main` subprocesses.

On the way the trainer holds some groups back until they are stale (expiry), dies
before a commit and restarts under its own name (re-reading its own pending groups)
and under another name (taking the dead name's groups over), dies between a commit
and its weight publish (its restart publishes), and meets an entry it cannot decode
(dead letter). The test then checks what the bundled consumer's tests check: nothing
lost, nothing trained twice, staleness within the bound by the decoded token versions,
producers that followed every weight version, and a clean stop on the run's stop event.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis

from tests.helpers import ProducerProcess, rollstream, wait_for, wait_idle

pytestmark = pytest.mark.integration

# --------------------------------------------------------------------------------------
# The foreign trainer: docs/stream-format.md, section by section. redis-py, numpy and
# orjson only; nothing here knows rollstream's code.
# --------------------------------------------------------------------------------------

FORMAT = "1.0"  # §1: what this trainer writes; it reads any 1.x
TRAINER = "trainer"  # §4: the groups streams' consumer group
STATUSES = ("completed", "aborted", "expired", "filtered", "failed")
MAX_STEP = 2**31 - 1
PAGE = 64

# §11.5: the page's two scripts, run as the page writes them (taken from the page itself,
# so that what is tested is what a reader of the page copies)
SPEC = Path(__file__).resolve().parents[2] / "docs" / "stream-format.md"


def page_lua(section: str) -> list[str]:
    text = SPEC.read_text(encoding="utf-8")
    body = re.search(rf"^#+ {re.escape(section)}\b.*?$(.*?)(?=^#+ )", text, re.M | re.S)
    assert body is not None, f"no section {section} in {SPEC}"
    return re.findall(r"^```lua\n(.*?)^```$", body.group(1), re.M | re.S)


COMMIT_LUA, ADVANCE_LUA = page_lua("11.5")


def last_section_lua(heading: str) -> list[str]:
    """The Lua blocks of the page's section ``heading`` ("13."), up to the next top-level
    section or the end of the page."""
    text = SPEC.read_text(encoding="utf-8")
    body = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert body is not None, f"no section {heading} in {SPEC}"
    return re.findall(r"^```lua\n(.*?)^```$", body.group(1), re.M | re.S)


(COMMIT_LOGGED_LUA,) = last_section_lua("13.")  # §13: the commit of a run that keeps an archive


class Undecodable(Exception):
    """An entry that breaks §5.2: dead-lettered at its first delivery (§11.4)."""


class Stalled(Exception):
    """The batch of a step did not fill, or producers did not follow, by the deadline."""


@dataclass(eq=False)
class Sample:
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish: str | None
    reward: dict[str, Any]
    status: str
    text: str


@dataclass(eq=False)
class Group:
    entry_id: str
    task: str
    group_id: str
    model_step: int
    attempt: int
    producer: str
    prompt: dict[str, Any]
    created_at: float
    samples: list[Sample]
    fields: dict[bytes, bytes]
    deliveries: int = 1
    warnings: list[str] = field(default_factory=list)  # §5.2.2: plain fields that disagree

    @property
    def oldest_version(self) -> int:
        """§11.3: the minimum over every response token's version (-1: none)."""
        return min((int(s.versions.min()) for s in self.samples if len(s.versions)), default=-1)


def _int(fields: dict[bytes, bytes], name: str) -> int:
    return int(fields[name.encode()])


def _count(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise Undecodable(f"{what} is {value!r}, not a count")
    return value


def decode_group(entry_id: str, fields: dict[bytes, bytes], stream_task: str | None = None) -> Group:
    """§5.2, checked as the page asks, plus the plain fields against the packed ones (§5.2.2)."""
    version = fields.get(b"format", b"1.0").decode()
    if version.split(".")[0] != "1":
        raise RuntimeError(f"entry {entry_id} is in stream format {version}; this trainer reads 1.x")
    try:
        return _decode_group(entry_id, fields, stream_task)
    except (KeyError, ValueError, TypeError, IndexError) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise Undecodable(f"{exc!r}") from None


def _decode_group(entry_id: str, fields: dict[bytes, bytes], stream_task: str | None) -> Group:
    meta = orjson.loads(fields[b"meta"])
    packed = {name: fields[name.encode()] for name in ("prompt_ids", "response_ids", "logprobs")}
    task, group_id = fields[b"task"].decode(), fields[b"group_id"].decode()
    producer, group_status = fields[b"producer"].decode(), fields[b"status"].decode()
    if any(len(value) % 4 for value in packed.values()):
        raise Undecodable("a packed field is not a whole number of 4-byte values")
    prompt_ids = np.frombuffer(packed["prompt_ids"], dtype="<i4")
    response_ids = np.frombuffer(packed["response_ids"], dtype="<i4")
    logprobs = np.frombuffer(packed["logprobs"], dtype="<f4")
    if type(meta) is not dict or type(meta.get("samples")) is not list:
        raise Undecodable("meta is not an object with a list of samples")
    shared = meta.get("shared_prompt")
    if type(shared) is not bool:
        raise Undecodable("shared_prompt is not a bool")
    samples: list[Sample] = []
    r = lp = p = 0
    for i, item in enumerate(meta["samples"]):
        if type(item) is not dict:
            raise Undecodable(f"sample {i} is not an object")
        n, nlp = _count(item.get("len"), f"sample {i} len"), _count(item.get("lp"), f"sample {i} lp")
        if nlp not in (0, n):
            raise Undecodable(f"sample {i} has {nlp} logprobs for {n} tokens")
        if shared:
            s_prompt = prompt_ids
        else:
            plen = _count(item.get("plen"), f"sample {i} plen")
            s_prompt, p = prompt_ids[p : p + plen], p + plen
        runs = item.get("ver")
        if type(runs) is not list or not all(type(run) is list and len(run) == 2 for run in runs):
            raise Undecodable(f"sample {i} has version runs {runs!r}")
        for step, count in runs:
            if type(step) is not int or not 0 <= step <= MAX_STEP or type(count) is not int or count < 1:
                raise Undecodable(f"sample {i} has version run {[step, count]!r}")
        if sum(count for _, count in runs) != n:
            raise Undecodable(f"sample {i} has version runs that do not sum to its {n} tokens")
        steps, counts = [step for step, _ in runs], [count for _, count in runs]
        versions = np.repeat(np.asarray(steps, dtype="<i4"), counts)
        status, text, reward = item.get("status"), item.get("text"), item.get("reward")
        reward = {} if reward is None else reward
        if status not in STATUSES or type(text) is not str or type(reward) is not dict:
            raise Undecodable(f"sample {i} has status {status!r}, text or reward of the wrong type")
        finish = item.get("finish")
        samples.append(
            Sample(
                s_prompt,
                response_ids[r : r + n],
                logprobs[lp : lp + nlp],
                versions,
                finish,
                reward,
                status,
                text,
            )
        )
        r, lp = r + n, lp + nlp
    if r != len(response_ids) or lp != len(logprobs) or (not shared and p != len(prompt_ids)):
        raise Undecodable("the samples do not use up the packed fields exactly")
    prompt = meta.get("prompt")
    if type(prompt) is not dict or type(prompt.get("uid")) is not str:
        raise Undecodable("meta.prompt is not a prompt record")
    if meta.get("prompt_ids_in_samples", False):
        prompt = {**prompt, "prompt_ids": prompt_ids.tolist()}
    group = Group(
        entry_id,
        task,
        group_id,
        _int(fields, "model_step"),
        _int(fields, "attempt"),
        producer,
        prompt,
        float(meta.get("created_at", 0.0)),
        samples,
        fields,
    )
    # §5.2.2: a model_step that is not the oldest token version, or a task that is not the
    # stream's, is a dead letter; a plain copy that disagrees with the packed fields or the
    # prompt record is only a warning (trained on the packed fields and the prompt record).
    if group.oldest_version != -1 and group.model_step != group.oldest_version:
        raise Undecodable(f"model_step {group.model_step} is not the oldest version {group.oldest_version}")
    if stream_task is not None and task != stream_task:
        raise Undecodable(f"task {task!r} in a stream of task {stream_task!r}")
    scores = [float(s.reward["score"]) for s in samples if s.reward.get("score") is not None]
    copies = {
        "n": str(len(samples)),
        "response_tokens": str(len(response_ids)),
        "prompt_tokens": str(len(prompt_ids)),
        "group_id": f"{task}:{prompt['uid']}",
    }
    group.warnings = [name for name, value in copies.items() if fields.get(name.encode()) != value.encode()]
    raw_mean = fields.get(b"reward_mean", b"")
    try:
        mean = sum(scores) / len(scores) if scores else None
        mean_ok = not raw_mean if mean is None else math.isclose(float(raw_mean), mean, abs_tol=1e-9)
    except ValueError:
        mean_ok = False
    if not mean_ok:
        group.warnings.append("reward_mean")
    if group_status != "completed" or any(s.status != "completed" for s in samples):
        raise Undecodable(f"a group of status {group_status!r} in the replay buffer")
    return group


def quotas(batch_size: int, weights: dict[str, float]) -> dict[str, int]:
    """§10: largest remainder, earlier tasks first on a tie."""
    exact = {task: Fraction(repr(float(w))) for task, w in weights.items()}
    total = sum(exact.values())
    share = {task: batch_size * w / total for task, w in exact.items()}
    sizes = {task: math.floor(q) for task, q in share.items()}
    order = sorted(share, key=lambda task: share[task] - sizes[task], reverse=True)
    for task in order[: batch_size - sum(sizes.values())]:
        sizes[task] += 1
    return sizes


@dataclass
class StepRecord:
    step: int
    groups: list[Group]
    expired: list[str] = field(default_factory=list)  # group ids
    producers: dict[str, int] = field(default_factory=dict)  # name -> model step after the sync
    committed: bool = False


class ForeignTrainer:
    def __init__(
        self,
        client: redis.Redis,
        run: str,
        consumer: str,
        *,
        claim_idle_ms: int,
        max_attempts: int,
        liveness_ttl_s: float = 10.0,
    ) -> None:
        self.r = client
        self.me = consumer
        self.base = f"rs:{{{run}}}"
        self.claim_idle_ms, self.max_attempts = claim_idle_ms, max_attempts
        self.ttl_ms = int(liveness_ttl_s * 1000)
        self._commit = client.register_script(COMMIT_LUA)
        self._commit_logged = client.register_script(COMMIT_LOGGED_LUA)
        self._advance = client.register_script(ADVANCE_LUA)
        # §11.1 start-up
        state = client.hgetall(self.state)
        version = state.get(b"format", b"1.0").decode()
        if version.split(".")[0] != "1":
            raise RuntimeError(f"run {run!r} is in stream format {version}; this trainer reads 1.x")
        published = orjson.loads(state[b"settings"])  # §10
        shared = published["settings"]
        # §10 / §12: a run that keeps an archive says so; absent = the defaults (keep 0)
        self.archive_keep = int(published.get("protocol", {}).get("archive.keep", 0))
        self.batch_size = int(shared["rollout.batch_size"])
        self.interval = int(shared["rollout.sync_weights_interval"])
        self.threshold = (int(shared["rollout.max_staleness"]) + 1) * self.interval
        self.tail = int(shared["rollout.tail_batch_trigger_size"])
        self.tasks = shared["tasks"].split(",")
        self.quota = quotas(self.batch_size, {t: float(shared[f"tasks.{t}.weight"]) for t in self.tasks})
        self.train_step = int(state.get(b"train_step", b"0"))
        for task in self.tasks:
            try:
                client.xgroup_create(self.groups(task), TRAINER, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        # §11.2: every entry id this process holds (read, not yet committed, expired or
        # dead-lettered), kept fresh, and never taken back as a stray of its own
        self.holding: dict[str, set[str]] = {task: set() for task in self.tasks}
        self._touched_at = time.monotonic()
        self.started, self._beat_at = time.time(), 0.0
        self.beat({"step": self.train_step})
        self._last_reclaim = {task: -math.inf for task in self.tasks}
        self.held: dict[str, list[tuple[int, Group]]] = {task: [] for task in self.tasks}
        # §11.7: own pending groups first, all of them, before anything new
        self.recovered = {task: deque(self._own_pending(task)) for task in self.tasks}

    # --- keys (§3) ---------------------------------------------------------------------

    def groups(self, task: str) -> str:
        return f"{self.base}:groups:{task}"

    def fence(self, task: str) -> str:
        return f"{self.base}:fence:groups:{task}"

    @property
    def state(self) -> str:
        return f"{self.base}:state"

    @property
    def progress(self) -> str:
        return f"{self.base}:progress"

    @property
    def alive(self) -> str:
        return f"{self.base}:alive:trainer:{self.me}"

    # --- liveness (§8) -----------------------------------------------------------------

    def beat(self, detail: dict[str, Any] | None = None) -> None:
        self.keep_fresh()
        now = time.time()
        if detail is None and now - self._beat_at < self.ttl_ms / 3000:
            return
        body = {
            "role": "trainer",
            "name": self.me,
            "host": os.uname().nodename,
            "pid": os.getpid(),
            "started": self.started,
            "ts": now,
            "detail": detail or {"step": self.train_step},
        }
        self.r.set(self.alive, orjson.dumps(body), px=self.ttl_ms)
        self._beat_at = now

    def close(self) -> None:
        self.r.delete(self.alive)

    def keep_fresh(self) -> None:
        """§11.2: reset the idle time of what this process holds, every claim_idle_ms / 3,
        only while each entry is still pending for it; one taken over is forgotten."""
        now = time.monotonic()
        if now - self._touched_at < self.claim_idle_ms / 3000:
            return
        self._touched_at = now
        for task, ids in self.holding.items():
            stream = self.groups(task)
            for entry_id in sorted(ids):
                if self.r.xpending_range(stream, TRAINER, entry_id, entry_id, 1, self.me):
                    self.r.xclaim(stream, TRAINER, self.me, 0, [entry_id], justid=True)
                else:
                    ids.discard(entry_id)

    # --- reading (§11.2) ---------------------------------------------------------------

    def _own_pending(self, task: str) -> list[Group]:
        """§11.2 step 1, once at start: this name's pending groups, read with XPENDING +
        XRANGE and their idle time reset (XCLAIM JUSTID), which Redis counts as no
        delivery. A re-read after a restart is not charged against the groups: a trainer
        killed before its commit, however often, trains the step on them again."""
        stream, start, out = self.groups(task), "-", []
        self.r.xgroup_createconsumer(stream, TRAINER, self.me)
        while True:
            rows = self.r.xpending_range(stream, TRAINER, start, "+", PAGE, self.me)
            found = []
            for row in rows:
                entry_id = row["message_id"]
                entry = self.r.xrange(stream, entry_id, entry_id)
                fields = entry[0][1] if entry else {}  # gone: deleted while pending
                if fields:
                    found.append(entry_id)
                group = self._accept(
                    task, entry_id.decode(), fields, int(row["times_delivered"]), charge=False
                )
                if group is not None:
                    out.append(group)
            if found:
                self.r.xclaim(stream, TRAINER, self.me, 0, found, justid=True)
            if len(rows) < PAGE:
                return out
            start = "(" + rows[-1]["message_id"].decode()

    def _reclaim(self, task: str, count: int) -> list[Group]:
        """Groups a dead trainer consumer left idle for claim_idle_ms, at most twice per
        claim_idle_ms."""
        now = time.monotonic()
        if now - self._last_reclaim[task] < self.claim_idle_ms / 2000:
            return []
        self._last_reclaim[task] = now
        stream, start, theirs = self.groups(task), "-", []
        while len(theirs) < count:
            rows = self.r.xpending_range(stream, TRAINER, start, "+", PAGE, idle=self.claim_idle_ms)
            # a dead consumer's, or this name's own that this process does not hold
            held = self.holding[task]
            theirs += [
                row for row in rows
                if row["consumer"].decode() != self.me or row["message_id"].decode() not in held
            ]  # fmt: skip
            if len(rows) < PAGE:
                break
            start = "(" + rows[-1]["message_id"].decode()
        theirs = theirs[:count]
        if not theirs:
            return []
        self.r.incr(self.fence(task))
        deliveries = {row["message_id"]: int(row["times_delivered"]) + 1 for row in theirs}
        claimed = self.r.xclaim(stream, TRAINER, self.me, self.claim_idle_ms, list(deliveries))
        out, got = [], set()
        for entry_id, fields in claimed:
            if entry_id is None:
                continue
            got.add(entry_id)
            group = self._accept(task, entry_id.decode(), fields, deliveries[entry_id])
            if group is not None:
                out.append(group)
        for entry_id in set(deliveries) - got:
            if not self.r.xrange(stream, entry_id, entry_id):  # deleted while pending
                self._dead_letter_gone(task, entry_id.decode(), deliveries[entry_id])
        return out

    def _new(self, task: str, count: int) -> list[Group]:
        reply = self.r.xreadgroup(TRAINER, self.me, {self.groups(task): ">"}, count=count, block=100)
        out = []
        for entry_id, fields in reply[0][1] if reply else []:
            group = self._accept(task, entry_id.decode(), fields, 1)
            if group is not None:
                out.append(group)
        return out

    def _accept(
        self, task: str, entry_id: str, fields: dict[bytes, bytes], deliveries: int, *, charge: bool = True
    ) -> Group | None:
        """The decoded group, or None when the entry went to the dead letters (§11.4).
        ``charge``: the read counted a delivery (a restart's re-read does not, §11.2)."""
        if not fields:
            self._dead_letter(task, entry_id, {}, "deleted while pending", deliveries)
            return None
        if charge and deliveries > self.max_attempts:
            reason = f"delivered {deliveries} times, more than max_attempts {self.max_attempts}"
            self._dead_letter(task, entry_id, fields, reason, deliveries)
            return None
        try:
            group = decode_group(entry_id, fields, task)
        except Undecodable as exc:
            self._dead_letter(task, entry_id, fields, f"undecodable group entry: {exc}", deliveries)
            return None
        group.deliveries = deliveries
        self.holding[task].add(entry_id)
        return group

    def _next(self, task: str, step: int, count: int) -> list[Group]:
        """Held groups that are due, own pending, others' idle ones, new ones (§11.2)."""
        due: list[Group] = []
        still: list[tuple[int, Group]] = []
        for release, group in self.held[task]:
            if release <= step and len(due) < count:
                due.append(group)
            else:
                still.append((release, group))
        self.held[task] = still
        recovered = self.recovered[task]
        while recovered and len(due) < count:
            due.append(recovered.popleft())
        if len(due) < count:
            due += self._reclaim(task, count - len(due))
        if len(due) < count:
            due += self._new(task, count - len(due))
        return due

    def read_batch(self, step: int, *, timeout_s: float, hold: int = 0, hold_until: int = 0) -> StepRecord:
        """The groups of train step ``step``: each task's quota, stale ones expired (§11.3).
        ``hold`` more groups are read and held back, pending, until step ``hold_until``."""
        record = StepRecord(step, [])
        deadline = time.monotonic() + timeout_s
        for task, quota in self.quota.items():
            batch: list[Group] = []
            while len(batch) < quota:
                if time.monotonic() > deadline:
                    raise Stalled(f"step {step}: {len(batch)} of {quota} {task} groups after {timeout_s} s")
                self.beat()
                for group in self._next(task, step, quota - len(batch)):
                    # §11.3: model_step, checked against the tokens when there are any; a group
                    # without one carries the step its generation started at
                    if step - group.model_step - 1 >= self.threshold:
                        if self.expire(group):
                            record.expired.append(group.group_id)
                    else:
                        batch.append(group)
            while hold > 0:
                if time.monotonic() > deadline:
                    raise Stalled(
                        f"step {step}: {hold} groups to hold back still missing after {timeout_s} s"
                    )
                for group in self._new(task, hold):
                    self.held[task].append((hold_until, group))
                    hold -= 1
            record.groups += batch
        return record

    # --- settles (§11.3, §11.4) --------------------------------------------------------

    def _settle(
        self, task: str, entry_id: str, dest: str | None, fields: dict[str, Any], *counters: str
    ) -> bool:
        """A fenced settle: append ``fields`` to rs:{run}:{dest}[:task] (if any), ack + delete
        the entry and count it in each of ``counters``, only while the entry is still pending
        for this consumer."""
        stream = self.groups(task)
        self.holding[task].discard(entry_id)  # settled here, or not this process's any more
        key = (
            None
            if dest is None
            else (f"{self.base}:dead" if dest == "dead" else f"{self.base}:{dest}:{task}")
        )
        while True:
            with self.r.pipeline() as pipe:
                try:
                    pipe.watch(self.fence(task))
                    if not pipe.xpending_range(stream, TRAINER, entry_id, entry_id, 1, self.me):
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    if key is not None:
                        pipe.xadd(key, fields)
                    pipe.xack(stream, TRAINER, entry_id)
                    pipe.xdel(stream, entry_id)
                    for counter in counters:
                        pipe.hincrby(self.progress, f"{task}:{counter}", 1)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def _dead_letter(
        self, task: str, entry_id: str, fields: dict[bytes, bytes], reason: str, deliveries: int
    ) -> bool:
        """§5.4 / §11.4: the entry with its reason to rs:{run}:dead, fenced like every settle."""
        dead: dict[str, Any] = {
            "reason": reason,
            "attempts": deliveries,
            "source": self.groups(task),
            "source_id": entry_id,
        }
        for name, value in fields.items():
            text = name.decode("utf-8", "replace")
            dead[f"orig.{text}" if text in dead else text] = value
        return self._settle(task, entry_id, "dead", dead, "dead", "groups_dead")

    def _dead_letter_gone(self, task: str, entry_id: str, deliveries: int) -> None:
        """An entry deleted while another consumer held it, which XCLAIM dropped (Redis 7)."""
        dead = {
            "reason": "deleted while pending",
            "attempts": deliveries,
            "source": self.groups(task),
            "source_id": entry_id,
        }
        with self.r.pipeline() as pipe:
            pipe.xack(self.groups(task), TRAINER, entry_id)
            pipe.xadd(f"{self.base}:dead", dead)
            pipe.hincrby(self.progress, f"{task}:dead", 1)
            pipe.hincrby(self.progress, f"{task}:groups_dead", 1)
            pipe.execute()

    def expire(self, group: Group) -> bool:
        """§11.3: the prompt to the expired pool (or dropped), counted, fenced."""
        if self.tail == -1:
            return self._settle(group.task, group.entry_id, None, {}, "expired_dropped")
        meta = {
            "prompt": group.prompt,
            "prompt_ids_in_samples": False,
            "samples": [],
            "shared_prompt": True,
            "created_at": group.created_at,
            "timings": {},
        }
        fields = {
            "format": FORMAT,
            "task": group.task,
            "group_id": group.group_id,
            "model_step": group.model_step,
            "status": "expired",
            "n": 0,
            "attempt": group.attempt,
            "producer": group.producer,
            "reward_mean": "",
            "prompt_tokens": 0,
            "response_tokens": 0,
            "meta": orjson.dumps(meta),
            "prompt_ids": b"",
            "response_ids": b"",
            "logprobs": b"",
        }
        return self._settle(group.task, group.entry_id, "expired", fields, "expired")

    # --- training, commit, weights (§11.5, §11.6) -------------------------------------

    @staticmethod
    def train(record: StepRecord) -> float:
        """A stand-in for the optimizer step that touches every decoded array: GRPO-style
        advantages times the responses' summed logprobs."""
        loss = 0.0
        for group in record.groups:
            scores = np.array([float(s.reward.get("score", 0.0)) for s in group.samples])
            advantages = scores - scores.mean()
            sums = np.array([float(s.logprobs.astype(np.float64).sum()) for s in group.samples])
            loss -= float((advantages * sums).sum()) / max(1, len(group.samples))
        return loss

    def commit(self, record: StepRecord) -> list[str]:
        foreign: list[str] = []
        by_task: dict[str, list[str]] = {}
        for group in record.groups:
            by_task.setdefault(group.task, []).append(group.entry_id)
            self.holding[group.task].discard(group.entry_id)
        for task, ids in by_task.items():
            if self.archive_keep > 0:  # §13: acked and counted, logged for the archiver, not deleted
                keys = [self.groups(task), self.progress, f"{self.base}:trained:{task}"]
                args = [
                    TRAINER,
                    self.me,
                    f"{task}:consumed",
                    record.step,
                    repr(time.time()),
                    self.archive_keep,
                ]
                reply, _length, _trimmed = self._commit_logged(keys=keys, args=[*args, *ids])
            else:
                reply = self._commit(
                    keys=[self.groups(task), self.progress], args=[TRAINER, self.me, f"{task}:consumed", *ids]
                )
            foreign += [i.decode() for i in reply]
        self._advance(keys=[self.state], args=["train_step", record.step])
        self.train_step = record.step
        record.committed = True
        return foreign

    def publish_weights(self, step: int, uri: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.state, "model_step", step)
        event = {"type": "weight_sync", "model_step": step, "uri": uri, "ts": time.time(), "format": FORMAT}
        pipe.xadd(f"{self.base}:events", event, maxlen=10_000, approximate=True)  # type: ignore[arg-type]
        pipe.execute()

    def wait_for_producers(
        self, step: int, at_least: int, timeout_s: float, max_age_s: float = 10.0
    ) -> dict[str, int]:
        """Every producer with a recent heartbeat in the state hash on ``step`` or later."""
        deadline = time.monotonic() + timeout_s
        while True:
            now, live = time.time(), {}  # name -> model step
            for name, raw in self.r.hgetall(self.state).items():
                if name.startswith(b"producer:"):
                    beat = orjson.loads(raw)
                    if now - float(beat["ts"]) <= max_age_s:
                        live[name.decode().removeprefix("producer:")] = int(beat["model_step"])
            if len(live) >= at_least and all(s >= step for s in live.values()):
                return live
            if time.monotonic() > deadline:
                raise Stalled(f"producers not on model step {step} after {timeout_s} s: {live}")
            self.beat()
            time.sleep(0.01)

    def republish_if_behind(self, producers: int, timeout_s: float) -> dict[str, int] | None:
        """§11.7 step 3: a trainer that died between a commit and its weight publish
        publishes that sync step now."""
        model_step = int(self.r.hget(self.state, "model_step") or 0)
        last_sync = self.train_step - self.train_step % self.interval
        if model_step >= last_sync:
            return None
        self.publish_weights(last_sync, f"file:///weights/step-{last_sync}")
        return self.wait_for_producers(last_sync, producers, timeout_s)

    def step(self, record: StepRecord, producers: int, timeout_s: float) -> StepRecord:
        """Train, commit, and sync weights every sync_weights_interval steps."""
        self.train(record)
        foreign = self.commit(record)
        assert not foreign, f"step {record.step}: groups taken over by another trainer: {foreign}"
        if record.step % self.interval == 0:
            self.publish_weights(record.step, f"file:///weights/step-{record.step}")
            record.producers = self.wait_for_producers(record.step, producers, timeout_s)
        self.beat({"step": record.step, "groups": len(record.groups)})
        return record


# --------------------------------------------------------------------------------------
# The harness: a real Redis, `rollstream feed`, two `rollstream produce --local-engines`
# processes, `rollstream stop`.
# --------------------------------------------------------------------------------------

STEPS, BATCH, N, FED = 30, 8, 4, 320
THRESHOLD = 2  # (max_staleness 1 + 1) x sync every step
CLAIM_IDLE_MS = 2000
HOLD_AT, HOLD, HOLD_UNTIL = 5, 4, 7  # groups held back at step 5 and looked at again at step 7
RESTART_SAME_NAME, RESTART_NEW_NAME = 12, 20  # steps the trainer dies in, before its commit
RESTART_AFTER_COMMIT = 25  # the trainer dies after its commit, before publishing its weights
STEP_TIMEOUT_S = 30.0
RUN_DEADLINE_S = 90.0


def env_for(url: str, run: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS"))}
    return {
        **base,
        "ROLLSTREAM_REDIS__URL": url,
        "ROLLSTREAM_RUN": run,
        "ROLLSTREAM_TASKS": f'[{{"name": "math", "n": {N}}}]',
        "ROLLSTREAM_ROLLOUT__BATCH_SIZE": str(BATCH),
        "ROLLSTREAM_ROLLOUT__MAX_STALENESS": "1",
        "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "20",
        "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "100",
        "ROLLSTREAM_PRODUCER__IS_VALID": "keep_all",
        "ROLLSTREAM_PRODUCER__HEARTBEAT_S": "0.2",
        # entries carry the optional summary line: a reader that follows the spec ignores it
        "ROLLSTREAM_BUFFER__SUMMARY": "true",
        "ROLLSTREAM_BUFFER__CLAIM_IDLE_MS": str(CLAIM_IDLE_MS),
    }


def uid_of(fields: dict[bytes, bytes]) -> str | None:
    """The prompt uid an entry stands for: a prompt entry's uid, a group entry's group id."""
    if b"uid" in fields:
        return fields[b"uid"].decode()
    if b"group_id" in fields:
        return fields[b"group_id"].decode().partition(":")[2]
    return None


def test_a_trainer_written_from_the_stream_format_trains_with_real_producers(
    redis_server: Any, run_name: str, tmp_path: Path
) -> None:
    env = env_for(redis_server.url, run_name)
    base = f"rs:{{{run_name}}}"
    client = redis.Redis.from_url(redis_server.url)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(
        b"".join(
            orjson.dumps({"uid": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + b"\n"
            for i in range(FED)
        )
    )
    fed = subprocess.run(
        rollstream("feed", str(prompts), "--task", "math"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fed.returncode == 0, fed.stderr
    producers = [ProducerProcess(env, tmp_path, f"producer{i}") for i in range(2)]
    records: list[StepRecord] = []  # the steps trained and committed
    expired: list[str] = []  # group ids expired by any read, a crashed one's too
    crashed_reads: dict[int, list[str]] = {}
    held: list[str] = []
    started = time.monotonic()
    try:
        # Given two producers that have joined the run at model step 0
        wait_for(
            lambda: (
                all(p.running() for p in producers)
                and sum(k.startswith(b"producer:") for k in client.hkeys(f"{base}:state")) == 2
            ),
            timeout=60,
        )
        options: dict[str, Any] = {"claim_idle_ms": CLAIM_IDLE_MS, "max_attempts": 3, "liveness_ttl_s": 3.0}
        trainer = ForeignTrainer(client, run_name, "trainer-a", **options)
        assert (trainer.batch_size, trainer.threshold, trainer.quota) == (BATCH, THRESHOLD, {"math": BATCH})
        # and an entry in the replay buffer that no producer wrote and nobody can decode
        junk = client.xadd(f"{base}:groups:math", {"format": "1.0", "group_id": "math:junk", "meta": b"{"})
        # When the foreign trainer runs its steps
        step, name = trainer.train_step + 1, "trainer-a"
        assert step == 1
        while step <= STEPS:
            assert all(p.running() for p in producers)
            assert time.monotonic() - started < RUN_DEADLINE_S, f"only {step - 1} steps in {RUN_DEADLINE_S} s"
            if step in (RESTART_SAME_NAME, RESTART_NEW_NAME):
                # it reads the step's batch and dies before the commit
                crashed = trainer.read_batch(step, timeout_s=STEP_TIMEOUT_S)
                crashed_reads[step] = [g.group_id for g in crashed.groups]
                expired += crashed.expired
                if step == RESTART_NEW_NAME:  # a replacement elsewhere, once the groups are idle enough
                    wait_idle(client, f"{base}:groups:math", TRAINER, CLAIM_IDLE_MS, timeout=30)
                    name = "trainer-b"
                trainer = ForeignTrainer(client, run_name, name, **options)
                assert trainer.train_step + 1 == step, "a restarted trainer redoes the step it died in"
                assert trainer.republish_if_behind(2, STEP_TIMEOUT_S) is None
            hold = HOLD if step == HOLD_AT else 0
            record = trainer.read_batch(step, timeout_s=STEP_TIMEOUT_S, hold=hold, hold_until=HOLD_UNTIL)
            held += [g.group_id for _, g in trainer.held["math"]] if hold else []
            expired += record.expired
            if step == RESTART_AFTER_COMMIT:
                trainer.train(record)
                assert trainer.commit(record) == []
                # and dies before it publishes the step's weights: its restart publishes them
                trainer = ForeignTrainer(client, run_name, name, **options)
                assert trainer.train_step == step
                record.producers = trainer.republish_if_behind(2, STEP_TIMEOUT_S) or {}
                records.append(record)
            else:
                records.append(trainer.step(record, producers=2, timeout_s=STEP_TIMEOUT_S))
            step += 1
        elapsed = time.monotonic() - started
        trainer.close()
        # Then the producers' liveness keys show the last model step too
        names = set(records[-1].producers)

        def on_last_step() -> bool:
            beats = [client.get(f"{base}:alive:producer:{who}") for who in names]
            return all(b is not None and orjson.loads(b)["detail"]["model_step"] == STEPS for b in beats)

        wait_for(on_last_step, timeout=10)
        # and the run's stop event ends them cleanly
        stop = subprocess.run(rollstream("stop"), env=env, capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        codes = [p.proc.wait(timeout=60) for p in producers]
    finally:
        for p in producers:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
    errors = [p.err.read_text()[-2000:] for p in producers]
    assert codes == [0, 0], errors
    outputs = [p.out.read_text() for p in producers]
    assert all(f"{STEPS} weight syncs" in out for out in outputs), outputs

    # Every step ran, within its deadline (producers never stalled), each committed once
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert all(r.committed and len(r.groups) == BATCH for r in records)
    assert elapsed < RUN_DEADLINE_S
    # Producers followed every weight version: both reported step t right after its sync
    assert all(set(r.producers) == names and min(r.producers.values()) >= r.step for r in records)
    assert len(names) == 2
    # A restarted trainer trained, at the same step, the very groups its predecessor read
    by_step = {r.step: r for r in records}
    for crash_step, read in crashed_reads.items():
        assert sorted(g.group_id for g in by_step[crash_step].groups) == sorted(read)
    # Staleness by the decoded token versions stays below the bound; the stored tag agrees
    for r in records:
        for g in r.groups:
            assert 0 <= r.step - g.oldest_version - 1 < THRESHOLD, (r.step, g.group_id, g.oldest_version)
            assert g.model_step == g.oldest_version
            assert g.warnings == [], (g.group_id, g.warnings)  # real producers' copies agree (§5.2.2)
    # Rewards line up with their samples' texts and the prompt's answer (the math judge)
    for g in records[0].groups + records[-1].groups:
        answer = g.prompt["meta"]["answer"]
        for s in g.samples:
            assert (s.reward["score"] == 1.0) == (f"\\boxed{{{answer}}}" in s.text), (g.group_id, s.text)
            assert len(s.response_ids) == len(s.versions) == len(s.logprobs) > 0
        # the optional summary line was there, and this trainer needed nothing from it
        assert g.fields[b"summary"].decode("ascii").startswith(f"math step={g.model_step} n={N} ")
    # The groups held back came back stale at step HOLD_UNTIL and were expired, not trained then
    assert len(held) == HOLD and set(held) <= set(expired)
    assert set(held) <= set(by_step[HOLD_UNTIL].expired)
    # Nothing lost, nothing trained twice: every fed prompt is in exactly one place
    trained = Counter(g.group_id.partition(":")[2] for r in records for g in r.groups)
    assert max(trained.values()) == 1
    where: Counter[str] = Counter(trained)
    for kind in ("prompts", "evals", "aborted", "expired", "groups"):
        for _, fields in client.xrange(f"{base}:{kind}:math"):
            uid = uid_of(fields)
            assert uid is not None
            where[uid] += 1
    dead_letters = client.xrange(f"{base}:dead")
    for _, fields in dead_letters:
        where[uid_of(fields) or "?"] += 1
    fed_uids = {f"q{i}" for i in range(FED)}
    assert {uid: where[uid] for uid in fed_uids if where[uid] != 1} == {}
    # The junk entry is the one dead letter, with its reason and origin
    assert [(f[b"source_id"], f[b"group_id"]) for _, f in dead_letters] == [(junk, b"math:junk")]
    assert dead_letters[0][1][b"reason"].startswith(b"undecodable group entry")
    # The counters the trainer keeps (§7) say the same
    progress = {k.decode(): int(float(v)) for k, v in client.hgetall(f"{base}:progress").items()}
    assert progress["math:consumed"] == sum(trained.values()) == STEPS * BATCH
    assert progress["math:expired"] == len(expired)
    assert progress["math:dead"] == progress["math:groups_dead"] == 1  # §11.4: both, always
    state = client.hgetall(f"{base}:state")
    assert (state[b"train_step"], state[b"model_step"]) == (str(STEPS).encode(), str(STEPS).encode())
    assert not any(k.startswith(b"producer:") for k in state), "clean stops remove their heartbeats"
    assert client.xpending(f"{base}:groups:math", TRAINER)["pending"] == 0
    client.close()


def test_the_page_trainer_restarted_before_its_commit_keeps_its_groups(
    redis_server: Any, make_settings: Any, real_client: redis.Redis, run_name: str
) -> None:
    """§11.2: a restart's re-read of its pending groups is not a delivery. The page's
    trainer, killed before its commit more often than max_attempts, reads the same groups
    each time at their real delivery count and dead-letters none (a history XREADGROUP
    counted one delivery per restart, and the fourth re-read dead-lettered the batch)."""
    from rollstream.shared import codec
    from rollstream.shared.records import Prompt
    from rollstream.shared.runconfig import check_run_settings, open_buffer
    from tests.helpers import group_for

    settings = make_settings(
        redis_server.url,
        tasks=[{"name": "math", "n": 2}],
        rollout={"batch_size": 4},
        buffer={"max_attempts": 3},
    )
    buffer = open_buffer(real_client, settings, "producer")
    check_run_settings(buffer.client, buffer.keys, settings, "test")  # §10: the run's settings
    buffer.ensure("math")
    for i in range(4):
        group = group_for(Prompt(uid=f"q{i}", task="math", prompt=f"What is {i} + 1?"), n=2, step=0)
        buffer.client.xadd(buffer.keys.groups("math"), codec.encode_group(group))
    client, stream = buffer.client, buffer.keys.groups("math")
    options: dict[str, Any] = {"claim_idle_ms": 60_000, "max_attempts": 3}
    trainer = ForeignTrainer(client, run_name, "trainer-a", **options)
    read = sorted(g.group_id for g in trainer.read_batch(1, timeout_s=10).groups)
    assert len(read) == 4
    for _ in range(options["max_attempts"] + 1):  # killed before its commit, restarted
        trainer = ForeignTrainer(client, run_name, "trainer-a", **options)
        assert sorted(g.group_id for g in trainer.recovered["math"]) == read
        rows = client.xpending_range(stream, TRAINER, "-", "+", 10)
        assert [int(row["times_delivered"]) for row in rows] == [1] * 4  # no delivery counted
    record = trainer.read_batch(1, timeout_s=10)
    assert sorted(g.group_id for g in record.groups) == read
    assert client.xlen(buffer.keys.dead) == 0
    trainer.close()


def test_the_page_trainer_takes_an_empty_group_at_its_model_step(
    redis_server: Any, make_settings: Any, real_client: redis.Redis, run_name: str
) -> None:
    """§5.2 / §11.3: a group with no response token (all its responses empty) carries the
    model step its generation started at, and that is its staleness; the page's trainer
    trains it as fresh at the next step (it took it for version -1: expired at every step
    past the threshold, re-rolled for ever)."""
    from rollstream.shared import codec
    from rollstream.shared.records import Group as BundledGroup
    from rollstream.shared.records import Prompt
    from rollstream.shared.records import Sample as BundledSample
    from rollstream.shared.runconfig import check_run_settings, open_buffer

    settings = make_settings(
        redis_server.url, tasks=[{"name": "math", "n": 2}], rollout={"batch_size": 1, "max_staleness": 0}
    )
    buffer = open_buffer(real_client, settings, "producer")
    check_run_settings(buffer.client, buffer.keys, settings, "test")
    buffer.ensure("math")
    empty = [BundledSample([1, 2], [], [], [], finish_reason="stop", reward={"score": 0.0}) for _ in range(2)]
    prompt = Prompt(uid="q1", task="math", prompt="Say nothing.")
    group = BundledGroup.for_prompt(prompt, samples=empty, start_step=5)
    assert group.model_step == 5
    buffer.client.xadd(buffer.keys.groups("math"), codec.encode_group(group))
    trainer = ForeignTrainer(buffer.client, run_name, "trainer-a", claim_idle_ms=60_000, max_attempts=3)
    assert trainer.threshold == 1
    record = trainer.read_batch(6, timeout_s=10)  # staleness 6 - 5 - 1 = 0: fresh
    assert [(g.group_id, g.model_step) for g in record.groups] == [("math:q1", 5)]
    assert record.expired == []
    trainer.close()


def test_the_page_trainer_keeps_what_it_holds_fresh_and_takes_back_its_strays(
    redis_server: Any, make_settings: Any, real_client: redis.Redis, run_name: str
) -> None:
    """§11.2: a trainer resets the idle time of the groups it holds, so that another
    trainer-group consumer does not take them over past claim_idle_ms; and it takes back
    its own idle entries that it does not hold (an XREADGROUP whose reply was lost),
    which nobody else would while it lives."""
    from rollstream.shared import codec
    from rollstream.shared.records import Prompt
    from rollstream.shared.runconfig import check_run_settings, open_buffer
    from tests.helpers import group_for

    idle_ms = 600
    settings = make_settings(redis_server.url, tasks=[{"name": "math", "n": 2}], rollout={"batch_size": 2})
    buffer = open_buffer(real_client, settings, "producer")
    check_run_settings(buffer.client, buffer.keys, settings, "test")
    buffer.ensure("math")
    client, stream = buffer.client, buffer.keys.groups("math")
    for i in range(4):
        group = group_for(Prompt(uid=f"q{i}", task="math", prompt=f"What is {i} + 1?"), n=2, step=0)
        client.xadd(stream, codec.encode_group(group))
    options: dict[str, Any] = {"claim_idle_ms": idle_ms, "max_attempts": 3}
    a = ForeignTrainer(client, run_name, "trainer-a", **options)
    b = ForeignTrainer(client, run_name, "trainer-b", **options)
    record = a.read_batch(1, timeout_s=10)
    assert len(record.groups) == 2
    # a's step runs for three times claim_idle_ms, its loop beating as it goes
    until = time.monotonic() + 3 * idle_ms / 1000
    while time.monotonic() < until:
        a.beat()
        time.sleep(0.02)
    assert b._reclaim("math", 10) == [], "b took over groups that a holds"
    assert a.commit(record) == []
    # a read of a's whose reply was lost: pending under a's name, unknown to a
    ((_, [(stray, _)]),) = client.xreadgroup(TRAINER, "trainer-a", {stream: ">"}, count=1)
    wait_idle(client, stream, TRAINER, idle_ms)
    second = a.read_batch(2, timeout_s=10)
    assert stray.decode() in [g.entry_id for g in second.groups]
    assert a.commit(second) == []
    assert client.xpending(stream, TRAINER)["pending"] == 0
    a.close()
    b.close()


def test_the_page_trainer_commits_an_archive_runs_groups_to_the_trained_log(
    redis_server: Any, make_settings: Any, real_client: redis.Redis, run_name: str
) -> None:
    """§10 / §12 / §13: a run that keeps an archive publishes archive.keep in its state,
    and the page's trainer, reading it there, commits with the page's COMMIT_LOGGED: the
    groups are acked and counted, logged for the archiver and left for it (the plain
    commit deleted them: the archive missed every group a foreign trainer trained)."""
    from rollstream.shared import codec
    from rollstream.shared.records import Prompt
    from rollstream.shared.runconfig import check_run_settings, open_buffer
    from tests.helpers import group_for

    # Given a run whose first process keeps an archive of 100 groups per task
    settings = make_settings(
        redis_server.url, tasks=[{"name": "math", "n": 2}], rollout={"batch_size": 3}, archive={"keep": 100}
    )
    buffer = open_buffer(real_client, settings, "producer")
    check_run_settings(buffer.client, buffer.keys, settings, "feeder")
    buffer.ensure("math")
    for i in range(3):
        group = group_for(Prompt(uid=f"q{i}", task="math", prompt=f"What is {i} + 1?"), n=2, step=0)
        buffer.client.xadd(buffer.keys.groups("math"), codec.encode_group(group))
    client, stream = buffer.client, buffer.keys.groups("math")

    # When the page's trainer reads and commits a step
    trainer = ForeignTrainer(client, run_name, "trainer-a", claim_idle_ms=60_000, max_attempts=3)
    assert trainer.archive_keep == 100
    record = trainer.read_batch(1, timeout_s=10)
    assert trainer.commit(record) == []
    trainer.close()

    # Then the groups are acked and counted, not deleted, each with its trained-log entry
    ids = sorted(g.entry_id for g in record.groups)
    assert client.xpending(stream, TRAINER)["pending"] == 0
    assert sorted(i.decode() for i, _ in client.xrange(stream)) == ids
    assert int(client.hget(buffer.keys.progress, "math:consumed") or 0) == 3
    log = client.xrange(buffer.keys.trained("math"))
    assert sorted(f[b"source_id"].decode() for _, f in log) == ids
    assert {(f[b"train_step"], f[b"trained_by"]) for _, f in log} == {(b"1", b"trainer-a")}
    assert all(float(f[b"trained_at"]) > 0 for _, f in log)
