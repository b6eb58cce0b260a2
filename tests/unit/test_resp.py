"""The RESP writer of the settle path writes what redis-py would send."""

from __future__ import annotations

import numpy as np
import pytest
from redis.connection import PythonRespSerializer

from rollstream.shared.resp import CommandWriter

redis_py = PythonRespSerializer(
    buffer_cutoff=6000, encode=lambda v: v if isinstance(v, bytes) else str(v).encode()
)


def written(commands: list[tuple], flush_bytes: int = 1 << 20) -> list[bytes]:  # type: ignore[type-arg]
    sent: list[bytes] = []
    CommandWriter(flush_bytes).write(commands, lambda view: sent.append(bytes(view)))
    return sent


def packed(*args: object) -> bytes:
    return b"".join(bytes(part) for part in redis_py.pack(*args))


def test_commands_are_written_as_redis_py_packs_them() -> None:
    commands = [("XADD", "s", "*", "n", 3, "x", 1.5, "name", "é"), ("HINCRBY", b"h", "f", -2)]
    (sent,) = written(commands)
    assert sent == packed("XADD", "s", "*", "n", "3", "x", repr(1.5), "name", "é".encode()) + packed(
        "HINCRBY", b"h", "f", "-2"
    )


def test_a_tuple_of_arrays_is_one_bulk_string_of_their_bytes() -> None:
    a = np.arange(5, dtype=np.int32)
    b = np.linspace(-1, 0, 7, dtype=np.float32)
    strided = np.arange(10, dtype=np.int32)[::2]  # not contiguous: copied, same bytes
    (sent,) = written([("SET", "k", (a, b, strided, b"tail"))])
    assert sent == packed("SET", "k", a.tobytes() + b.tobytes() + strided.tobytes() + b"tail")


def test_flushes_at_the_threshold_and_reuses_its_buffer() -> None:
    big = np.arange(3000, dtype=np.int32)  # 12,000 bytes a command
    commands = [("SET", f"k{i}", big + i) for i in range(5)]
    writer = CommandWriter(flush_bytes=20_000)
    for _ in range(2):  # the second pass writes over the first one's buffer
        sent: list[bytes] = []
        keep = sent.append
        assert writer.write(commands, lambda view, keep=keep: keep(bytes(view))) == 5  # type: ignore[misc]
        assert len(sent) == 3  # after the 2nd command, the 4th, and the rest
        assert b"".join(sent) == b"".join(packed("SET", f"k{i}", (big + i).tobytes()) for i in range(5))


def test_arguments_redis_cannot_take_are_refused() -> None:
    with pytest.raises(TypeError, match="bool"):
        written([("SET", "k", True)])
    with pytest.raises(TypeError, match="dict"):
        written([("SET", "k", {"a": 1})])
