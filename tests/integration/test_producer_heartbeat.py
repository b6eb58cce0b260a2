"""One heartbeat concept: a producer's one heartbeat thread (liveness.Heartbeat) beats its
liveness key, its status in the run's state (events.ProducerStatus) and the claims it
holds on the same beat; a beat that fails ends the thread and is handed on, so that the
producer stops rather than go on without liveness."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import redis

from rollstream.producer.heartbeat import keep_beating, producer_heartbeat, stop_beating
from rollstream.shared.buffer_types import Claim
from rollstream.shared.events import ProducerStatus, RunControl
from rollstream.shared.keys import PRODUCERS, Keys
from rollstream.shared.liveness import Heartbeat, Liveness, live_processes
from tests.conftest import BufferFactory
from tests.helpers import prompts, wait_for

pytestmark = pytest.mark.integration
IDLE_MS = 300


class CountingControl(RunControl):
    published = 0

    def publish_status(self, producer: str, model_step: int, inflight: int) -> None:
        super().publish_status(producer, model_step, inflight)
        self.published += 1


def test_one_beat_renews_the_liveness_key_the_status_and_the_held_claims(
    real_buffer: BufferFactory, run_name: str
) -> None:
    # renewed once held a third of claim_idle_ms (0.15 s, three beats)
    buffer = real_buffer("p1", buffer={"claim_idle_ms": 450})
    buffer.feed(prompts("math", 1))
    (claim,) = buffer.claim("math", 1)
    client, keys = buffer.client, Keys(run_name)
    control = CountingControl(client, keys)
    liveness = Liveness(client, keys, "producer", "p1", ttl_s=30)
    inflight: dict[object, Claim] = {object(): claim}
    failures: list[BaseException] = []
    heart = producer_heartbeat(
        "p1", control, buffer, liveness, 0.05, lambda: (3, inflight, True), failures.append
    ).start()
    try:
        # Given a held claim, when the heartbeat has beaten for longer than IDLE_MS
        wait_for(lambda: control.published >= 10)  # 10 beats 0.05 s apart: 0.45 s at least
        # Then the claim's idle time was renewed on the way, and so were the status and the key
        (pending,) = client.xpending_range(keys.prompts("math"), PRODUCERS, "-", "+", 10)
        assert pending["time_since_delivered"] < IDLE_MS
        (status,) = control.producers(max_age_s=30)
        assert status == ProducerStatus("p1", 3, 1, status.ts)
        (beat,) = live_processes(client, keys)
        assert (beat.role, beat.name) == ("producer", "p1")
        assert beat.detail == {"model_step": 3, "inflight": 1, "paused": True}
    finally:
        heart.stop(clear=False)
    assert failures == []
    assert client.exists(liveness.key) == 1  # the liveness key is its process's to clear


def test_a_beat_leaves_a_young_claim_alone(real_buffer: BufferFactory, run_name: str) -> None:
    # a group that finishes within a third of claim_idle_ms costs Redis no renewal
    buffer = real_buffer("p1", buffer={"claim_idle_ms": 60_000})
    buffer.feed(prompts("math", 1))
    (claim,) = buffer.claim("math", 1)
    client, keys = buffer.client, Keys(run_name)
    control = CountingControl(client, keys)
    heart = producer_heartbeat(
        "p1", control, buffer, None, 0.05, lambda: (3, {object(): claim}, False), lambda exc: None
    ).start()
    try:
        wait_for(lambda: control.published >= 10)  # 10 beats 0.05 s apart: 0.45 s at least
    finally:
        heart.stop(clear=False)
    (pending,) = client.xpending_range(keys.prompts("math"), PRODUCERS, "-", "+", 10)
    assert pending["time_since_delivered"] >= 450  # never renewed


def gone() -> None:
    raise redis.ConnectionError("gone")


def test_a_failed_beat_ends_the_thread_and_is_handed_on() -> None:
    calls: list[int] = []
    failed = threading.Event()
    failures: list[BaseException] = []

    def also() -> None:
        calls.append(1)
        if len(calls) == 3:
            gone()

    def on_failure(exc: BaseException) -> None:
        failures.append(exc)
        failed.set()

    heart = Heartbeat(None, every_s=0.01, also=also, on_failure=on_failure, name="p1").start()
    assert failed.wait(10)
    assert [str(e) for e in failures] == ["gone"]
    heart._thread.join(5)
    assert not heart._thread.is_alive() and len(calls) == 3
    with pytest.raises(redis.ConnectionError):  # with on_failure, a beat says what failed it
        Heartbeat(None, every_s=1, also=gone, on_failure=on_failure).beat()


def test_without_on_failure_a_failed_beat_is_said_and_the_thread_beats_on() -> None:
    calls: list[int] = []

    def also() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise redis.ConnectionError("a blip")

    heart = Heartbeat(None, every_s=0.01, also=also, name="p1").start()
    try:
        wait_for(lambda: len(calls) >= 4)
    finally:
        heart.stop()
    assert heart._thread.is_alive() is False


def test_keep_beating_raises_what_failed_a_beat_and_checks_the_engines() -> None:
    checks: list[int] = []
    beats: list[int] = []

    def also() -> None:
        beats.append(1)
        if len(beats) == 40:
            raise redis.ConnectionError("Redis went away")

    async def check() -> None:
        checks.append(1)

    async def main() -> None:
        hearts: list[Heartbeat] = []

        def start(on_failure: Callable[[BaseException], None]) -> Heartbeat:
            hearts.append(Heartbeat(None, every_s=0.005, also=also, on_failure=on_failure, name="p1"))
            return hearts[0]

        with pytest.raises(redis.ConnectionError, match="Redis went away"):
            await asyncio.wait_for(keep_beating(start, 0.005, check), 30)
        await stop_beating(hearts[0])
        assert not hearts[0]._thread.is_alive()

    asyncio.run(main())
    assert len(beats) == 40 and checks  # the engines were checked every few beats meanwhile
