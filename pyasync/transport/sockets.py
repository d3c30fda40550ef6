"""Byte-level helpers of the TCP transport (transport/tcp.py): the wire's length prefix and markers,
whole writes that wait while the peer takes bytes (Note [Fair intake] in pyasync/engine/p2p/intake.py)
and exact reads on a socket.

Every message on a TCP connection is a :data:`LENGTH` (8 bytes, little-endian), then that many bytes.
Three lengths no message can have are markers, and nothing but what is said here follows them:
:data:`BYE` (nothing: the sender closed cleanly), :data:`GAVE_UP` (a length and a text: the sender
stopped after a failure of its own) and :data:`HEARTBEAT` (nothing: the sender is alive). The set-up
handshake, sent once before any message, is transport/tcp.py's (Note [Hostile connections at set-up]).
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import termios
import time

import torch

__all__ = [
    "BYE",
    "GAVE_UP",
    "HEARTBEAT",
    "LENGTH",
    "Deadline",
    "as_bytes",
    "recv_exact",
    "recv_exact_into",
    "send_while_taken",
    "unsent",
]

LENGTH = struct.Struct("<Q")  # the length prefix of every message on the TCP transport
BYE = (1 << 64) - 1  # nothing follows: the sender closed cleanly (its connection's end is not a failure)
GAVE_UP = (1 << 64) - 2  # then a length and the reason, utf-8: the sender stopped after a failure of its own
HEARTBEAT = (1 << 64) - 3  # nothing follows: the sender is alive (Note [Heartbeats] in heartbeats.py)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("pyasync: the transport set-up timed out")
        return left


def as_bytes(buf: torch.Tensor) -> memoryview:
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError(
            f"TCP transport buffers must be contiguous CPU tensors, got one on {buf.device} "
            f"(contiguous={buf.is_contiguous()}): stage device tensors through the host"
        )
    return memoryview(buf.view(torch.uint8).reshape(-1).numpy())


def unsent(s: socket.socket) -> int | None:
    """Bytes written to ``s`` that its peer has not taken yet (Linux's SIOCOUTQ); None where unknown."""
    try:
        return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, AttributeError, ValueError):
        return None


def send_while_taken(s: socket.socket, parts: list, timeout_s: float) -> None:
    """Write ``parts`` whole to ``s`` (a socket with a timeout, so its descriptor is non-blocking).
    Bytes go out as soon as there is any room, not only once a third of the send buffer is free (when
    Linux wakes a blocked writer); without room it looks again every 50 ms. It fails after ``timeout_s``
    without a byte written only if the peer took none of this connection's queued bytes meanwhile: a
    receiver that keeps reading this connection, however slowly, never cuts a send short (Note [Fair
    intake] in pyasync/engine/p2p/intake.py)."""
    views = [memoryview(p).cast("B") for p in parts]
    poller = select.poll()
    poller.register(s, select.POLLOUT)
    deadline = queued = None  # while waiting for room: when it fails, and the bytes the peer had not taken
    while views:
        try:
            sent = os.writev(s.fileno(), views)
        except BlockingIOError:
            sent = 0
        if sent:
            deadline = None
            while sent and views:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            continue
        now, left = time.monotonic(), unsent(s)
        if deadline is None or (left is not None and queued is not None and left < queued):
            deadline, queued = now + timeout_s, left  # waiting starts, or the peer took bytes: again
        elif now >= deadline:
            raise TimeoutError(f"no room for {timeout_s:g} s and the peer took none of {queued} bytes")
        poller.poll(max(1, min(50, int((deadline - now) * 1000))))


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    recv_exact_into(s, memoryview(out))
    return bytes(out)


def recv_exact_into(s: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = s.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
