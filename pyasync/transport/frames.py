"""Reusable message buffers: send frames (in rings, waited before reuse) and receive pools.

Note [Frame reuse]
    Buffers are reused across steps instead of being allocated per message: a fresh multi-megabyte
    tensor per message costs a page fault per 4 KiB the first time it is touched (bench/overlap.py
    counted 30-40 thousand minor faults per step per rank at 25 MB buckets), which is CPU time taken
    from backward. Every send goes through a :class:`FrameRing` of a few :class:`SendFrame` per flow
    key (a push to one shard, a reply of one shard to one worker, control messages to one rank): the
    frame taken is the least recently used, and its previous send is waited for first (long done,
    unless the peer stopped receiving: then a TimeoutError naming it). So the sends in flight, and
    the memory they pin, are bounded by the layout, and every send handle is waited exactly once.
    Receive buffers come from a :class:`FramePool`: whoever consumes a message gives its buffer back
    once nothing reads it any more. A buffer lost on an error path is simply garbage-collected.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch

__all__ = ["FramePool", "FrameRing", "PoolClosed", "SendFrame"]


class SendFrame:
    """A reusable send buffer. ``buf`` (uint8, on the engine's device) holds a header and a payload,
    written in place by the engine; ``host`` is its staging copy in pinned host memory when the
    transport needs host buffers and ``buf`` is on a device; ``handle`` is its last send (waited before
    the frame is written again); ``views`` is the engine's (typed views into ``buf``, made once)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # zeroed once: no stale padding
        self.host: torch.Tensor | None = None
        self.handle = None
        self.views: Any = None

    def wait(self, timeout: datetime.timedelta) -> None:
        """Wait (at most ``timeout``) for this frame's last send, if any."""
        if self.handle is not None:
            h, self.handle = self.handle, None
            h.wait(timeout)


class FrameRing:
    """``count`` frames of ``nbytes`` used in turn (see Note [Frame reuse])."""

    def __init__(self, nbytes: int, device: torch.device, count: int = 2) -> None:
        if count < 1:
            raise ValueError(f"a frame ring needs at least one frame, got {count}")
        self.nbytes = nbytes
        self.frames = [SendFrame(nbytes, device) for _ in range(count)]
        self._next = 0

    def take(self, timeout: datetime.timedelta) -> SendFrame:
        """The least recently used frame, once its previous send has completed (at most ``timeout``)."""
        fr = self.frames[self._next]
        self._next = (self._next + 1) % len(self.frames)
        fr.wait(timeout)
        return fr

    def drain(self, timeout: datetime.timedelta) -> None:
        """Wait for every send still in flight (at close)."""
        for fr in self.frames:
            fr.wait(timeout)

    def drop(self) -> None:
        """Forget the handles without waiting (after a failure: they hold transport work objects)."""
        for fr in self.frames:
            fr.handle = None


class PoolClosed(RuntimeError):
    """A receive pool was closed while a receiver waited for a free buffer."""


class FramePool:
    """Receive buffers of one size, recycled: a receiver takes one (or a new one when none is free), and
    whoever consumes the message gives it back once nothing reads it any more. At most ``keep`` free
    buffers are kept; more are dropped, so a backlog does not pin its peak in memory for good. With a
    ``limit``, at most that many buffers are out at once: ``get`` waits until one comes back (the
    bounded intake that pushes back on senders, see pyasync/engine/p2p/owner.py). Thread-safe."""

    def __init__(
        self, nbytes: int, keep: int = 8, device: torch.device | str = "cpu", limit: int | None = None
    ) -> None:
        self.nbytes = nbytes
        self.keep = keep
        self.limit = limit
        self.device = torch.device(device)
        self.allocated = 0  # buffers made so far (for tests and stats: flat in steady state)
        self.out = 0  # buffers taken and not given back
        self.peak = 0  # most buffers out at once
        self._free: list[torch.Tensor] = []
        self._cond = threading.Condition()
        self._closed = False

    def get(self) -> torch.Tensor:
        """A free buffer (a new one when none is free), waiting while ``limit`` buffers are out."""
        with self._cond:
            while self.limit is not None and self.out >= self.limit and not self._closed:
                self._cond.wait()
            if self._closed:
                raise PoolClosed("the receive pool was closed")
            self.out += 1
            self.peak = max(self.peak, self.out)
            if self._free:
                return self._free.pop()
            self.allocated += 1
        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def free(self) -> int:
        """Buffers waiting for reuse (at most ``keep``)."""
        return len(self._free)

    def put(self, buf: torch.Tensor | None) -> None:
        """Give a buffer back (None: nothing to give back)."""
        if buf is None:
            return
        with self._cond:
            self.out -= 1
            if len(self._free) < self.keep:
                self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        """Wake a receiver waiting in ``get`` (it raises PoolClosed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
