"""Process building blocks on a real redis-server: liveness keys that expire by
themselves, waiting for Redis, the run's control state and event follower, and the
prompt accounts of ``rollstream status``."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rollstream.cli.status import TaskAccount, run_status
from rollstream.shared.connection import wait_for_redis
from rollstream.shared.embedded import EmbeddedRedis, free_port
from rollstream.shared.errors import RedisUnavailable, WaitTimeout
from rollstream.shared.events import PAUSE, RESUME, STOP, WEIGHT_SYNC, Event, EventFollower, RunControl
from rollstream.shared.keys import Keys
from rollstream.shared.liveness import Heartbeat, Liveness, live_processes
from rollstream.shared.settings import RedisSettings
from tests.conftest import BufferFactory
from tests.helpers import group_for, prompts, wait_for

pytestmark = pytest.mark.integration


# --- liveness ----------------------------------------------------------------------------


def test_a_beat_shows_up_with_role_name_pid_and_detail(real_client: redis.Redis, run_name: str) -> None:
    keys = Keys(run_name)
    Liveness(real_client, keys, "producer", "p1", ttl_s=30).beat(inflight=3, model_step=2)
    (beat,) = live_processes(real_client, keys)
    assert (beat.role, beat.name) == ("producer", "p1")
    assert beat.pid == os.getpid()
    assert beat.host == socket.gethostname()
    assert beat.detail == {"inflight": 3, "model_step": 2}
    assert 0.0 <= beat.age_s < 5.0
    assert beat.started <= beat.ts


def test_live_processes_are_sorted_and_belong_to_the_run(real_client: redis.Redis, run_name: str) -> None:
    keys = Keys(run_name)
    Liveness(real_client, keys, "trainer", "t0", ttl_s=30).beat()
    Liveness(real_client, keys, "producer", "p2", ttl_s=30).beat()
    Liveness(real_client, keys, "producer", "p1", ttl_s=30).beat()
    Liveness(real_client, Keys(run_name + "x"), "producer", "other-run", ttl_s=30).beat()
    assert [(b.role, b.name) for b in live_processes(real_client, keys)] == [
        ("producer", "p1"),
        ("producer", "p2"),
        ("trainer", "t0"),
    ]


def test_a_key_with_a_short_ttl_disappears_by_itself(real_client: redis.Redis, run_name: str) -> None:
    keys = Keys(run_name)
    liveness = Liveness(real_client, keys, "engines", "e0", ttl_s=0.3)
    liveness.beat()
    ttl_ms = real_client.pttl(liveness.key)
    assert ttl_ms != -1, "the heartbeat key has no expiry"
    assert ttl_ms <= 300
    wait_for(lambda: live_processes(real_client, keys) == [], timeout=10)
    assert real_client.exists(liveness.key) == 0


def test_the_heartbeat_renews_and_stop_removes_the_key_at_once(
    real_client: redis.Redis, run_name: str
) -> None:
    keys = Keys(run_name)
    step = {"n": 0}

    def detail() -> dict[str, int]:
        step["n"] += 1
        return {"beats": step["n"]}

    heartbeat = Heartbeat(Liveness(real_client, keys, "trainer", "t0", ttl_s=2.0), detail).start()
    try:
        (first,) = live_processes(real_client, keys)  # start() beats before it returns
        assert first.detail == {"beats": 1}
        seen = set()

        def renewed_twice() -> bool:
            (beat,) = live_processes(real_client, keys)  # present at every look: renewed in time
            seen.add(beat.detail["beats"])
            return max(seen) >= 3

        wait_for(renewed_twice, timeout=20)
    finally:
        heartbeat.stop()
    assert real_client.exists(heartbeat.liveness.key) == 0
    assert live_processes(real_client, keys) == []


def test_stop_of_a_long_ttl_heartbeat_is_quick(real_client: redis.Redis, run_name: str) -> None:
    keys = Keys(run_name)
    heartbeat = Heartbeat(Liveness(real_client, keys, "feeder", "f0", ttl_s=600)).start()
    assert [b.name for b in live_processes(real_client, keys)] == ["f0"]
    started = time.monotonic()
    heartbeat.stop()
    assert time.monotonic() - started < 5  # the renewing thread wakes on stop, not after 200 s
    assert not heartbeat._thread.is_alive()
    assert live_processes(real_client, keys) == []


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b"null",
        b'{"role": "producer", "name": "x"}',  # no ts
        b'{"role": "producer", "name": "x", "ts": 1.0, "pid": "abc"}',
        b'{"role": "producer", "name": "x", "ts": 1.0, "detail": "oops"}',
    ],
)
def test_an_unreadable_heartbeat_is_skipped_not_a_crash(
    real_client: redis.Redis, run_name: str, raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(run_name)
    real_client.set(keys.alive("producer", "broken"), raw, px=30_000)
    real_client.hset(keys.alive("judge", "a-hash"), "x", "1")  # not even a string
    Liveness(real_client, keys, "producer", "ok", ttl_s=30).beat()
    with caplog.at_level(logging.WARNING, logger="rollstream.shared.liveness"):
        beats = live_processes(real_client, keys)
    assert [(b.role, b.name) for b in beats] == [("producer", "ok")]
    assert any("unreadable heartbeat" in r.getMessage() for r in caplog.records)


def test_a_heartbeat_without_redis_reports_the_failure_once(caplog: pytest.LogCaptureFixture) -> None:
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    heartbeat = Heartbeat(Liveness(client, Keys("nobody"), "producer", "p1", ttl_s=30))
    with caplog.at_level(logging.WARNING, logger="rollstream.shared.liveness"):
        assert heartbeat.beat() is False
        assert heartbeat.beat(quiet=True) is False
    warned = [r.getMessage() for r in caplog.records if r.name == "rollstream.shared.liveness"]
    assert len(warned) == 1 and warned[0].startswith("heartbeat of producer p1 failed")


# --- waiting for Redis -------------------------------------------------------------------


def test_wait_for_redis_returns_a_client_at_once(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="rollstream.shared.waiting"):
        client = wait_for_redis(RedisSettings(url=redis_server.url), timeout_s=5)
    assert client is not None
    try:
        assert client.ping() is True
    finally:
        client.close()
    assert [r for r in caplog.records if r.name == "rollstream.shared.waiting"] == []


def test_wait_for_redis_times_out_naming_the_url_without_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    settings = RedisSettings(url=f"redis://user:s3cret@127.0.0.1:{port}/0", socket_timeout_s=1.0)
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="rollstream.shared.waiting"),
        pytest.raises(WaitTimeout) as excinfo,
    ):
        wait_for_redis(settings, timeout_s=0.5)
    message = str(excinfo.value)
    assert f"redis://user:***@127.0.0.1:{port}/0" in message
    assert "s3cret" not in message
    assert time.monotonic() - started < 30
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert f"127.0.0.1:{port}" in logged
    assert "s3cret" not in logged


def test_wait_for_redis_with_stop_set_returns_none() -> None:
    stop = threading.Event()
    stop.set()
    settings = RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=1.0)
    assert wait_for_redis(settings, timeout_s=0, stop=stop) is None


def test_a_wrong_password_fails_at_once_without_showing_it(redis_server: EmbeddedRedis) -> None:
    settings = RedisSettings(url=f"redis://nobody:s3cret@127.0.0.1:{redis_server.port}/0")
    started = time.monotonic()
    with pytest.raises(RedisUnavailable) as excinfo:
        wait_for_redis(settings, timeout_s=60)
    assert time.monotonic() - started < 30  # not retried until the 60 s timeout
    assert excinfo.value.retryable is False
    assert "authentication failed" in str(excinfo.value)
    assert "s3cret" not in str(excinfo.value)
    assert f"redis://nobody:***@127.0.0.1:{redis_server.port}/0" in str(excinfo.value)


class StartOnFirstWarning(logging.Handler):
    """Starts a redis-server on ``port`` when the wait first reports that Redis is not there."""

    def __init__(self, port: int) -> None:
        super().__init__(logging.WARNING)
        self.server = EmbeddedRedis(port=port)
        self.started = False
        self.error: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.started or not record.getMessage().startswith("waiting for Redis"):
            return
        self.started = True
        try:
            self.server.start()
        except BaseException as exc:
            self.error = exc


@pytest.fixture
def late_server() -> Iterator[StartOnFirstWarning]:
    handler = StartOnFirstWarning(free_port())
    logger = logging.getLogger("rollstream.shared.waiting")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    handler.server.stop()


def test_a_server_that_starts_after_the_wait_began_is_picked_up(
    late_server: StartOnFirstWarning, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://127.0.0.1:{late_server.server.port}/0"
    with caplog.at_level(logging.INFO, logger="rollstream.shared.waiting"):
        client = wait_for_redis(RedisSettings(url=url, socket_timeout_s=2.0), timeout_s=60)
    assert late_server.started, "the wait never reported Redis missing"
    assert late_server.error is None
    assert client is not None
    try:
        client.set("picked-up", "1")
        assert client.get("picked-up") == b"1"
    finally:
        client.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "rollstream.shared.waiting"]
    assert messages[0].startswith(f"waiting for Redis at {url}:")
    assert messages[-1].startswith(f"Redis at {url}: ready after")


# --- the run's control state and events --------------------------------------------------


def test_pause_and_resume_set_and_clear_the_paused_flag(real_client: redis.Redis, run_name: str) -> None:
    keys = Keys(run_name)
    control = RunControl(real_client, keys)
    assert control.paused() is False
    start = control.last_event_id()
    control.publish(PAUSE)
    assert control.paused() is True
    assert run_status(real_client, keys).paused is True
    control.publish(WEIGHT_SYNC, 4)
    assert control.paused() is True  # other events leave the flag alone
    control.publish(RESUME)
    assert control.paused() is False
    assert run_status(real_client, keys).paused is False
    control.publish(RESUME)  # resuming a running run is harmless
    assert control.paused() is False
    assert [e.type for e in control.events(start)] == [PAUSE, WEIGHT_SYNC, RESUME, RESUME]
    assert control.model_step() == 4


def test_train_step_never_moves_backwards(real_client: redis.Redis, run_name: str) -> None:
    control = RunControl(real_client, Keys(run_name))
    assert control.train_step() == 0
    control.advance_train_step(5)
    assert control.train_step() == 5
    control.advance_train_step(3)
    assert control.train_step() == 5
    control.advance_train_step(5)
    assert control.train_step() == 5
    control.advance_train_step(12)
    assert control.train_step() == 12


def test_train_step_advanced_from_many_threads_ends_at_the_largest(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    keys = Keys(run_name)
    errors: list[BaseException] = []

    def advance(steps: list[int]) -> None:
        client = redis.Redis.from_url(redis_server.url)
        try:
            control = RunControl(client, keys)
            for step in steps:
                control.advance_train_step(step)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    # descending in every thread: a read-then-write would let a smaller step win
    threads = [threading.Thread(target=advance, args=(list(range(200 - i, 0, -4)),)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert RunControl(client, keys).train_step() == 200
    finally:
        client.close()


def test_the_follower_delivers_the_events_after_its_start_in_order(
    real_client: redis.Redis, run_name: str, followers: list[EventFollower]
) -> None:
    control = RunControl(real_client, Keys(run_name))
    control.publish(WEIGHT_SYNC, 1, uri="/ckpt/1")  # before the start: not delivered
    start = control.last_event_id()
    seen: list[Event] = []
    errors: list[BaseException] = []
    followers.append(EventFollower(control, start, seen.append, errors.append, block_ms=100).start())
    published = [
        control.publish(WEIGHT_SYNC, 2, uri="/ckpt/2"),
        control.publish(PAUSE),
        control.publish(RESUME),
        control.publish(WEIGHT_SYNC, 3, uri="/ckpt/3"),
        control.publish(STOP),
    ]
    wait_for(lambda: len(seen) >= len(published), timeout=10)
    assert [e.id for e in seen] == published
    assert [(e.type, e.model_step, e.uri) for e in seen] == [
        (WEIGHT_SYNC, 2, "/ckpt/2"),
        (PAUSE, -1, ""),
        (RESUME, -1, ""),
        (WEIGHT_SYNC, 3, "/ckpt/3"),
        (STOP, -1, ""),
    ]
    assert errors == []
    followers[0].stop()
    assert not followers[0]._thread.is_alive()


def test_a_failing_handler_reaches_on_error_and_ends_the_follower(
    real_client: redis.Redis, run_name: str, followers: list[EventFollower], caplog: pytest.LogCaptureFixture
) -> None:
    control = RunControl(real_client, Keys(run_name))
    start = control.last_event_id()
    handled: list[str] = []
    errors: list[BaseException] = []
    boom = RuntimeError("cannot load /ckpt/2")

    def handle(event: Event) -> None:
        handled.append(event.type)
        if event.type == WEIGHT_SYNC:
            raise boom

    control.publish(PAUSE)
    control.publish(WEIGHT_SYNC, 2, uri="/ckpt/2")
    control.publish(RESUME)  # after the failure: never handled
    with caplog.at_level(logging.ERROR, logger="rollstream.shared.events"):
        follower = EventFollower(control, start, handle, errors.append, block_ms=100).start()
        followers.append(follower)
        wait_for(lambda: errors, timeout=10)
        wait_for(lambda: not follower._thread.is_alive(), timeout=10)
    assert errors == [boom]
    assert handled == [PAUSE, WEIGHT_SYNC]
    assert any("handling event" in r.getMessage() and r.exc_info for r in caplog.records)
    control.publish(STOP)
    assert handled == [PAUSE, WEIGHT_SYNC]  # the thread has ended: nothing more is read


# --- prompt accounts of `rollstream status` ---------------------------------------------


def add(client: redis.Redis, stream: str, count: int) -> list[bytes]:
    return [client.xadd(stream, {"uid": f"u{i}", "data": "x"}) for i in range(count)]


def account_sum(a: TaskAccount) -> int:
    return a.trained + a.waiting + a.in_pools + a.filtered + a.dropped + a.dead + a.lost


def test_accounts_from_counters_and_streams_set_by_hand(real_client: redis.Redis, run_name: str) -> None:
    keys = Keys(run_name)
    real_client.hset(
        keys.progress,
        mapping={
            "math:fed": 10, "math:consumed": 3, "math:filtered": 1, "math:expired_dropped": 1,
            "math:dead": 1, "math:completed": 5, "math:reward_sum": 2.5, "code:fed": 2,
        },
    )  # fmt: skip
    add(real_client, keys.groups("math"), 1)
    prompt_ids = add(real_client, keys.prompts("math"), 1)
    add(real_client, keys.aborted("math"), 1)
    add(real_client, keys.expired("math"), 1)
    add(real_client, keys.prompts("code"), 2)

    accounts = run_status(real_client, keys).accounts
    assert accounts == {
        "code": TaskAccount(
            fed=2, trained=0, evaluated=0, waiting=0, in_pools=2, filtered=0, dropped=0, dead=0, lost=0
        ),
        "math": TaskAccount(
            fed=10, trained=3, evaluated=0, waiting=1, in_pools=3, filtered=1, dropped=1, dead=1, lost=0
        ),
    }

    real_client.xdel(keys.prompts("math"), *prompt_ids)  # a prompt vanishes
    math = run_status(real_client, keys).accounts["math"]
    assert (math.in_pools, math.lost) == (2, 1)
    assert math.fed == account_sum(math)


def test_accounts_follow_the_buffer_and_count_a_vanished_prompt_as_lost(
    real_buffer: BufferFactory, real_client: redis.Redis, run_name: str
) -> None:
    producer = real_buffer("producer-1", tasks=[{"name": "math", "n": 4}])
    trainer = real_buffer("trainer", tasks=[{"name": "math", "n": 4}])
    keys = Keys(run_name)
    assert producer.feed(prompts("math", 7)).added == 7
    claims = producer.claim("math", 5)
    assert len(claims) == 5
    assert producer.complete(claims[0], group_for(claims[0].prompt)) is not None
    assert producer.complete(claims[1], group_for(claims[1].prompt)) is not None
    assert producer.drop(claims[2]) is True
    assert producer.abort(claims[3]) is not None
    # claims[4] is still being produced: it stays in the prompts stream, pending
    batch = trainer.read_batch("math", 1)
    assert len(batch.items) == 1
    assert trainer.commit(batch) == []

    status = run_status(real_client, keys)
    math = status.accounts["math"]
    assert math == TaskAccount(
        fed=7, trained=1, evaluated=0, waiting=1, in_pools=4, filtered=1, dropped=0, dead=0, lost=0
    )
    prompts_stream = next(s for s in status.streams if s.key == keys.prompts("math"))
    assert (prompts_stream.length, prompts_stream.pending, prompts_stream.lag) == (3, 1, 2)

    aborted = real_client.xrange(keys.aborted("math"))
    assert len(aborted) == 1
    real_client.xdel(keys.aborted("math"), aborted[0][0])  # deleted by hand: nobody holds it now
    math = run_status(real_client, keys).accounts["math"]
    assert (math.in_pools, math.lost) == (3, 1)
    assert math.fed == account_sum(math)


def test_eval_prompts_are_not_counted_as_lost(
    real_buffer: BufferFactory, real_client: redis.Redis, run_name: str
) -> None:
    buffer = real_buffer("producer-1", tasks=[{"name": "math", "n": 4}])
    buffer.feed(prompts("math", 3))
    buffer.feed(prompts("math", 2, start=100), pool="evals")
    math = run_status(real_client, Keys(run_name)).accounts["math"]
    assert math.lost == 0, math


def test_a_heartbeat_whose_detail_fails_still_renews_the_key(real_client: redis.Redis, run_name: str) -> None:
    def broken() -> dict[str, object]:
        raise RuntimeError("the engines are being removed")

    liveness = Liveness(real_client, Keys(run_name), "engines", "e1", ttl_s=5)
    assert Heartbeat(liveness, broken).beat()
    (beat,) = live_processes(real_client, Keys(run_name))
    assert beat.name == "e1" and beat.detail == {}
