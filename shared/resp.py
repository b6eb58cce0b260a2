"""Commands written as RESP into one reusable buffer, for the settle path.

A group is ~130 KiB of token arrays. Packed the usual way it is copied twice
(joined into one bytes value, then packed into one command by hiredis), and a
batch of 64 groups allocates and frees ~16 MiB per round trip, which the
allocator hands back to the kernel and faults in again: on a 2-core machine
that churn cost the producer ~90 µs per group (bench/buffer.py). Here every
argument is copied once, from its arrays straight into a buffer that is kept
and reused, and sent whenever it holds ``flush_bytes``.

An argument is bytes-like (a numpy array too: its bytes), str, int or float
(written as redis-py writes them), or a tuple of bytes-like chunks sent as one
bulk string (a field whose value is the concatenation of several arrays).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Buffer = bytes | bytearray | memoryview

FLUSH_BYTES = 1 << 20
BIG = 4096  # an argument at least this long is copied into the buffer on its own


def as_bytes(arg: Any) -> Buffer:
    """An argument as the bytes Redis receives; buffers (numpy arrays included) as a
    byte view of their memory, without a copy when they are contiguous."""
    if isinstance(arg, bytes | bytearray):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):  # bool is an int: refuse it, as redis-py does
        raise TypeError(f"cannot send a bool ({arg!r}) to Redis")
    if isinstance(arg, int):
        return b"%d" % arg
    if isinstance(arg, float):
        return repr(arg).encode()
    try:
        view = memoryview(arg)
    except TypeError:
        raise TypeError(f"cannot send a {type(arg).__name__} to Redis") from None
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


class CommandWriter:
    """RESP commands into one buffer that grows to its largest use and stays."""

    def __init__(self, flush_bytes: int = FLUSH_BYTES) -> None:
        self.flush_bytes = flush_bytes
        self._buf = bytearray(flush_bytes)
        self._pos = 0

    def write(self, commands: Iterable[tuple[Any, ...]], send: Callable[[memoryview], None]) -> int:
        """Write every command, calling ``send`` with the buffered bytes whenever they
        reach ``flush_bytes`` and once at the end; returns how many commands."""
        count = 0
        try:
            for command in commands:
                self.command(command)
                count += 1
                if self._pos >= self.flush_bytes:
                    self._send(send)
            if self._pos:
                self._send(send)
        finally:
            self._pos = 0
        return count

    def command(self, args: tuple[Any, ...]) -> None:
        # small arguments are joined into one piece; big buffers and chunk tuples are
        # copied into the buffer on their own, without an intermediate bytes object
        small: list[Buffer] = [b"*%d\r\n" % len(args)]
        for arg in args:
            kind = type(arg)
            if kind is str:
                data: Buffer = arg.encode()
            elif kind is bytes and len(arg) < BIG:
                data = arg
            elif kind is tuple:
                chunks = [as_bytes(c) for c in arg]
                small.append(b"$%d\r\n" % sum(len(c) for c in chunks))
                self._put(b"".join(small))
                for chunk in chunks:
                    self._put(chunk)
                small = [b"\r\n"]
                continue
            else:
                data = as_bytes(arg)
                if len(data) >= BIG:
                    small.append(b"$%d\r\n" % len(data))
                    self._put(b"".join(small))
                    self._put(data)
                    small = [b"\r\n"]
                    continue
            small += (b"$%d\r\n" % len(data), data, b"\r\n")
        self._put(b"".join(small))

    def _put(self, data: Buffer) -> None:
        end = self._pos + len(data)
        self._buf[self._pos : end] = data  # past the end it grows the buffer, once
        self._pos = end

    def _send(self, send: Callable[[memoryview], None]) -> None:
        with memoryview(self._buf) as view, view[: self._pos] as used:
            send(used)
        self._pos = 0
