"""Byte-level helpers of the TCP transport (transport/tcp.py): whole writes and exact reads on a
socket, with a deadline per call."""

from __future__ import annotations

import socket
import time

import torch

__all__ = ["Deadline", "as_bytes", "recv_exact", "recv_exact_into", "send_all"]


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


def send_all(s: socket.socket, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = s.sendmsg(views)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


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
