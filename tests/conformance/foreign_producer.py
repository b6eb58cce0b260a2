"""A producer written from docs/stream-format.md alone (§11.9 and what it points to), with
redis-py, numpy and orjson only: nothing here imports or knows rollstream's code. Its
"engine" is a deterministic generator (made-up token ids and logprobs, a few tokens every
tick, each token stamped with the model step the producer follows), its judge a reward of
1 for a response that boxes the prompt's answer, its filter drops a prompt whose meta says
``filter``, and a prompt whose meta says ``poison`` fails for good (a dead letter).

Run as a process (the harness is tests/conformance/test_foreign_producer.py):

    python tests/conformance/foreign_producer.py URL RUN NAME [--inflight N] [--tick-s S]

It prints one line per thing it does (the harness reads them), exits 0 on the run's stop
event and on SIGTERM (its claims handed back), 1 on what it cannot go on with (another
format major, a progress counter that is not a number), 5 when the run is lost (§6).
It follows weight syncs (drain, abort, or partial through the aborted pool), pause and
resume. Eval prompts and sync mode are not implemented: it exits 1 on a sync-mode run.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import socket
import sys
import time
import uuid
import zlib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import redis

FORMAT = "1.0"
PRODUCERS, TRAINER = "producers", "trainer"  # §4
POOLS = ("aborted", "expired", "prompts")  # §11.9.1: the claim order of training work
INTEGER = re.compile(rb"-?[0-9]{1,19}")  # §11.10: a counter as Redis writes it
SPEC = Path(__file__).resolve().parents[2] / "docs" / "stream-format.md"


def page_lua(section: str) -> list[str]:
    """The Lua blocks of the page's section ``section`` ("11.9.1"), as the page prints them."""
    text = SPEC.read_text(encoding="utf-8")
    body = re.search(rf"^#+ {re.escape(section)} .*?$(.*?)(?=^#+ )", text, re.M | re.S)
    assert body is not None, f"no section {section} in {SPEC}"
    return re.findall(r"^```lua\n(.*?)^```$", body.group(1), re.M | re.S)


(STATUS_LUA,) = page_lua("11.9")  # the producer:{name} heartbeat, stamped with Redis' TIME
(CLAIM_LUA,) = page_lua("11.9.1")
(TOUCH_LUA,) = page_lua("11.9.2")


def say(*parts: Any) -> None:
    print(*parts, flush=True)


class Fatal(Exception):
    """What this producer cannot go on with: exit ``code`` after naming it."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Undecodable(Exception):
    pass


@dataclass
class Claim:
    """A claimed pool entry and the group being made of it."""

    task: str
    kind: str  # the pool it was read from
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int
    prompt: dict[str, Any]
    attempt_of_continued: int  # the attempt of an aborted / expired group entry, else 1
    started_step: int
    samples: list[dict[str, Any]] = field(default_factory=list)  # ids, lps, vers, target, done
    started_at: float = field(default_factory=time.time)

    @property
    def uid(self) -> str:
        return str(self.prompt["uid"])


def runs(values: list[int]) -> list[list[int]]:
    """§5.2 `ver`: run-length encoded, in token order."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


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


class ForeignProducer:
    """One producer process (§11.9): one loop that follows the events, beats, claims,
    generates a token per tick and settles, so that the order of what it does is the
    page's order and nothing runs behind it in a thread."""

    def __init__(self, client: redis.Redis, run: str, me: str, *, inflight: int, tick_s: float) -> None:
        self.r, self.me, self.room, self.tick_s = client, me, inflight, tick_s
        self.base = f"rs:{{{run}}}"
        self.state, self.progress = f"{self.base}:state", f"{self.base}:progress"
        self.events = f"{self.base}:events"
        self.alive = f"{self.base}:alive:producer:{me}"
        self._status = client.register_script(STATUS_LUA)
        self._claim = client.register_script(CLAIM_LUA)
        self._touch = client.register_script(TOUCH_LUA)
        self.held: dict[tuple[str, str], Claim] = {}  # (stream, id) -> claim
        self.stopping = False
        # §11.9 start-up: the newest event first, then the state (nothing published between is missed)
        newest = client.xrevrange(self.events, "+", "-", count=1)
        self.after = newest[0][0].decode() if newest else "0-0"
        self._read_state()
        self.step = int(client.hget(self.state, "model_step") or 0)
        self.paused = client.hexists(self.state, "paused")  # §6: claim nothing until a resume
        self.pending_sync: int | None = None  # drain: the step to move to once in-flight groups finish
        for task in self.tasks:  # §4: the five streams and their groups
            for kind in ("prompts", "evals", "aborted", "expired", "groups"):
                group = TRAINER if kind == "groups" else PRODUCERS
                try:
                    client.xgroup_create(self.stream(kind, task), group, id="0", mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
            self.check_counters(task)
        self._tail = {task: False for task in self.tasks}
        self._last_reclaim: dict[str, float] = {}
        self._beat_at = self._run_checked_at = 0.0
        self._touched_at = time.monotonic()
        self.started = time.time()

    # --- §10, §6 -----------------------------------------------------------------------

    def _read_state(self) -> None:
        deadline = time.monotonic() + 60
        while (raw := self.r.hget(self.state, "settings")) is None:  # §10: wait for the first process
            if time.monotonic() > deadline:
                raise Fatal("the run's settings were not published within 60 s")
            time.sleep(0.1)
        state = self.r.hgetall(self.state)
        version = state.get(b"format", b"1.0").decode()
        if version.split(".")[0] != "1":
            raise Fatal(f"the run is in stream format {version}; this producer writes 1.0")
        if b"stopped" in state:
            raise Fatal("the run is stopped (its state has `stopped`): nothing to do", 0)
        for mark in (b"lost", b"rewound"):  # §6: Redis lost the run, or its latest steps
            if mark in state:
                raise Fatal(f"the run is {mark.decode()} (its state says so): not working on it", 5)
        self.run_id = state.get(b"run_id")
        if self.run_id is None:
            self.r.hsetnx(self.state, "run_id", uuid.uuid4().hex)
            self.run_id = self.r.hget(self.state, "run_id")
        published = orjson.loads(raw)
        s, p = published["settings"], published.get("protocol", {})
        if s["rollout.mode"] != "async":
            raise Fatal(f"rollout.mode {s['rollout.mode']}: this producer implements async mode only")
        self.mode = s["rollout.on_weight_sync"]
        self.tasks = s["tasks"].split(",")
        self.n = {t: int(s[f"tasks.{t}.n"]) for t in self.tasks}
        batch = quotas(int(s["rollout.batch_size"]), {t: float(s[f"tasks.{t}.weight"]) for t in self.tasks})
        self.batch = batch
        interval = int(s["rollout.sync_weights_interval"])
        self.stale_threshold = (int(s["rollout.max_staleness"]) + 1) * interval
        self.over = float(s["rollout.over_sample_threshold"])
        self.tail_trigger = int(s["rollout.tail_batch_trigger_size"])
        self.claim_idle_ms = int(p.get("buffer.claim_idle_ms", 60_000))
        self.max_attempts = int(p.get("buffer.max_attempts", 3))
        self.ttl_ms = int(float(p.get("process.liveness_ttl_s", 10)) * 1000)
        self.stop_timeout_s = float(p.get("process.stop_timeout_s", 10))
        self.heartbeat_s = float(p.get("producer.heartbeat_s", 2))
        self.dead_maxlen = int(p.get("buffer.dead_maxlen", 10_000))
        self.filtered_maxlen = int(p.get("buffer.filtered_maxlen", 100_000))

    def stream(self, kind: str, task: str) -> str:
        return f"{self.base}:{kind}:{task}"

    def fence(self, kind: str, task: str) -> str:
        return f"{self.base}:fence:{kind}:{task}"

    def check_counters(self, task: str) -> None:
        """§11.10: every counter a settle increments holds a number, before claiming."""
        names = (
            "completed",
            "produced_samples",
            "produced_tokens",
            "reward_count",
            "eval_completed",
            "aborted",
            "filtered",
            "dead",
        )
        values = self.r.hmget(self.progress, [f"{task}:{n}" for n in (*names, "reward_sum")])
        for name, value in zip((*names, "reward_sum"), values, strict=True):
            if value is None:
                continue
            ok = INTEGER.fullmatch(value) if name != "reward_sum" else _finite(value)
            if not ok:
                raise Fatal(
                    f"{self.progress} field {task}:{name} is {value!r}, not a number: repair it with "
                    f"redis-cli HSET {self.progress} {task}:{name} <its value>"
                )

    # --- liveness (§8, §6) and keeping claims (§11.9.2) --------------------------------

    def beat(self, now: bool = False) -> None:
        if not now and time.monotonic() - self._beat_at < self.heartbeat_s:
            self.keep_fresh()
            return
        self._beat_at = time.monotonic()
        body = {
            "role": "producer",
            "name": self.me,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self.started,
            "ts": time.time(),
            "detail": {"model_step": self.step, "inflight": len(self.held), "paused": self.paused},
        }
        self.r.set(self.alive, orjson.dumps(body), px=self.ttl_ms)
        self._status(keys=[self.state], args=[f"producer:{self.me}", self.step, len(self.held)])
        self.keep_fresh()

    def keep_fresh(self) -> None:
        """TOUCH every held claim at least every claim_idle_ms / 3; one taken over is dropped."""
        if time.monotonic() - self._touched_at < min(self.claim_idle_ms / 3000, self.heartbeat_s):
            return
        self._touched_at = time.monotonic()
        by_stream: dict[tuple[str, str], list[str]] = {}
        for (stream, entry_id), claim in self.held.items():
            by_stream.setdefault((stream, claim.task), []).append(entry_id)
        for (stream, _), ids in by_stream.items():
            for lost in self._touch(keys=[stream], args=[PRODUCERS, self.me, *ids]):
                say(f"claim {lost.decode()} of {stream} was taken over: dropped")
                self.held.pop((stream, lost.decode()), None)

    def check_run(self) -> None:
        """§6: every second, the run's id still there and the same, `lost` and `rewound` unset."""
        if time.monotonic() - self._run_checked_at < 1.0:
            return
        self._run_checked_at = time.monotonic()
        run_id, lost, rewound = self.r.hmget(self.state, ["run_id", "lost", "rewound"])
        if run_id != self.run_id or lost is not None or rewound is not None:
            raise Fatal(f"the run is lost or rewound: run_id {run_id!r}, was {self.run_id!r}", 5)

    # --- events (§5.3, §11.9.5, §11.8) -------------------------------------------------

    def follow_events(self) -> None:
        reply = self.r.xread({self.events: self.after}, count=100)
        for _, items in reply or []:
            for entry_id, f in items:
                self.after = entry_id.decode()
                version = f.get(b"format", b"1.0").decode("utf-8", "replace")
                if version.split(".")[0] != "1":
                    raise Fatal(f"event {self.after} is in stream format {version}; this producer reads 1.x")
                try:
                    kind, step = f[b"type"].decode(), int(f[b"model_step"])
                except (KeyError, ValueError, UnicodeDecodeError):
                    say(f"warning: malformed event {self.after} skipped")
                    continue
                if kind == "weight_sync" and step > max(self.step, self.pending_sync or -1):
                    self.weight_sync(step)
                elif kind == "pause" and not self.paused:  # §11.8: a sync's first half
                    self.paused = True
                    handed = self.hand_back_all(keep=self.mode == "partial") if self.mode != "drain" else 0
                    say(f"paused ({self.mode}): {handed} handed back, {len(self.held)} left to finish")
                elif kind == "resume" and self.paused:
                    self.paused = False
                    say("resumed")
                elif kind == "stop":
                    say(f"stop event {self.after}")
                    self.stopping = True
                    return

    def weight_sync(self, step: int) -> None:
        """§11.9.5: stop claiming, hand back or let finish what is in flight, move, beat at once."""
        if self.mode == "drain" and self.held:
            say(f"weight sync to {step}: draining {len(self.held)} groups on step {self.step}")
            self.pending_sync = step
            return
        handed = self.hand_back_all(keep=self.mode == "partial") if self.mode != "drain" else 0
        self.move_to(step, handed)

    def move_to(self, step: int, handed: int) -> None:
        self.step, self.pending_sync = step, None
        self.beat(now=True)
        say(f"weight sync to {step} ({self.mode}): {handed} handed back")

    # --- claims (§11.9.1, §11.9.4) -----------------------------------------------------

    def claim_all(self) -> None:
        for task in self.tasks:
            for kind in POOLS:
                if len(self.held) < self.room:
                    self.reclaim(kind, task)
            room = self.room - len(self.held)
            if room <= 0:
                return
            expired = self._expired_pool(task)
            over = 0 if self._tail[task] else math.ceil(Fraction(repr(self.over)) * self.batch[task])
            limit = (self.step + self.stale_threshold) * self.batch[task] + over
            counters = ("completed", "expired", "expired_dropped", "aborted_dropped", "groups_dead")
            reply = self._claim(
                keys=[*(self.stream(k, task) for k in POOLS), self.progress],
                args=[
                    PRODUCERS,
                    self.me,
                    room,
                    limit,
                    "1" if expired else "0",
                    *(f"{task}:{c}" for c in counters),
                ],
            )
            for stream, entry_id, flat in reply:
                kind = stream.decode().rsplit(":", 2)[-2]
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
                self.accept(task, kind, entry_id.decode(), fields, 1 + _attempts(fields))

    def _expired_pool(self, task: str) -> bool:
        """Tail-batch mode (§11.9.1): with trigger 0 always, N > 0 from N waiting until empty."""
        if self.tail_trigger <= 0:
            return self.tail_trigger == 0
        waiting = int(self.r.xlen(self.stream("expired", task)))
        self._tail[task] = waiting >= self.tail_trigger or (self._tail[task] and waiting > 0)
        return self._tail[task]

    def reclaim(self, kind: str, task: str) -> None:
        """§11.9.4: idle claims of other names, and own ones not held, at most twice per
        claim_idle_ms per stream; one delivered too often goes to the dead letters."""
        stream = self.stream(kind, task)
        if time.monotonic() - self._last_reclaim.get(stream, -math.inf) < self.claim_idle_ms / 2000:
            return
        self._last_reclaim[stream] = time.monotonic()
        room = self.room - len(self.held)
        rows = self.r.xpending_range(stream, PRODUCERS, "-", "+", 64, idle=self.claim_idle_ms)
        theirs = [
            row
            for row in rows
            if row["consumer"].decode() != self.me or (stream, row["message_id"].decode()) not in self.held
        ][:room]
        if not theirs:
            return
        self.r.incr(self.fence(kind, task))
        for row in theirs:
            entry_id = row["message_id"]
            got = self.r.xclaim(stream, PRODUCERS, self.me, self.claim_idle_ms, [entry_id])
            if got and got[0][1]:
                fields = got[0][1]
                deliveries = int(row["times_delivered"]) + 1 + _attempts(fields)
                say(f"reclaimed {entry_id.decode()} of {stream} from {row['consumer'].decode()}")
                self.accept(task, kind, entry_id.decode(), fields, deliveries)
            elif not self.r.xrange(stream, entry_id, entry_id):  # deleted while pending
                with self.r.pipeline() as pipe:
                    pipe.xack(stream, PRODUCERS, entry_id)
                    pipe.xadd(
                        f"{self.base}:dead",
                        {
                            "reason": "deleted while pending",
                            "attempts": int(row["times_delivered"]) + 1,
                            "source": stream,
                            "source_id": entry_id,
                        },
                        maxlen=self.dead_maxlen,
                        approximate=True,
                    )
                    pipe.hincrby(self.progress, f"{task}:dead", 1)
                    pipe.execute()

    def accept(
        self, task: str, kind: str, entry_id: str, fields: dict[bytes, bytes], deliveries: int
    ) -> None:
        """Decode a claim (§5.1 or §5.2: a group_id tells them apart) and start its group."""
        stream = self.stream(kind, task)
        version = fields.get(b"format", b"1.0").decode("utf-8", "replace")
        if version.split(".")[0] != "1":  # §1: stop, the claim left pending
            raise Fatal(
                f"entry {entry_id} of {stream} is in stream format {version}; this producer reads 1.x"
            )
        claim = Claim(task, kind, entry_id, fields, deliveries, {}, 1, self.step)
        self.held[(stream, entry_id)] = claim
        if deliveries > self.max_attempts:
            reason = f"delivered {deliveries} times, more than max_attempts {self.max_attempts}"
            self.dead_letter(claim, reason)
            return
        try:
            if b"group_id" in fields:
                meta = orjson.loads(fields[b"meta"])
                claim.prompt = meta["prompt"]
                claim.attempt_of_continued = int(fields[b"attempt"])
                claim.samples = _continued(fields, meta)
            else:
                claim.prompt = orjson.loads(fields[b"data"])
            if type(claim.prompt) is not dict or type(claim.prompt.get("uid")) is not str:
                raise Undecodable("the prompt record has no uid")
            if claim.prompt.get("task", task) != task:
                raise Undecodable(f"a prompt of task {claim.prompt.get('task')!r} in a stream of {task!r}")
        except (Undecodable, KeyError, ValueError, TypeError, IndexError) as exc:
            what = "group" if b"group_id" in fields else "prompt"
            self.dead_letter(claim, f"undecodable {what} entry: {exc!r}")
            return
        if not claim.samples:  # §11.9.3: a partial hand-back holds all n samples; else n fresh ones
            claim.samples = [{"ids": [], "lps": [], "vers": [], "done": False} for _ in range(self.n[task])]
        for i, sample in enumerate(claim.samples):
            sample["target"] = 8 + zlib.crc32(f"{claim.uid}/{i}".encode()) % 24
        kept = sum(bool(s["ids"]) for s in claim.samples)
        say(f"claimed {entry_id} of {stream}: {claim.uid}, delivery {deliveries}, {kept} samples kept")

    # --- the engine, the judge, the filter ---------------------------------------------

    def generate(self) -> None:
        """One tick: every unfinished sample of every held claim gets a token of this step."""
        for key, claim in list(self.held.items()):
            if claim.prompt.get("meta", {}).get("poison"):
                self.dead_letter(claim, "generation failed: the engine refuses this prompt")
                continue
            for i, sample in enumerate(claim.samples):
                if not sample["done"]:
                    j = len(sample["ids"])
                    sample["ids"].append(5 + (zlib.crc32(f"{claim.uid}/{i}/{j}".encode()) % 900))
                    sample["lps"].append(-0.05 - 0.01 * (j % 7))
                    sample["vers"].append(self.step)
                    sample["done"] = len(sample["ids"]) >= sample["target"]
            if all(s["done"] for s in claim.samples) and key in self.held:
                self.finish(claim)

    def finish(self, claim: Claim) -> None:
        answer = str(claim.prompt.get("meta", {}).get("answer", ""))
        for i, sample in enumerate(claim.samples):
            right = zlib.crc32(f"{claim.uid}/{i}".encode()) % 2 == 0
            sample["text"] = f"so \\boxed{{{answer if right else 'no'}}}"
            sample["score"] = 1.0 if f"\\boxed{{{answer}}}" in sample["text"] else 0.0
        if claim.prompt.get("meta", {}).get("filter"):  # the filter: rejected
            self.settle_filtered(claim)
        else:
            self.settle_completed(claim)

    # --- settles (§11.9.3) -------------------------------------------------------------

    def _entry(
        self, claim: Claim, status: str, samples: list[dict[str, Any]], attempt: int
    ) -> dict[str, Any]:
        """A group entry (§5.2) of ``samples``, a shared prompt of made-up token ids."""
        prompt_ids = claim.prompt.get("prompt_ids") or [
            3 + b % 200 for b in str(claim.prompt.get("prompt", "")).encode()[:24]
        ]
        versions = [v for s in samples for v in s["vers"]]
        oldest = min(versions) if versions else (claim.started_step if status == "completed" else -1)
        scores = [s["score"] for s in samples if s.get("score") is not None]
        meta = {
            "prompt": claim.prompt,
            "prompt_ids_in_samples": False,
            "shared_prompt": True,
            "samples": [
                {
                    "len": len(s["ids"]),
                    "lp": len(s["lps"]),
                    "ver": runs(s["vers"]),
                    "finish": "stop" if s["done"] else None,
                    "reward": {"score": s["score"]} if s.get("score") is not None else {},
                    "status": "completed" if s["done"] else "aborted",
                    "text": s.get("text", ""),
                }
                for s in samples
            ],
            "created_at": time.time(),
            "timings": {"generate_s": time.time() - claim.started_at},
        }
        return {
            "format": FORMAT,
            "task": claim.task,
            "group_id": f"{claim.task}:{claim.uid}",
            "model_step": oldest,
            "status": status,
            "n": len(samples),
            "attempt": attempt,
            "producer": self.me,
            "reward_mean": repr(sum(scores) / len(scores)) if scores else "",
            "prompt_tokens": len(prompt_ids),
            "response_tokens": sum(len(s["ids"]) for s in samples),
            "meta": orjson.dumps(meta),
            "prompt_ids": np.asarray(prompt_ids, dtype="<i4").tobytes(),
            "response_ids": np.asarray([t for s in samples for t in s["ids"]], dtype="<i4").tobytes(),
            "logprobs": np.asarray([lp for s in samples for lp in s["lps"]], dtype="<f4").tobytes(),
        }

    def settle(
        self,
        claim: Claim,
        writes: list[tuple[str, dict[str, Any], int | None]],
        counters: dict[str, int],
        floats: dict[str, float] | None = None,
    ) -> bool:
        """WATCH the claim's fence, check it is still ours and its counters numbers, then
        MULTI: the writes, XACK + XDEL, the counters; a nil EXEC: check again."""
        stream = self.stream(claim.kind, claim.task)
        self.held.pop((stream, claim.entry_id), None)
        floats = floats or {}
        names = [f"{claim.task}:{c}" for c in (*counters, *floats)]
        while True:
            with self.r.pipeline() as pipe:
                try:
                    pipe.watch(self.fence(claim.kind, claim.task))
                    if not pipe.xpending_range(stream, PRODUCERS, claim.entry_id, claim.entry_id, 1, self.me):
                        pipe.unwatch()
                        say(f"settle of {claim.entry_id} of {stream}: not ours any more, nothing written")
                        return False
                    for key, _, _ in writes:  # a key of another type would fail its XADD alone
                        if (kind := pipe.type(key).decode()) not in ("stream", "none"):
                            raise Fatal(f"{key} holds a {kind}, not a stream: nothing settled")
                    values = pipe.hmget(self.progress, names)
                    for name, value in zip(names, values, strict=True):
                        ok = value is None or (
                            INTEGER.fullmatch(value) if name in names[: len(counters)] else _finite(value)
                        )
                        if not ok:
                            self._uncharge(stream, claim.entry_id)
                            raise Fatal(
                                f"{self.progress} field {name} is {value!r}, not a number: repair it "
                                f"with redis-cli HSET {self.progress} {name} <its value>"
                            )
                    pipe.multi()
                    for key, fields, cap in writes:
                        pipe.xadd(key, fields, maxlen=cap, approximate=cap is not None)  # type: ignore[arg-type]
                    pipe.xack(stream, PRODUCERS, claim.entry_id)
                    pipe.xdel(stream, claim.entry_id)
                    for name, value in counters.items():
                        pipe.hincrby(self.progress, f"{claim.task}:{name}", value)
                    for name, amount in floats.items():
                        pipe.hincrbyfloat(self.progress, f"{claim.task}:{name}", amount)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def _uncharge(self, stream: str, entry_id: str) -> None:
        """§11.10: the claim gets back the delivery a settle refused for the run's fault used."""
        (row,) = self.r.xpending_range(stream, PRODUCERS, entry_id, entry_id, 1, self.me)
        self.r.execute_command(
            "XCLAIM",
            stream,
            PRODUCERS,
            self.me,
            0,
            entry_id,
            "IDLE",
            row["time_since_delivered"],
            "RETRYCOUNT",
            max(0, row["times_delivered"] - 1),
            "JUSTID",
        )

    def settle_completed(self, claim: Claim) -> None:
        entry = self._entry(claim, "completed", claim.samples, claim.deliveries)
        scores = [s["score"] for s in claim.samples]
        counters = {
            "completed": 1,
            "produced_samples": len(claim.samples),
            "produced_tokens": entry["response_tokens"],
            "reward_count": len(scores),
        }
        if self.settle(
            claim,
            [(self.stream("groups", claim.task), entry, None)],
            counters,
            {"reward_sum": float(sum(scores))},
        ):
            say(
                f"completed {claim.uid} ({claim.entry_id} of {claim.kind}), ver "
                f"{[runs(s['vers']) for s in claim.samples]}"
            )

    def settle_filtered(self, claim: Claim) -> None:
        scores = [s["score"] for s in claim.samples]
        record = {
            "format": FORMAT,
            "task": claim.task,
            "uid": claim.uid,
            "group_id": f"{claim.task}:{claim.uid}",
            "producer": self.me,
            "attempt": claim.deliveries,
            "n": len(claim.samples),
            "reward_mean": repr(sum(scores) / len(scores)),
            "source": self.stream(claim.kind, claim.task),
            "source_id": claim.entry_id,
        }
        if self.settle(claim, [(f"{self.base}:filtered", record, self.filtered_maxlen)], {"filtered": 1}):
            say(f"filtered {claim.uid}")

    def dead_letter(self, claim: Claim, reason: str) -> None:
        stream = self.stream(claim.kind, claim.task)
        dead: dict[str, Any] = {
            "reason": reason,
            "attempts": claim.deliveries,
            "source": stream,
            "source_id": claim.entry_id,
        }
        for name, value in claim.fields.items():
            text = name.decode("utf-8", "replace")
            dead[f"orig.{text}" if text in dead else text] = value
        if self.settle(claim, [(f"{self.base}:dead", dead, self.dead_maxlen)], {"dead": 1}):
            say(f"dead-lettered {claim.entry_id} of {stream}: {reason}")

    def hand_back(self, claim: Claim, keep: bool) -> bool:
        """To the aborted pool, with the samples so far in partial mode (``keep``)."""
        kept = claim.samples if keep else []  # all n, those without a token too
        entry = self._entry(claim, "aborted", kept, claim.attempt_of_continued)
        return self.settle(claim, [(self.stream("aborted", claim.task), entry, None)], {"aborted": 1})

    def hand_back_all(self, keep: bool) -> int:
        return sum(self.hand_back(claim, keep) for claim in list(self.held.values()))

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> int:
        say(
            f"foreign producer {self.me}: started, run {self.base}, model step {self.step}, "
            f"on_weight_sync {self.mode}, claim_idle_ms {self.claim_idle_ms}"
            + (", paused" if self.paused else "")
        )
        self.beat(now=True)
        while not self.stopping:
            self.check_run()
            self.follow_events()
            if self.stopping:
                break
            self.beat()
            if self.pending_sync is None and not self.paused:
                self.claim_all()
            self.generate()
            if self.pending_sync is not None and not self.held:
                self.move_to(self.pending_sync, 0)
            time.sleep(self.tick_s)
        return self.stop()

    def stop(self) -> int:
        """§11.8: hand back what is in flight, drop the heartbeat and liveness key, wait
        (up to stop_timeout_s) for the other processes' liveness keys to go."""
        handed = self.hand_back_all(keep=self.mode == "partial")
        self.r.hdel(self.state, f"producer:{self.me}")
        self.r.delete(self.alive)
        say(f"stopped: {handed} handed back")
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline and any(self.r.scan_iter(f"{self.base}:alive:*", count=1000)):
            time.sleep(0.1)
        return 0


def _finite(value: bytes) -> bool:
    try:
        return math.isfinite(float(value)) and value.strip() == value
    except ValueError:
        return False


def _attempts(fields: dict[bytes, bytes]) -> int:
    """§11.9.4: a claim handed back after its producer died carries its deliveries so far."""
    try:
        return int(fields.get(b"attempts", b"0"))
    except ValueError:
        return 0


def _continued(fields: dict[bytes, bytes], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """An aborted group's samples so far (§5.2, partial mode): the ones to continue and the
    finished ones; none for an expired group's prompt or an abort-mode hand-back."""
    if not meta.get("samples"):
        return []
    response_ids = np.frombuffer(fields[b"response_ids"], dtype="<i4")
    logprobs = np.frombuffer(fields[b"logprobs"], dtype="<f4")
    out, r, lp = [], 0, 0
    for s in meta["samples"]:
        n, nlp = int(s["len"]), int(s["lp"])
        if nlp not in (0, n) or sum(c for _, c in s["ver"]) != n:
            raise Undecodable(f"a sample of {n} tokens with {nlp} logprobs and runs {s['ver']}")
        vers = [int(v) for v, c in s["ver"] for _ in range(c)]
        out.append(
            {
                "ids": response_ids[r : r + n].tolist(),
                "lps": logprobs[lp : lp + nlp].tolist(),
                "vers": vers,
                "done": s["status"] == "completed",
            }
        )
        r, lp = r + n, lp + nlp
    if r != len(response_ids) or lp != len(logprobs):
        raise Undecodable("the samples do not use up the packed fields")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("run")
    parser.add_argument("name")
    parser.add_argument("--inflight", type=int, default=4, help="groups generated at once")
    parser.add_argument("--tick-s", type=float, default=0.02, help="seconds between tokens")
    args = parser.parse_args()
    client = redis.Redis.from_url(args.url)
    try:
        producer = ForeignProducer(client, args.run, args.name, inflight=args.inflight, tick_s=args.tick_s)

        def on_term(*_: Any) -> None:
            producer.stopping = True

        signal.signal(signal.SIGTERM, on_term)
        return producer.run()
    except Fatal as exc:
        print(f"foreign producer {args.name}: {exc}", file=sys.stderr, flush=True)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
