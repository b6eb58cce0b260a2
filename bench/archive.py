"""What an archive costs the trainer's step: its commit, side by side, without and with the
trained log (archive.keep > 0), and with an archiver process writing Parquet meanwhile,
on one embedded Redis in one run.

Each round fills the replay buffer with a batch of groups (8 × 2,048 tokens with
logprobs, as producers write them), reads it as the trainer does and times the read and
the commit. ``plain`` is COMMIT (XACK + XDEL); ``logged`` COMMIT_LOGGED (XACK, a small
entry per group in rs:{run}:trained:{task}, the group left for the archiver);
``archiving`` the same with `rollstream archive` running beside it, reading, writing and
deleting. Two designs not taken, for the record: ``lua_copy`` (the script copies each
group's payload into the log, then XACK + XDEL) and ``client_copy`` (the trainer sends
the copy itself, in a fenced settle). The ways alternate round by round so that the
machine's drift hits all of them alike. The headline: what the archive adds to a step
of ``--train-ms`` of training (goal: under 2 %).

    .venv/bin/python bench/archive.py [--rounds 30] [--batch 64] [--train-ms 1000]
    .venv/bin/python bench/archive.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from common import RESULTS, show, spread, write_json

from rollstream.consumer.archive import ARCHIVER_CONSUMER
from rollstream.shared import codec
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import TRAINER_CONSUMER, Count, Role, progress_field
from rollstream.shared.records import Group, Prompt, Sample
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from rollstream.shared.streams import Settle

TASK = "math"
SAMPLES, PROMPT_TOKENS, RESPONSE_TOKENS = 8, 256, 2048
WAYS = ("plain", "logged", "archiving", "lua_copy", "client_copy")
LOGGED = ("logged", "archiving", "lua_copy")
# The design not taken: the commit script copies each group's payload into the log (and
# deletes the group as without an archive). What costs is the entry's values becoming Lua
# strings: a copy of the header alone costs nearly as much.
LUA_COPY = """
local owned, foreign = {}, {}
for i = 7, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p == 0 then foreign[#foreign + 1] = ARGV[i] else owned[#owned + 1] = ARGV[i] end
end
for _, id in ipairs(owned) do
  local entry = redis.call('XRANGE', KEYS[1], id, id)[1]
  local args = {'MAXLEN', '~', ARGV[6], '*', 'source_id', id, 'train_step', ARGV[4], 'trained_at', ARGV[5]}
  for j = 1, #entry[2] do args[#args + 1] = entry[2][j] end
  redis.call('XADD', KEYS[3], unpack(args))
end
if #owned > 0 then
  redis.call('XACK', KEYS[1], ARGV[1], unpack(owned))
  redis.call('XDEL', KEYS[1], unpack(owned))
  redis.call('HINCRBY', KEYS[2], ARGV[3], #owned)
end
return {foreign, redis.call('XLEN', KEYS[3]), 0}
"""


def group_fields() -> codec.Fields:
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            prompt_ids=rng.integers(0, 32_000, PROMPT_TOKENS),
            response_ids=rng.integers(0, 32_000, RESPONSE_TOKENS),
            logprobs=-rng.random(RESPONSE_TOKENS, dtype=np.float32),
            response_versions=np.zeros(RESPONSE_TOKENS, dtype=np.int32),
            finish_reason="stop",
            reward={"score": float(i % 2)},
            text="x" * 400,
        )
        for i in range(SAMPLES)
    ]
    prompt = Prompt(uid="q", task=TASK, prompt="What is 2 + 3?", meta={"answer": "5"})
    return codec.encode_group(Group.for_prompt(prompt, samples=samples, producer="bench"))


def until(condition: Callable[[], object], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--train-ms", type=float, default=1000.0, help="the step's training time")
    parser.add_argument("--quick", action="store_true", help="a smoke size: a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batch = 4, 16
    fields = group_fields()
    folder = Path(tempfile.mkdtemp(prefix="rollstream-bench-archive-"))
    with EmbeddedRedis() as server:
        buffers = {}
        archiver = None
        for way in WAYS:
            run = f"bench-archive-{way.replace('_', '-')}"
            archive = {"keep": 0 if way in ("plain", "client_copy") else 100_000, "dir": str(folder / way)}
            settings = load_settings(
                run=run, redis={"url": server.url}, tasks=[{"name": TASK, "n": SAMPLES}], archive=archive
            )
            buffer = open_buffer(connect(settings.redis), settings, TRAINER_CONSUMER)
            buffer.ensure(TASK)
            if way == "lua_copy":
                buffer.scripts.commit_logged = buffer.client.register_script(LUA_COPY)
            if way == "archiving":
                env = {
                    **os.environ,
                    "ROLLSTREAM_RUN": run,
                    "ROLLSTREAM_REDIS__URL": server.url,
                    "ROLLSTREAM_TASKS": json.dumps([{"name": TASK, "n": SAMPLES}]),
                    "ROLLSTREAM_ARCHIVE__KEEP": "100000",
                    "ROLLSTREAM_ARCHIVE__DIR": str(folder / way),
                    "ROLLSTREAM_ARCHIVE__FLUSH_S": "1",
                }
                archiver = subprocess.Popen(
                    [sys.executable, "-m", "rollstream.cli.main", "-q", "archive"], env=env, cwd=folder
                )
                alive, client = buffer.keys.alive(Role.ARCHIVER, ARCHIVER_CONSUMER), buffer.client
                until(lambda: client.exists(alive), "the archiver to start")  # noqa: B023 (called at once)
            buffers[way] = buffer
        commit: dict[str, list[float]] = {way: [] for way in WAYS}
        read: dict[str, list[float]] = {way: [] for way in WAYS}
        try:
            for r in range(args.rounds):
                for way in WAYS if r % 2 == 0 else tuple(reversed(WAYS)):
                    buffer = buffers[way]
                    pipe = buffer.client.pipeline(transaction=False)
                    for _ in range(args.batch):
                        pipe.xadd(buffer.keys.groups(TASK), fields)  # type: ignore[arg-type]
                    pipe.execute()
                    start = time.perf_counter()
                    batch = buffer.read_batch(TASK, args.batch)
                    read[way].append(time.perf_counter() - start)
                    assert len(batch) == args.batch
                    start = time.perf_counter()
                    if way == "client_copy":
                        settles = [
                            Settle(
                                item.entry, None, None, progress_field(TASK, Count.CONSUMED),
                                log=(buffer.keys.trained(TASK), {
                                    "source_id": item.entry.id, "train_step": r + 1,
                                    "trained_at": repr(time.time()), "trained_by": buffer.consumer,
                                    **{k.decode(): v for k, v in item.entry.fields.items()},
                                }),
                            )
                            for item in batch.items
                        ]  # fmt: skip
                        assert None not in buffer.streams.settle_many(settles)
                    else:
                        assert buffer.commit(batch, r + 1) == []
                    commit[way].append(time.perf_counter() - start)
                    if way != "archiving":  # the archiver's part, untimed: Redis's memory stays level
                        buffer.client.delete(buffer.keys.trained(TASK))
                        buffer.client.xtrim(buffer.keys.groups(TASK), maxlen=0)
            logged = buffers["archiving"]
            until(lambda: logged.client.xlen(logged.keys.trained(TASK)) == 0, "the archiver to catch up")
        finally:
            if archiver is not None:
                archiver.send_signal(signal.SIGTERM)
                archiver.wait(timeout=60)
    train_s = args.train_ms / 1e3
    step_s = {way: spread([c + rd + train_s for c, rd in zip(commit[way], read[way], strict=True)])
              for way in WAYS}  # fmt: skip
    files = list((folder / "archiving").rglob("*.parquet"))
    print(f"the archiver wrote {len(files)} files of the 'archiving' way's groups meanwhile")
    base = step_s["plain"]["median"]
    print(f"a step: read + commit {args.batch} groups of {SAMPLES} x {RESPONSE_TOKENS} tokens + "
          f"{args.train_ms:.0f} ms of training, {args.rounds} rounds")  # fmt: skip
    result: dict[str, object] = {"batch": args.batch, "train_ms": args.train_ms, "rounds": args.rounds}
    for way in WAYS:
        per_group = spread([t / args.batch * 1e6 for t in commit[way]])
        overhead = step_s[way]["median"] / base - 1
        result[way] = {"commit_us_per_group": per_group, "step_s": step_s[way], "step_overhead": overhead}
        print(f"  {way:12s} commit {show(per_group)} µs per group; step {overhead:+.2%} against plain")
    result["archive_step_overhead"] = result["archiving"]["step_overhead"]  # type: ignore[index]
    result["archived_files"] = len(files)
    write_json(result, RESULTS / "archive.json")


if __name__ == "__main__":
    main()
