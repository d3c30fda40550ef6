"""The transport interface the engine talks to: point-to-point messages on named flows.

A *flow* is one direction of one kind of traffic: "push" (worker -> owner: pushes and closes) and
"reply" (owner -> worker). Every engine message is one self-contained frame (header and payload in one
buffer, see pyasync/engine/wire.py), so several threads may send on one flow at once. Messages
between a pair of ranks on one flow *from one thread* arrive in the order they were sent; flows never
mix. A receive may be
larger than the message it gets (the receiver posts its largest possible frame); the header says how
many bytes are meaningful.

The raw methods (``send``, ``recv``, ``recv_any``, ``close``) are what a transport implements. The
staging methods (``frame_ring``, ``send_frame``, ``recv_pool``, ``land``) are what the engine calls:
they own host staging and buffer reuse, so the engine never branches on the device. A transport whose
raw methods take host buffers only (``host_buffers = True``, gloo) stages a device frame through pinned
host memory before it sends, and hands received data to the device with ``land``; a transport that
moves device memory itself (NCCL) sets ``host_buffers = False`` and stages nothing. See Note [Frame
reuse] in pyasync/transport/frames.py.
"""

from __future__ import annotations

import abc
import datetime
import threading

import torch

from pyasync.errors import PeerFailure
from pyasync.transport.frames import FramePool, FrameRing, SendFrame

__all__ = ["FLOWS", "Handle", "Transport", "TransportClosed"]

FLOWS = ("push", "reply")
_lose_lock = threading.Lock()


class TransportClosed(RuntimeError):
    """The transport was closed or aborted while a thread waited on it (a normal way for receivers to
    stop)."""


class Handle(abc.ABC):
    """A send in flight; the buffer must stay alive until it completes."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the send has completed (the buffer may be reused)."""

    @abc.abstractmethod
    def wait(self, timeout: datetime.timedelta) -> None:
        """Block until the send completes; raise TimeoutError after ``timeout``."""


class Transport(abc.ABC):
    """Point-to-point messaging among ``world_size`` ranks (ranks of the engine's group)."""

    rank: int
    world_size: int
    #: The raw methods take CPU tensors only: device frames are staged through pinned host memory.
    host_buffers: bool = True
    #: Elastic membership (session/membership.py): called with the ranks that left (a receive or a send
    #: saw their connection end) instead of raising PeerFailure; sends to them are dropped from then on.
    on_lost = None
    departed: frozenset[int] = frozenset()
    #: ``start_heartbeats`` really watches the peers for silence (elastic membership needs it: a stopped
    #: peer closes no connection); False where the heartbeat methods do nothing.
    probes_liveness: bool = False

    def lose(self, ranks) -> None:
        """``ranks`` left the membership: drop every later send to them, and tell ``on_lost``."""
        with _lose_lock:
            new = set(ranks) - set(self.departed) - {self.rank}
            if new:
                self.departed = frozenset(set(self.departed) | new)
        if new and self.on_lost is not None:
            self.on_lost(sorted(new))

    @abc.abstractmethod
    def send(self, buf: torch.Tensor, dst: int, flow: str) -> Handle:
        """Start sending ``buf`` (a contiguous CPU tensor when ``host_buffers``) to rank ``dst`` on
        ``flow``."""

    @abc.abstractmethod
    def recv(
        self,
        buf: torch.Tensor,
        src: int,
        flow: str,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        """Receive into ``buf`` (a message of at most its size) from rank ``src`` on ``flow``; timeout None:
        the transport's idle timeout."""

    @abc.abstractmethod
    def recv_any(self, buf: torch.Tensor, flow: str) -> int:
        """Receive into ``buf`` (a message of at most its size) from any rank on ``flow``; returns the
        sender's rank. Waits up to the
        transport's idle timeout (receiver threads idle legitimately between steps)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport's resources (idempotent)."""

    def abort(self, reason: str | None = None, ranks: list[int] | None = None) -> None:
        """Stop at once, after a failure: wake every thread waiting on the transport if it can, and tell
        the peers ``reason`` (the failure this rank stopped for) and the ``ranks`` that failure named,
        if the transport can carry them."""
        self.close()

    def wake_receivers(self) -> None:
        """Wake the threads waiting in ``recv_any`` without closing (elastic engines)."""
        raise NotImplementedError(f"{type(self).__name__} does not support elastic membership")

    def probe(self) -> dict[int, str]:
        """Peers seen failing so far (rank -> what happened), looking once more when it can."""
        return self.wait_failures(0.0)

    def wait_failures(self, seconds: float) -> dict[int, str]:
        """Peers this transport saw fail (rank -> what happened), waiting up to ``seconds`` for one."""
        return {}

    def start_heartbeats(self, deadline, watched) -> None:
        """Start watching the peers of ``watched()`` (a callable giving ranks) for silence longer than
        ``deadline()`` seconds, dropping them with ``lose`` (Note [Heartbeats] in
        pyasync/transport/heartbeats.py). Here: nothing, for transports without liveness probing (gloo);
        ``probes_liveness`` says which kind a transport is."""
        return None

    def stop_heartbeats(self) -> None:
        """Stop what ``start_heartbeats`` started (idempotent). Here: nothing (no liveness probing)."""
        return None

    # -- staging and reuse (concrete; see the module docstring) ----------------------------------------
    def frame_ring(self, nbytes: int, device: torch.device, count: int = 2) -> FrameRing:
        """``count`` reusable send frames of ``nbytes`` on ``device`` (the engine's), used in turn."""
        return FrameRing(nbytes, device, count)

    def send_frame(self, frame: SendFrame, dst: int, flow: str, nbytes: int | None = None) -> None:
        """Send the first ``nbytes`` of ``frame.buf`` (all of it by default: a frame may be larger than
        what it holds now, e.g. a reply frame sized for exact values carrying a coded change) to ``dst``
        on ``flow``; its handle is kept in the frame (waited before the frame is reused). A device frame
        is first copied to its pinned host twin when the transport needs host buffers; the copy completes
        before the send starts."""
        if dst in self.departed:
            return  # it left the membership: nothing it could use
        buf = frame.buf if nbytes is None else frame.buf[:nbytes]
        if self.host_buffers and buf.device.type != "cpu":
            if frame.host is None:
                frame.host = torch.empty(frame.buf.shape, dtype=frame.buf.dtype, pin_memory=True)
            host = frame.host[: buf.numel()]
            host.copy_(buf)  # synchronous: the device buffer may change right after
            buf = host
        try:
            frame.handle = self.send(buf, dst, flow)
        except PeerFailure as e:
            if self.on_lost is None:
                raise
            self.lose(e.ranks or [dst])

    def recv_pool(self, nbytes: int, keep: int, device: torch.device, limit: int | None = None) -> FramePool:
        """A pool of receive buffers of ``nbytes`` for messages to the engine on ``device`` (at most
        ``limit`` out at once)."""
        return FramePool(nbytes, keep, "cpu" if self.host_buffers else device, limit)

    def land(self, tensors: list[torch.Tensor | None], device: torch.device) -> tuple[list, bool]:
        """``tensors`` (views into a received buffer) on ``device``: themselves when already there, else
        copies. Returns (tensors, copied): when copied, the receive buffer is free again at once."""
        if all(t is None or t.device == device for t in tensors):
            return list(tensors), False
        return [None if t is None else t.to(device) for t in tensors], True
