"""Sentinels that disagree on the primary (one has not heard of the last failover yet):
a redis+sentinel:// client goes to the primary of the newest failover, the highest
config epoch, whichever Sentinel it asks first. Real redis-servers and Sentinels on free
ports; the disagreement is set up with each Sentinel's own config file."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.sentinel import Sentinel

from rollstream.shared import redis_sentinel
from rollstream.shared.connection import connect
from rollstream.shared.embedded import find_redis_server
from rollstream.shared.redis_sentinel import NewestSentinel
from rollstream.shared.settings import RedisSettings
from tests.ha import REPL_USER, SERVICE, Node, SentinelSet
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def disagreeing(tmp_path: Path) -> Iterator[tuple[Node, Node, Node, Node]]:
    """(old primary, new primary, a lagging Sentinel naming the old one at epoch 0, an
    up-to-date Sentinel naming the new one at epoch 3). Both data nodes are up and say
    they are primaries, as an old primary restarted before it was made a replica does."""
    binary = find_redis_server()
    old = Node(binary, tmp_path / "old", ["--save", "", "--appendonly", "no"]).start()
    new = Node(binary, tmp_path / "new", ["--save", "", "--appendonly", "no"]).start()
    nodes = [old, new]
    try:
        lagging = Node(binary, tmp_path / "s-lagging", ["--sentinel"])
        lagging.start(f"sentinel monitor {SERVICE} 127.0.0.1 {old.port} 1\n")
        nodes.append(lagging)
        current = Node(binary, tmp_path / "s-current", ["--sentinel"])
        epoch = f"sentinel config-epoch {SERVICE} 3\nsentinel down-after-milliseconds {SERVICE} 500\n"
        current.start(f"sentinel monitor {SERVICE} 127.0.0.1 {new.port} 1\n{epoch}")
        nodes.append(current)
        yield old, new, lagging, current
    finally:
        for node in reversed(nodes):
            node.stop()


def _epochs(sentinel: Node) -> int:
    client = sentinel.client()
    try:
        return int(client.sentinel_master(SERVICE)["config-epoch"])
    finally:
        client.close()


def test_the_newest_failover_wins_whichever_sentinel_answers_first(
    disagreeing: tuple[Node, Node, Node, Node],
) -> None:
    old, new, lagging, current = disagreeing
    assert (_epochs(lagging), _epochs(current)) == (0, 3)
    order = [("127.0.0.1", lagging.port), ("127.0.0.1", current.port)]
    # redis-py's own choice: the first Sentinel that names a primary it sees up
    assert Sentinel(order).discover_master(SERVICE) == ("127.0.0.1", old.port)  # type: ignore[no-untyped-call]
    for hosts in (order, order[::-1]):
        assert NewestSentinel(hosts).discover_master(SERVICE) == ("127.0.0.1", new.port)
    # and a process's client, by the URL, writes to the new primary only
    url = f"redis+sentinel://127.0.0.1:{lagging.port},127.0.0.1:{current.port}/{SERVICE}/0"
    client = connect(RedisSettings(url=url), check=False)
    try:
        client.set("written", "here")
    finally:
        client.close()
    for node, expected in ((new, b"here"), (old, None)):
        plain = node.client()
        try:
            assert plain.get("written") == expected
        finally:
            plain.close()


def test_a_newer_primary_that_looks_down_is_waited_for_not_passed_over(
    disagreeing: tuple[Node, Node, Node, Node],
) -> None:
    """The up-to-date Sentinel sees the new primary down (gone, or a moment's stall on a
    loaded machine), the lagging one sees the old primary up: the old config's answer
    does not win; the client waits (no primary, an outage ridden out) instead."""
    old, new, lagging, current = disagreeing
    new.kill()
    wait_for(lambda: _state(current)["is_sdown"], timeout=10)
    order = [("127.0.0.1", lagging.port), ("127.0.0.1", current.port)]
    assert Sentinel(order).discover_master(SERVICE) == ("127.0.0.1", old.port)  # type: ignore[no-untyped-call]
    for hosts in (order, order[::-1]):
        with pytest.raises(redis.sentinel.MasterNotFoundError, match="up at config epoch 3, the newest"):
            NewestSentinel(hosts).discover_master(SERVICE)


def test_no_sentinel_naming_a_primary_is_a_clear_error(disagreeing: tuple[Node, Node, Node, Node]) -> None:
    _, _, lagging, current = disagreeing
    both = NewestSentinel([("127.0.0.1", lagging.port), ("127.0.0.1", current.port)])
    with pytest.raises(redis.sentinel.MasterNotFoundError, match="'elsewhere'"):
        both.discover_master("elsewhere")


def test_a_sentinel_that_does_not_answer_is_left_out_for_a_while(
    disagreeing: tuple[Node, Node, Node, Node],
) -> None:
    _, new, lagging, current = disagreeing
    sentinels = NewestSentinel([("127.0.0.1", current.port), ("127.0.0.1", lagging.port)])
    sentinels.CACHE_S = 0.0  # every look asks
    asked: list[int] = []

    def gone() -> dict[str, Any]:  # a Sentinel on a lost machine: a timeout each time
        asked.append(1)
        raise redis.TimeoutError("Timeout connecting to server")

    sentinels.sentinels[1].sentinel_masters = gone  # type: ignore[method-assign]
    for _ in range(3):
        assert sentinels.discover_master(SERVICE) == ("127.0.0.1", new.port)
    assert asked == [1]  # asked once, then left out while the other answers
    # when no Sentinel that answers names a primary, the left-out ones are asked again
    client = current.client()
    try:
        client.execute_command("SENTINEL", "REMOVE", SERVICE)
    finally:
        client.close()
    with pytest.raises(redis.sentinel.MasterNotFoundError, match=f"Sentinel 127.0.0.1:{lagging.port}: "):
        sentinels.discover_master(SERVICE)
    assert asked == [1, 1]


def _state(sentinel: Node) -> dict[str, Any]:
    client = sentinel.client()
    try:
        return dict(client.sentinel_master(SERVICE))
    finally:
        client.close()


def _leading_with_old_primary_up(ha: SentinelSet, old: Node) -> Node | None:
    """The Sentinel still leading the failover while it sees the old primary up again."""
    for sentinel in ha.sentinels:
        state = _state(sentinel)
        flags = str(state["flags"])
        if "failover_in_progress" in flags and not state["is_sdown"] and int(state["port"]) == old.port:
            return sentinel
    return None


def test_a_sentinel_still_leading_a_failover_does_not_send_clients_to_the_old_primary() -> None:
    """The Sentinel that leads a failover names the old primary in SENTINEL MASTERS, at the
    new config epoch, until its failover ends (here it cannot: neither replica lets the
    other sync from it, so reconfiguring the second replica waits out a long
    failover-timeout). The old primary restarted empty is up and says it is a primary: a
    client asking that Sentinel first went there, and a process found its run gone."""
    ha = SentinelSet(replicas=2, failover_timeout_ms=120_000).start()
    try:
        for replica in ha.data[1:]:
            client = replica.client()
            try:
                client.execute_command("ACL", "SETUSER", REPL_USER, "off")
            finally:
                client.close()
        old, new = ha.fail_over_by_kill()
        old.start()  # back at once, empty, a primary until the Sentinels make it a replica
        leader = wait_for(lambda: _leading_with_old_primary_up(ha, old), timeout=30)
        state = _state(leader)
        assert int(state["config-epoch"]) >= 1, state
        order = [("127.0.0.1", s.port) for s in [leader, *(s for s in ha.sentinels if s is not leader)]]
        # redis-py's own choice, the leading Sentinel asked first: the old, empty primary
        assert Sentinel(order).discover_master(SERVICE) == ("127.0.0.1", old.port)  # type: ignore[no-untyped-call]
        for hosts in (order, order[::-1]):
            assert NewestSentinel(hosts).discover_master(SERVICE) == ("127.0.0.1", new.port)
        # with only the leading Sentinel to ask: its promoted replica
        assert NewestSentinel(order[:1]).discover_master(SERVICE) == ("127.0.0.1", new.port)
        assert _leading_with_old_primary_up(ha, old) is leader  # the failover had not ended meanwhile
    finally:
        ha.stop()


def test_an_older_config_than_one_seen_is_not_taken_while_a_sentinel_does_not_answer(
    disagreeing: tuple[Node, Node, Node, Node],
) -> None:
    """A process has followed the failover of epoch 3; the one Sentinel that knows of it
    stops answering (its machine stalls), the other still names the old primary, up again
    and empty: the client waits instead of going back to it. Once every Sentinel answers
    with the older config (the set was reset), that config is the set's and is taken."""
    old, new, lagging, current = disagreeing
    hosts = [("127.0.0.1", current.port), ("127.0.0.1", lagging.port)]
    first = NewestSentinel(hosts)
    assert first.discover_master(SERVICE) == ("127.0.0.1", new.port)

    def stalled() -> dict[str, Any]:
        raise redis.TimeoutError("Timeout reading from socket")

    second = NewestSentinel(hosts)  # the process's next client
    for sentinel in (first, second):
        sentinel.CACHE_S = 0.0
        sentinel.sentinels[0].sentinel_masters = stalled  # type: ignore[method-assign]
        for _ in range(2):  # asked afresh, then with the silent one left out
            with pytest.raises(redis.sentinel.MasterNotFoundError, match="older than epoch 3 seen before"):
                sentinel.discover_master(SERVICE)
    # a process that never saw epoch 3 has nothing to hold it back
    seen = dict(redis_sentinel._EPOCHS)
    redis_sentinel._EPOCHS.clear()
    assert second.discover_master(SERVICE) == ("127.0.0.1", old.port)
    redis_sentinel._EPOCHS.update(seen)
    # the set reset to the old primary: every Sentinel answers epoch 0, which is taken
    client = current.client()
    try:
        client.execute_command("SENTINEL", "REMOVE", SERVICE)
        client.execute_command("SENTINEL", "MONITOR", SERVICE, "127.0.0.1", old.port, 1)
    finally:
        client.close()
    del first.sentinels[0].sentinel_masters  # answers again
    first._failed_at.clear()
    assert _epochs(current) == 0
    assert first.discover_master(SERVICE) == ("127.0.0.1", old.port)


def test_a_sentinel_that_holds_the_line_silent_is_asked_once_per_look(
    disagreeing: tuple[Node, Node, Node, Node],
) -> None:
    """A Sentinel whose machine stalls: it takes the connection and never answers. A look
    asks it once and goes on with the others; redis-py 8's own retries (10, each after a
    timeout) made every look of every process wait 11 timeouts on it."""
    _, new, _, current = disagreeing
    listener = socket.create_server(("127.0.0.1", 0))
    silent_port = listener.getsockname()[1]
    accepted: list[socket.socket] = []

    def take() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=take, daemon=True).start()
    url = f"redis+sentinel://127.0.0.1:{silent_port},127.0.0.1:{current.port}/{SERVICE}/0"
    # 1 s: the live Sentinel answers well within it on a loaded machine (were it timed out
    # too, the next look would ask both again and count the silent one twice)
    client = connect(RedisSettings(url=url, socket_timeout_s=1.0), check=False)
    try:
        client.set("written", "here")
        assert client.get("written") == b"here"
    finally:
        client.close()
        listener.close()
        for conn in accepted:
            conn.close()
    plain = new.client()
    try:
        assert plain.get("written") == b"here"
    finally:
        plain.close()
    assert len(accepted) == 1
