"""What an archive costs the trainer: its commit, side by side, without and with the
trained log (archive.keep > 0), on one embedded Redis in one run.

Each round fills the replay buffer with a batch of groups (8 × 2,048 tokens with
logprobs, as producers write them), reads it as the trainer does and times the commit:
``plain`` is COMMIT (XACK + XDEL), ``logged`` COMMIT_LOGGED (XACK, a small entry per group
in rs:{run}:trained:{task}, the group left for the archiver to delete), and the two
designs not taken: ``lua_copy`` (the script copies each group's payload into the log, then
XACK + XDEL) and ``client_copy`` (the trainer sends the copy itself, in a fenced settle).
The ways alternate round by round so that the machine's drift hits all of them alike.

    python bench/archive.py [--rounds 30] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.common import RESULTS, show, spread
from rollstream.shared import codec
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.keys import TRAINER_CONSUMER, Count, progress_field
from rollstream.shared.records import Group, Prompt, Sample
from rollstream.shared.settings import load_settings
from rollstream.shared.streams import Settle

TASK = "math"
SAMPLES, PROMPT_TOKENS, RESPONSE_TOKENS = 8, 256, 2048
WAYS = ("plain", "logged", "lua_copy", "client_copy")
# The design not taken: the commit script copies each group's payload into the log (and
# deletes the group as without an archive). Its cost is the entry's values becoming Lua
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    fields = group_fields()
    with EmbeddedRedis() as server:
        buffers = {}
        for way in WAYS:
            keep = 0 if way in ("plain", "client_copy") else 100_000
            settings = load_settings(
                run=f"bench-archive-{way}", redis={"url": server.url}, tasks=[{"name": TASK, "n": SAMPLES}],
                archive={"keep": keep},
            )  # fmt: skip
            buffer = ReplayBuffer(connect(settings.redis), settings, TRAINER_CONSUMER)
            buffer.ensure(TASK)
            if way == "lua_copy":
                buffer.scripts.commit_logged = buffer.client.register_script(LUA_COPY)
            buffers[way] = buffer
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for r in range(args.rounds):
            for way in WAYS if r % 2 == 0 else reversed(WAYS):
                buffer = buffers[way]
                pipe = buffer.client.pipeline(transaction=False)
                for _ in range(args.batch):
                    pipe.xadd(buffer.keys.groups(TASK), fields)  # type: ignore[arg-type]
                pipe.execute()
                batch = buffer.read_batch(TASK, args.batch)
                assert len(batch) == args.batch
                start = time.perf_counter()
                if way == "client_copy":  # the trainer sends the copy itself: a fenced settle
                    settles = [
                        Settle(
                            item.entry, buffer.keys.trained(TASK),
                            {"source": item.entry.stream, "source_id": item.entry.id, "train_step": r + 1,
                             "trained_at": repr(time.time()), "trainer": buffer.consumer,
                             **{k.decode(): v for k, v in item.entry.fields.items()}},
                            progress_field(TASK, Count.CONSUMED),
                        )
                        for item in batch.items
                    ]  # fmt: skip
                    assert None not in buffer.streams.settle_many(settles)
                else:
                    assert buffer.commit(batch, r + 1) == []
                times[way].append(time.perf_counter() - start)
                # the archiver's part, not timed: Redis's memory stays level
                buffer.client.delete(buffer.keys.trained(TASK))
                buffer.client.xtrim(buffer.keys.groups(TASK), maxlen=0)
        per_group = {way: spread([t / args.batch * 1e6 for t in times[way]]) for way in WAYS}
        base = per_group["plain"]["median"]
        print(f"commit of {args.batch} groups of {SAMPLES} x {RESPONSE_TOKENS} tokens, {args.rounds} rounds")
        for way in WAYS:
            extra = (per_group[way]["median"] - base) * args.batch / 1e3
            print(
                f"  {way:7s} {show(per_group[way])} µs per group; "
                f"{extra:+.2f} ms per commit of {args.batch} against plain"
            )
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / "archive.json"
        out.write_text(json.dumps({"batch": args.batch, "per_group_us": per_group}, indent=2))
        print(f"written {out}")


if __name__ == "__main__":
    main()
