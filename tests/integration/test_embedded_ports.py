"""The embedded redis-server and a port that another process takes between our choice of
it and the server's bind: a port of our choosing is chosen again; a port the caller named
is an error that names it; a server already answering there is never taken for ours."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis

from rollstream.shared import embedded
from rollstream.shared.embedded import EmbeddedRedis, PortTaken, free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def taken() -> Iterator[int]:
    """A port this test holds, listening, as another process would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_chosen_port_taken_before_the_bind_is_chosen_again(
    taken: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given free_port's answer taken by someone else before the server binds it
    answers = iter([taken])
    monkeypatch.setattr(embedded, "free_port", lambda: next(answers, None) or free_port())
    server = EmbeddedRedis()
    assert server.port == taken
    # When it starts
    with server:
        # Then it runs on another port, and what answers there is this server
        assert server.port != taken
        client = redis.Redis(port=server.port)
        assert int(client.info("server")["process_id"]) == server.pid
        client.close()


def test_a_named_port_that_is_taken_is_an_error_that_names_it(taken: int) -> None:
    with pytest.raises(PortTaken, match=f"port {taken} taken"):
        EmbeddedRedis(port=taken).start()


def test_another_redis_on_the_port_is_not_taken_for_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given another redis-server answering on the port ours was handed
    with EmbeddedRedis() as other:
        answers = iter([other.port])
        monkeypatch.setattr(embedded, "free_port", lambda: next(answers, None) or free_port())
        # When ours starts
        with EmbeddedRedis() as ours:
            # Then it is its own server on a port of its own (the other's PONG was not ours)
            assert ours.port != other.port
            client = redis.Redis(port=ours.port)
            assert int(client.info("server")["process_id"]) == ours.pid != other.pid
            client.close()
