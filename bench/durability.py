"""What durable commits cost: the same produce-and-train cycle on a redis-server with
its append-only file fsynced every second (deploy/redis.conf) and on every write
(appendfsync always), measured side by side, interleaved, in one run.

With everysec a crash of redis-server (kill -9, a lost machine) may take the last
second of writes with it: a trainer commit in that second comes back as pending
groups. With always, nothing acknowledged is lost. The ratio always / everysec is
what that costs in groups per second on this machine's disk.

The same cycle on a primary with one replica (no append-only file), the trainer's reads
and commits waiting for the replica (redis.wait_replicas 1: WAIT behind a write of its
own, consumer/replication.py) or not: the ratio wait / no wait is what a failover-proof
commit costs (README "Redis high availability").

    python bench/durability.py [--groups 600] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from common import RESULTS, show, spread, write_json

from rollstream.consumer.replication import wait_for_replicas
from rollstream.shared.embedded import find_redis_server, free_port
from rollstream.shared.keys import TRAINER_CONSUMER
from rollstream.shared.records import Group, Prompt, Sample
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings

MODES = ("everysec", "always")
WAIT_MODES = ("no_wait", "wait")


class Server:
    def __init__(self, fsync: str, folder: Path, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        persist = ("--appendonly", "yes", "--appendfsync", fsync) if fsync else ("--appendonly", "no")
        self.proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *persist, "--dir", str(folder), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def prompts(count: int) -> list[Prompt]:
    return [Prompt(uid=f"u{i}", task="math", prompt=f"What is {i} + 1?") for i in range(count)]


def group_for(prompt: Prompt, n: int, tokens: int) -> Group:
    samples = [
        Sample(
            prompt_ids=list(range(64)),
            response_ids=list(range(tokens)),
            logprobs=[-0.5] * tokens,
            response_versions=[0] * tokens,
            finish_reason="stop",
            reward={"score": float(i % 2)},
        )
        for i in range(n)
    ]
    return Group.for_prompt(prompt, samples=samples)


def cycle(url: str, run: str, groups: int, tokens: int, wait_replicas: int = 0) -> float:
    """Groups per second through feed -> claim -> complete -> read -> commit; with
    ``wait_replicas``, each read and commit then waits for that many replicas."""
    settings = load_settings(
        run=run, redis={"url": url, "wait_replicas": wait_replicas}, tasks=[{"name": "math", "n": 8}]
    )
    client = redis.Redis.from_url(url)
    producer = open_buffer(client, settings, "producer")
    trainer = open_buffer(client, settings, TRAINER_CONSUMER)
    producer.feed(prompts(groups))
    started = time.perf_counter()
    done = 0
    while done < groups:
        for claim in producer.claim("math", 16):
            producer.complete(claim, group_for(claim.prompt, n=8, tokens=tokens))
        batch = trainer.read_batch("math", 16)
        wait_for_replicas(client, trainer.keys, settings.redis, "a read")
        trainer.commit(batch)
        wait_for_replicas(client, trainer.keys, settings.redis, "a commit")
        done += len(batch.items)
    return groups / (time.perf_counter() - started)


def replicated(groups: int, repeats: int, tokens: int) -> dict[str, list[float]]:
    """Groups per second on a primary with one replica, the trainer waiting for it or not,
    interleaved on the same pair of servers."""
    rates: dict[str, list[float]] = {m: [] for m in WAIT_MODES}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "primary").mkdir()
        (Path(tmp) / "replica").mkdir()
        primary = Server("", Path(tmp) / "primary")
        replica = Server("", Path(tmp) / "replica", ("--replicaof", "127.0.0.1", str(primary.port)))
        try:
            client = redis.Redis.from_url(primary.url)
            deadline = time.monotonic() + 30
            while client.info("replication").get("slave0", {}).get("state") != "online":
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not connect to the primary within 30 s")
                time.sleep(0.05)
            for r in range(repeats):
                for mode in WAIT_MODES if r % 2 == 0 else reversed(WAIT_MODES):
                    wanted = 1 if mode == "wait" else 0
                    rates[mode].append(cycle(primary.url, f"w{r}{mode}", groups, tokens, wanted))
        finally:
            replica.stop()
            primary.stop()
    return rates


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=600)
    parser.add_argument("--tokens", type=int, default=512, help="response tokens per sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    groups, repeats = (100, 1) if args.quick else (args.groups, args.repeats)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            (Path(tmp) / mode).mkdir()
        servers = {m: Server(m, Path(tmp) / m) for m in MODES}
        try:
            for r in range(repeats):  # interleaved: both modes see the same machine state
                for mode in MODES if r % 2 == 0 else reversed(MODES):
                    rates[mode].append(cycle(servers[mode].url, f"d{r}{mode}", groups, args.tokens))
        finally:
            for server in servers.values():
                server.stop()
    ratios = [a / e for a, e in zip(rates["always"], rates["everysec"], strict=True)]
    waits = replicated(groups, repeats, args.tokens)
    wait_ratios = [w / n for w, n in zip(waits["wait"], waits["no_wait"], strict=True)]
    result: dict[str, Any] = {
        "groups_per_s": {m: spread(v) for m, v in rates.items()},
        "ratio_always_vs_everysec": spread(ratios),
        "replicated_groups_per_s": {m: spread(v) for m, v in waits.items()},
        "ratio_wait_vs_no_wait": spread(wait_ratios),
        "groups": groups,
        "tokens_per_sample": args.tokens,
    }
    print(f"everysec: {show(result['groups_per_s']['everysec'], '.0f')} groups/s")
    print(f"always:   {show(result['groups_per_s']['always'], '.0f')} groups/s")
    print(f"always / everysec: {show(result['ratio_always_vs_everysec'])}")
    print(f"primary + replica, no WAIT: {show(result['replicated_groups_per_s']['no_wait'], '.0f')} groups/s")
    print(f"primary + replica, WAIT 1:  {show(result['replicated_groups_per_s']['wait'], '.0f')} groups/s")
    print(f"WAIT / no WAIT: {show(result['ratio_wait_vs_no_wait'])}")
    write_json(result, RESULTS / "durability.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
