"""A Redis Cluster with a replica per master (real servers on free ports): the master of a
run's slot is killed (kill -9) and the cluster promotes its replica. A client rides that
out as an outage (backed off, said once), a settle's raw round trip follows the slot to
the promoted replica (after a dropped connection or a MOVED reply), WAIT works on the
run's master, and a run of producer and trainer processes goes on through the kill and
finishes with nothing lost; WAIT (redis.wait_replicas) follows the slot after the
failover, and pipelines sent during it wait for the promotion backed off."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollstream.cli.status import stream_keys
from rollstream.consumer.replication import wait_for_replicas
from rollstream.shared.connection import connect
from rollstream.shared.keys import REPLICATED, TRAIN_STEP, Keys
from rollstream.shared.liveness import Liveness, live_processes
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import Settings, load_settings
from tests.ha import Cluster
from tests.helpers import group_for, prompts, wait_for
from tests.integration.test_cluster import ROOT, _cli
from tests.integration.test_sentinel import _account, _tails, formation, wait_for_all_to_end

pytestmark = pytest.mark.integration


def _run_settings(cluster: Cluster, run_name: str) -> Settings:
    return load_settings(
        run=run_name,
        redis={"url": cluster.url, "outage_limit_s": 60},
        tasks=[{"name": "math", "n": 2}],
        rollout={"batch_size": 2},
    )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    nodes = Cluster(replicas=1).start()
    yield nodes
    nodes.stop()


@pytest.mark.timeout(180)
def test_a_settle_follows_the_runs_slot_to_the_promoted_replica(
    cluster: Cluster, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _run_settings(cluster, run_name)
    keys = Keys(run_name)
    # two producers: ``first`` works through the kill, ``late`` is idle until the old
    # master is back as a replica, its slot map still naming it
    first = open_buffer(connect(settings.redis), settings, "first")
    late = open_buffer(connect(settings.redis), settings, "late")
    first.feed(prompts("math", 8))
    mine, theirs = first.claim("math", 3), late.claim("math", 3)
    assert len(mine) == len(theirs) == 3
    assert first.complete(mine[0], group_for(mine[0].prompt))
    master, replicas = cluster.slot_nodes(keys.state)
    assert master.port not in {r.port for r in replicas}
    wait_for(lambda: cluster.in_sync(master), timeout=10)  # the claims are on the replica too

    # kill -9 of the run's master: a settle sent at once waits for the promotion (one
    # warning, not a core spinning) and lands on the replica
    with caplog.at_level(logging.INFO):
        master.kill()
        assert first.complete(mine[1], group_for(mine[1].prompt))
    assert caplog.text.count("does not answer") == 1 and "answers again after" in caplog.text
    new = cluster.node_of(keys.state)
    assert new.port in {r.port for r in replicas}
    assert len(first.claim("math", 2)) == 2  # the client's commands go there too
    assert first.complete(mine[2], group_for(mine[2].prompt))

    # the old master comes back, a replica of the new one: a round trip sent to it by a
    # client whose map still names it gets MOVED (nothing ran) and is sent again there
    master.start()
    wait_for(lambda: cluster.in_sync(new) and cluster.role(master) == "slave", timeout=30)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert late.complete(theirs[0], group_for(theirs[0].prompt))
    assert f"served by 127.0.0.1:{new.port} now (after MOVED" in caplog.text, caplog.text
    assert late.complete(theirs[1], group_for(theirs[1].prompt))

    # every settle is on the new master, and WAIT (redis.wait_replicas) works on it
    progress = new.client().hgetall(keys.progress)
    assert progress, "the new master has no progress"
    waiting = settings.redis.model_copy(update={"wait_replicas": 1})
    assert wait_for_replicas(first.client, keys, waiting, "a test write") == 1
    first.client.close()
    late.client.close()


# --- a run through a failover, as processes -------------------------------------------

PROMPTS = 120
BATCH = 4
STEPS = 12


def _env(url: str, run: str) -> dict[str, str]:
    from tests.integration.test_sentinel import _env as sentinel_env

    return sentinel_env(url, run, 0)


# about 25 s here (6 redis-servers, 3 processes): in `make test`
@pytest.mark.timeout(420)
def test_a_run_goes_on_through_a_kill_of_its_master(cluster: Cluster, run_name: str, tmp_path: Path) -> None:
    env = _env(cluster.url, run_name)
    keys = Keys(run_name)
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text(
        "".join(
            f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(PROMPTS)
        )
    )
    feed = subprocess.run(_cli("feed", str(prompts_file), "--task", "math"), env=env, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert feed.returncode == 0, feed.stderr
    record = tmp_path / "record.jsonl"

    def trainer_argv() -> list[str]:  # a restarted trainer trains the steps left
        state = connect(load_settings(run=run_name, redis={"url": cluster.url}).redis)
        try:
            left = STEPS - int(state.hget(keys.state, "train_step") or 0)
        finally:
            state.close()
        return _cli("train", "--steps", str(max(left, 1)), "--step-time", "0.2", "--record", str(record),
                    "--stop-run")  # fmt: skip

    procs = formation(trainer_argv, env, tmp_path)
    trainer = procs[-1]
    try:
        # Given a run in progress
        wait_for(
            lambda: b"trainer: step 4," in trainer.log.read_bytes() or trainer.poll() is not None, timeout=120
        )
        assert all(p.poll() is None for p in procs), _tails(procs)
        # When the master of the run's slot is killed and the cluster promotes its replica
        old, new = cluster.fail_over_by_kill(keys.state)
        # Then the run goes on to its last step and every process ends by itself
        wait_for_all_to_end(procs)
    finally:
        for p in procs:
            p.kill()
    assert [p.proc.returncode for p in procs] == [0, 0, 0], _tails(procs)
    restarts = {p.name: p.exits for p in procs}
    status = subprocess.run(_cli("status", "--json"), env=env, capture_output=True, text=True, timeout=60,
                            cwd=ROOT)  # fmt: skip
    assert status.returncode == 0, status.stderr
    result = orjson.loads(status.stdout)
    account = result["accounts"]["math"]
    rows = _account(record, PROMPTS)
    print(f"status {account}, record {rows}, restarts {restarts}, master {old.port} -> {new.port}")
    assert result["train_step"] == STEPS
    # nothing is lost: what the kill took (writes the replica had not got) is produced or
    # trained again; without WAIT a step committed on the old master alone is trained twice
    assert account["lost"] == 0, account
    assert rows.get("trained once", 0) + rows.get("trained twice, both committed", 0) >= STEPS * BATCH, rows
    assert restarts == {"producer-a": [], "producer-b": [], "trainer": []}, _tails(procs)
    logs = "".join(p.log.read_text(errors="replace") for p in procs)
    assert "does not answer" in logs and "answers again after" in logs


# --- WAIT and pipelines through a failover ---------------------------------------------


@pytest.mark.timeout(180)
def test_wait_for_replicas_follows_the_runs_slot_through_a_failover(
    cluster: Cluster, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings(
        run=run_name,
        redis={"url": cluster.url, "outage_limit_s": 60, "wait_replicas": 1, "wait_timeout_ms": 200},
    )
    keys = Keys(run_name)
    # two clients whose slot maps name the run's master: ``during`` waits while the
    # promoted replica has no replica of its own, ``after`` is used once the old master
    # is back as that replica (its map still naming it: MOVED)
    during, after = connect(settings.redis), connect(settings.redis)
    during.hset(keys.state, TRAIN_STEP, 3)
    assert after.hget(keys.state, TRAIN_STEP) == b"3"
    assert wait_for_replicas(during, keys, settings.redis, "step 3", committed_step=3) == 1
    old, new = cluster.fail_over_by_kill(keys.state)

    done: dict[str, Any] = {}

    def wait_during() -> None:
        try:
            done["acked"] = wait_for_replicas(during, keys, settings.redis, "during", committed_step=3)
        except Exception as exc:  # shown by the assertion below
            done["error"] = exc

    with caplog.at_level(logging.INFO):
        waiter = threading.Thread(target=wait_during, daemon=True)
        waiter.start()
        # it reached the promoted replica, whose WAIT counts no replica yet
        wait_for(lambda: "acknowledged it within" in caplog.text or not waiter.is_alive(), timeout=30)
        assert waiter.is_alive(), done
        old.start()  # back as a replica of the promoted one: WAIT counts it
        wait_for(lambda: not waiter.is_alive(), timeout=60)
    assert done == {"acked": 1}, done
    assert cluster.role(old) == "slave"

    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert wait_for_replicas(after, keys, settings.redis, "after", committed_step=3) == 1
    # MOVED: the barrier is sent again to the new master at once, not waited out as an outage
    assert f"served by 127.0.0.1:{new.port} now (after MOVED" in caplog.text, caplog.text
    assert "does not answer" not in caplog.text, caplog.text
    # every barrier ran on the new master, and the rejoined node holds what it wrote
    replicated = new.client().hget(keys.state, REPLICATED)
    assert replicated is not None and int(replicated) >= 3
    pipe = old.client().pipeline(transaction=False)
    pipe.execute_command("READONLY")
    pipe.hget(keys.state, REPLICATED)
    assert pipe.execute()[1] == replicated
    during.close()
    after.close()


@pytest.mark.timeout(180)
def test_pipelines_wait_out_a_failover_backed_off(
    cluster: Cluster, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _run_settings(cluster, run_name)
    keys = Keys(run_name)
    buffer = open_buffer(connect(settings.redis), settings, "first")
    buffer.feed(prompts("math", 8))
    assert len(buffer.claim("math", 3)) == 3
    assert buffer.unclaimed("math") == 5
    client = buffer.client
    events = client.xlen(keys.events)
    master, _ = cluster.slot_nodes(keys.state)
    wait_for(lambda: cluster.in_sync(master), timeout=10)

    def snapshot() -> Any:  # a MULTI of reads, like `rollstream status`'s
        pipe = client.pipeline(transaction=True)
        pipe.hget(keys.state, "paused")
        pipe.xlen(keys.prompts("math"))
        return pipe.execute()

    def pause() -> Any:  # a MULTI of writes, like a pause event's: sent once
        pipe = client.pipeline(transaction=True)
        pipe.hset(keys.state, "paused", "1")
        pipe.xadd(keys.events, {"type": "test"})
        return pipe.execute()

    calls: dict[str, Callable[[], Any]] = {
        "unclaimed": lambda: buffer.unclaimed("math"),  # a pipeline of reads
        "snapshot": snapshot,
        "pause": pause,
    }
    done: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            done[name] = calls[name]()
        except Exception as exc:  # shown by the assertion below
            done[name] = exc

    threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in calls]
    with caplog.at_level(logging.INFO):
        master.kill()
        wall, cpu = time.monotonic(), time.process_time()
        for thread in threads:
            thread.start()
        wait_for(lambda: not any(t.is_alive() for t in threads), timeout=90)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    print(f"pipelines through the failover: {wall:.1f} s, {cpu:.2f} s CPU, {done}")
    assert done["unclaimed"] == 5, done
    assert done["snapshot"][1] == 8, done
    assert done["pause"][0] == 1, done
    # they waited for the promotion (seconds), backed off: not a core spinning
    assert wall > 1.0 and cpu < 0.25 * wall, (wall, cpu)
    assert "does not answer" in caplog.text and "answers again after" in caplog.text
    # the pause was written once, on the promoted replica
    assert client.xlen(keys.events) == events + 1
    assert cluster.node_of(keys.state).port != master.port
    client.close()


@pytest.mark.timeout(180)
def test_status_asks_only_the_runs_master_and_waits_out_its_failover(
    cluster: Cluster, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`rollstream status` during failovers: its SCANs (the run's streams, its live
    processes) go to the run's master only, so another master's failover does not hold
    them, and the run's own master's failover is waited out on the promoted replica."""
    settings = _run_settings(cluster, run_name)
    keys = Keys(run_name)
    client = connect(settings.redis)
    open_buffer(client, settings, "p").feed(prompts("math", 4))
    Liveness(client, keys, "producer", "p", 600).beat()
    before = stream_keys(client, keys)
    assert before, "the run's streams"
    master, _ = cluster.slot_nodes(keys.state)
    other_key = next(k for k in (f"other{i}" for i in range(1000)) if cluster.node_of(k) is not master)
    with caplog.at_level(logging.INFO):
        cluster.node_of(other_key).kill()  # another run's master: nothing here waits for it
        assert stream_keys(client, keys) == before
        assert [p.name for p in live_processes(client, keys)] == ["p"]
        assert "does not answer" not in caplog.text
        wait_for(lambda: cluster.node_of(other_key) in cluster.live() and cluster._ok(), timeout=60)
        wait_for(lambda: cluster.in_sync(master), timeout=10)
        master.kill()  # the run's master: sent at once, the scans wait for the promotion
        assert stream_keys(client, keys) == before
        assert [p.name for p in live_processes(client, keys)] == ["p"]
    assert cluster.node_of(keys.state).port != master.port
    assert caplog.text.count("does not answer") == 1 and "answers again after" in caplog.text
