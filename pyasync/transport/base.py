"""The transport interface the engine talks to: point-to-point messages on named flows.

A *flow* is one direction of one kind of traffic ("push_hdr", "push_data", "reply_hdr",
"reply_data"). Messages between a pair of ranks on one flow arrive in the order they were sent; flows
never mix. A flow has sub-flows (the engine uses one per bucket for payloads): several threads
sending on one flow to one rank must each use their own sub-flow, or their messages interleave.
Buffers are CPU tensors (the engine stages device tensors through host memory).
"""

from __future__ import annotations

import abc
import datetime

import torch

__all__ = ["FLOWS", "Handle", "Transport"]

FLOWS = ("push_hdr", "push_data", "reply_hdr", "reply_data")


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
        """Receive into ``buf`` (exactly its size) from rank ``src`` on ``flow``, sub-flow ``sub``; timeout
        None: the transport's idle timeout."""

    @abc.abstractmethod
    def recv_any(self, buf: torch.Tensor, flow: str) -> int:
        """Receive into ``buf`` from any rank on ``flow``; returns the sender's rank. Waits up to the
        transport's idle timeout (receiver threads idle legitimately between steps)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport's resources (idempotent)."""
