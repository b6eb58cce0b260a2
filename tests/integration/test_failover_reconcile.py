"""What a Sentinel failover that loses the last writes leaves behind, reconciled: a
primary, a replica and three Sentinels (real servers on free ports); the replica is cut
off, a producer settles, a feed is appended and the trainer reads, commits and publishes
a weight sync on the primary alone, then the primary is killed. The processes go on with
what they remember: the counters agree with the streams at once and at the end, every
consumer-group entry pending is in its stream, every uid is accounted for (a weight sync
that a failover took is published again by a waiting trainer: the test below). Without the commit
WAIT (wait-off) the failover takes a commit of the trainer's with its groups: the trainer
cannot put it back and stops, marking the run rewound, instead of training on."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollstream.cli.status import run_status, stream_keys
from rollstream.consumer.assembly import create_trainer
from rollstream.consumer.batches import TrainBatch
from rollstream.consumer.trainer import TrainLog
from rollstream.consumer.weights import publish_weights
from rollstream.producer.feeder import Feeder
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.errors import RunRewound
from rollstream.shared.events import WEIGHT_SYNC
from rollstream.shared.keys import GROUP_OF_KIND, REWOUND, Count, Keys, progress_field
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from rollstream.shared.streams import text
from tests.ha import SentinelSet
from tests.helpers import group_for, prompts, wait_for

pytestmark = pytest.mark.integration

FED = 10  # prompts u0 .. u9; u8 and u9 are fed while the replica is cut off
STEPS = 6  # step 1 before the cut, step 2 on the old primary alone, 3 .. 6 after the failover


@pytest.fixture
def sentinels() -> Iterator[SentinelSet]:
    ha = SentinelSet().start()
    yield ha
    ha.stop()


def disagreements(client: redis.Redis, keys: Keys, task: str) -> list[str]:
    """What the run's counters and consumer groups say that its streams do not."""
    status = run_status(client, keys)
    account = status.accounts[task]
    out = []
    if account.lost or account.not_fed:
        out.append(f"account of {task}: {account}")
    fed = int(client.hget(keys.progress, progress_field(task, Count.FED)) or 0)
    if fed != client.scard(keys.fed(task)):
        out.append(f"fed counter {fed} but {client.scard(keys.fed(task))} uids in {keys.fed(task)}")
    for key, kind, _ in stream_keys(client, keys):
        ids = {text(i) for i, _ in client.xrange(key)}
        group = GROUP_OF_KIND[kind]
        for p in client.xpending_range(key, group, min="-", max="+", count=10_000):
            if text(p["message_id"]) not in ids:
                out.append(
                    f"{key}: {text(p['message_id'])} pending for {text(p['consumer'])}, not in the stream"
                )
    return out


def produce(producer: ReplayBuffer, count: int, model_step: int) -> list[str]:
    """Claim up to ``count`` prompts and settle each with a group; the uids settled."""
    done = []
    for claim in producer.claim("math", count, include_expired=True):
        if producer.complete(claim, group_for(claim.prompt, step=model_step)) is not None:
            done.append(claim.prompt.uid)
    return done


@pytest.mark.parametrize("wait_replicas", [0, 1], ids=["wait-off", "wait-on"])
def test_a_failover_that_loses_the_last_writes_is_reconciled(
    sentinels: SentinelSet, run_name: str, caplog: pytest.LogCaptureFixture, wait_replicas: int
) -> None:
    """Without redis.wait_replicas the trainer's step 2 is committed on the old primary
    alone, and its groups are trained again after the failover; with it, the read of step
    2 waits for the replica, and after the failover the batch leaves out what the new
    primary forgot: nothing is trained twice."""
    ha = sentinels
    steps = STEPS if not wait_replicas else STEPS - 1  # with WAIT no step is lost
    settings = load_settings(
        run=run_name,
        redis={"url": ha.url, "outage_limit_s": 60, "wait_replicas": wait_replicas},
        tasks=[{"name": "math", "n": 2}],
        rollout={"batch_size": 2},
        buffer={"claim_idle_ms": 5000},  # a claim outlives the waits before its settle under load
    )
    keys = Keys(run_name)
    producer = open_buffer(connect(settings.redis), settings, "p")
    producer.feed(prompts("math", FED - 2))
    trainer = create_trainer(settings, client=connect(settings.redis), step_time_s=0.05, consumer="trainer")
    reads: dict[int, list[str]] = {}
    committed: list[tuple[int, list[str]]] = []  # each commit the trainer saw succeed

    def record(step: int, batch: TrainBatch | None) -> None:
        if batch is not None:
            reads[step] = [g.group_id for g in batch.groups]
        else:
            committed.append((step, reads.pop(step)))

    trainer.on_commit = record
    result: list[TrainLog | BaseException] = []

    def train() -> None:
        try:
            result.append(trainer.run(steps))
        except BaseException as exc:  # handed to the test's thread
            result.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    with caplog.at_level(logging.INFO):
        thread.start()
        try:
            # Given step 1 trained, its weights published and everything on the replica
            assert len(produce(producer, 2, 0)) == 2
            wait_for(lambda: ha.primary().client().hget(keys.state, "model_step") == b"1", timeout=20)
            held = producer.claim("math", 2)  # claimed now, settled while the replica is cut off
            assert len(held) == 2
            wait_for(lambda: ha.replicas_in_sync(1) and _offsets_equal(ha), timeout=20)
            # When the replica stops getting the primary's writes: the producer settles those
            # claims, the trainer reads them, trains step 2, commits it and publishes its
            # weights (without WAIT; with it, the read waits for the replica); a feed is
            # appended and another prompt claimed, all on the old primary
            ha.hold_replication()
            for claim in held:
                assert producer.complete(claim, group_for(claim.prompt, step=1)) is not None
            old = ha.primary()
            if wait_replicas:
                wait_for(lambda: "replicas acknowledged it within" in caplog.text, timeout=20)
                assert [step for step, _ in committed] == [1]
            else:
                wait_for(lambda: old.client().hget(keys.state, "model_step") == b"2", timeout=20)
                assert [step for step, _ in committed] == [1, 2]
            assert producer.feed(prompts("math", 2, start=FED - 2)).added == 2
            (lost_claim,) = producer.claim("math", 1)
            # and the primary dies: the Sentinels promote the replica that has none of it
            _, new = ha.fail_over_by_kill()
            client = new.client()
            if wait_replicas:
                ha.bring_back(old)  # back, empty, made a replica of the new primary: WAIT can succeed
            assert client.hget(keys.state, "train_step") == b"1"
            # Then the counters agree with the streams at once, as after an AOF restart
            assert disagreements(client, keys, "math") == []
            assert run_status(client, keys).accounts["math"].fed == FED - 2
            # a settle of a claim the failover forgot writes nothing
            assert producer.complete(lost_claim, group_for(lost_claim.prompt, step=2)) is None
            if not wait_replicas:
                # the waiting trainer finds the run behind its commit of step 2, whose groups
                # the failover took with their reads: it cannot put them back, and stops every
                # process instead of training those prompts again (shared/rewind.py)
                thread.join(timeout=60)
                assert len(result) == 1 and isinstance(result[0], RunRewound), result
                assert "holds train_step 1" in str(result[0]) and "lost acknowledged writes: step 2 " in str(
                    result[0]
                )
                assert b'committed":2' in (client.hget(keys.state, REWOUND) or b"").replace(b" ", b"")
                assert run_status(client, keys).rewound is not None
                return
            # the feeder, restarted at the cursor Redis has, feeds the lost prompts again
            assert producer.feed(prompts("math", 2, start=FED - 2)).added == 2
            # and the run goes on to its last step: the producer takes back, once idle, the
            # claims whose settles the failover lost
            deadline = time.monotonic() + 120
            while thread.is_alive():
                assert time.monotonic() < deadline, f"the run did not finish: {run_status(client, keys)}"
                # a batch at a time, on the run's weights, as the admission bound would let in
                idle = client.xlen(keys.groups("math")) == 0
                if not idle or not produce(producer, 2, int(client.hget(keys.state, "model_step") or 0)):
                    thread.join(timeout=0.05)
        finally:
            trainer.reader.close()
            thread.join(timeout=30)
    assert result and isinstance(result[0], TrainLog), result
    assert disagreements(client, keys, "math") == []
    account = run_status(client, keys).accounts["math"]
    figures = (account.fed, account.trained, account.waiting, account.in_pools, account.lost)
    assert figures == (FED, FED, 0, 0, 0), account
    assert client.hget(keys.state, "train_step") == str(steps).encode()
    for key, kind, _ in stream_keys(client, keys):
        assert client.xpending(key, GROUP_OF_KIND[kind])["pending"] == 0, key
    times = Counter(g for _, groups in committed for g in groups)
    assert set(times) == {f"math:u{i}" for i in range(FED)}
    # every uid trained once; the batch left out the groups whose read was lost
    assert set(times.values()) == {1}, committed
    assert "a failover lost their read" in caplog.text


def _offsets_equal(ha: SentinelSet) -> bool:
    info = ha.primary().client().info("replication")
    return all(
        info[f"slave{i}"]["offset"] == info["master_repl_offset"] for i in range(info["connected_slaves"])
    )


def test_a_weight_sync_an_operator_rolled_back_is_not_published_again(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    """The trainer publishes a lost weight sync again only when its event is gone too: a
    model_step set lower by `rollstream steps --model-step N --yes` leaves it in place."""
    settings = load_settings(run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}])
    trainer = create_trainer(settings, client=connect(settings.redis), step_time_s=0)
    control = trainer.reader.control
    try:
        trainer._published = (2, None, publish_weights(control, 2))
        control.publish(WEIGHT_SYNC, 1, rollback=True)  # the operator's rollback
        trainer._publish_lost_sync()
        assert control.model_step() == 1
        # the same step with its event gone (what a failover or a lost AOF second leaves)
        control.client.delete(control.keys.events)
        control.client.hset(control.keys.state, "model_step", 1)
        trainer._publish_lost_sync()
        assert control.model_step() == 2
    finally:
        trainer.reader.close()


def test_a_feeder_whose_last_writes_redis_lost_feeds_them_again(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cursor went back (the run's keys as they were before the feeder's last write,
    which is what a failover to a replica that had not got it leaves): the running feeder
    feeds on from there, and every row is fed once, where it stopped with 'is another
    feeder running?'."""
    settings = load_settings(run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "math", "n": 2}])
    client = connect(settings.redis)
    keys = Keys(run_name)
    dataset = tmp_path / "p.jsonl"
    dataset.write_text("".join(f'{{"uid": "q{i}", "prompt": "{i} + 1?"}}\n' for i in range(6)))
    feeder = Feeder(open_buffer(client, settings, "feeder"), dataset, "math", keep_ahead=2)
    appended: list[str] = []

    def take_all() -> None:  # the producers claim and settle what was fed: room for more
        appended.extend(text(f[b"uid"]) for _, f in client.xrange(keys.prompts("math")))
        client.xtrim(keys.prompts("math"), maxlen=0)

    raw, cursor = feeder.start_cursor()
    raw, cursor, fed = feeder.step(raw, cursor)
    assert fed == 2
    take_all()
    run_keys = [keys.state, keys.progress, keys.prompts("math")]
    before = {key: client.dump(key) for key in run_keys}
    raw, cursor, fed = feeder.step(raw, cursor)
    assert fed == 2 and cursor.pos == 4
    for key, dumped in before.items():  # Redis loses the second write
        assert dumped is not None
        client.restore(key, 0, dumped, replace=True)
    with caplog.at_level(logging.WARNING):
        raw, cursor, fed = feeder.step(raw, cursor)
    assert "lost this feeder's last writes" in caplog.text
    assert (fed, cursor.pos) == (2, 4)
    take_all()
    assert appended == ["q0@0", "q1@0", "q2@0", "q3@0"]
    assert client.hget(keys.progress, progress_field("math", Count.FED)) == b"4"
