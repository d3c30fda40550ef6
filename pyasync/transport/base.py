"""The transport interface the engine talks to: point-to-point messages on named flows.

A *flow* is one direction of one kind of traffic: "push" (worker -> owner: pushes and closes) and
"reply" (owner -> worker). Every engine message is one self-contained frame (header and payload in one
buffer, see pyasync/engine/wire.py), so several threads may send on one flow at once. Messages
between a pair of ranks on one flow *from one thread* arrive in the order they were sent; flows never
mix. A flow has sub-flows (independent tags; the engine uses only sub-flow 0). A receive may be
larger than the message it gets (the receiver posts its largest possible frame); the header says how
many bytes are meaningful. Buffers are CPU tensors (the engine stages device tensors through host
memory).
"""

from __future__ import annotations

import abc
import datetime

import torch

__all__ = ["FLOWS", "Handle", "Transport"]

FLOWS = ("push", "reply")


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

    @abc.abstractmethod
    def send(self, buf: torch.Tensor, dst: int, flow: str, sub: int = 0) -> Handle:
        """Start sending ``buf`` (contiguous CPU tensor) to rank ``dst`` on ``flow``, sub-flow ``sub``."""

    @abc.abstractmethod
    def recv(
        self,
        buf: torch.Tensor,
        src: int,
        flow: str,
        sub: int = 0,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        """Receive into ``buf`` (a message of at most its size) from rank ``src`` on ``flow``, sub-flow ``sub``; timeout
        None: the transport's idle timeout."""

    @abc.abstractmethod
    def recv_any(self, buf: torch.Tensor, flow: str) -> int:
        """Receive into ``buf`` (a message of at most its size) from any rank on ``flow``; returns the sender's rank. Waits up to the
        transport's idle timeout (receiver threads idle legitimately between steps)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport's resources (idempotent)."""
