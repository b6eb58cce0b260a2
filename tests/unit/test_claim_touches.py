"""Which held claims a producer's beat renews (producer/heartbeat.py ClaimTouches): each
once held a third of claim_idle_ms, so that its idle time never nears claim_idle_ms; every
claim at every beat when claim_idle_ms is under six beats. An injected clock."""

from __future__ import annotations

from rollstream.producer.heartbeat import ClaimTouches
from rollstream.shared.keys import PROMPTS
from rollstream.shared.streams import Entry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(i: int) -> Entry:
    return Entry(stream="rs:{r}:prompts:math", id=f"1-{i}", fields={}, kind=PROMPTS, task="math")


def test_a_claim_is_renewed_once_held_a_third_of_claim_idle_and_never_nears_it() -> None:
    clock, beat_s, idle_ms = Clock(), 2.0, 60_000
    touches = ClaimTouches(idle_ms, beat_s, clock)
    assert touches.every_s == 20.0
    a, b = entry(1), entry(2)
    claimed = {a.id: clock.now - beat_s}  # claimed up to a beat before the beat that sees it
    renewed: dict[str, float] = dict(claimed)
    for beat in range(200):  # 400 s of beats; b comes at the 5th, a goes at the 150th
        held = [e for e in (a, b) if (e is a and beat < 150) or (e is b and beat >= 5)]
        if beat == 5:
            claimed[b.id] = renewed[b.id] = clock.now - beat_s
        for due in touches.due(held):
            renewed[due.id] = clock.now
        for e in held:  # the claim's idle time as Redis sees it, at each beat
            assert clock.now - renewed[e.id] <= touches.every_s + 2 * beat_s < idle_ms / 1000
        clock.now += beat_s
    assert renewed[a.id] > claimed[a.id] and renewed[b.id] > claimed[b.id]


def test_a_group_done_within_a_third_of_claim_idle_is_never_renewed() -> None:
    clock = Clock()
    touches = ClaimTouches(60_000, 2.0, clock)
    a = entry(1)
    due = []
    for _ in range(9):  # 18 s < 20 s
        due += touches.due([a])
        clock.now += 2.0
    assert due == []
    assert touches.due([]) == [] and touches._since == {}  # a settled claim is forgotten
    clock.now += 30.0
    assert touches.due([a]) == []  # the same id claimed again starts over


def test_with_a_short_claim_idle_every_claim_is_renewed_at_every_beat() -> None:
    clock = Clock()
    touches = ClaimTouches(500, 0.1, clock)  # a third of 0.5 s is under two beats
    assert touches.every_s == 0.0
    a, b = entry(1), entry(2)
    assert touches.due([a, b]) == [a, b]
    clock.now += 0.1
    assert touches.due([a, b]) == [a, b]
