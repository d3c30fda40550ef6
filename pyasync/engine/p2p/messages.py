"""Typed messages between the engine's threads (its queues carry these, never positional tuples), and a
small result slot for calls answered by another thread."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pyasync.ops._common import Payload

__all__ = [
    "BucketReady",
    "Call",
    "Close",
    "Commit",
    "Control",
    "Depart",
    "Pause",
    "Push",
    "Release",
    "Reply",
    "Result",
    "Stop",
]


# -- to an applier (owner side) ---------------------------------------------------------------------
@dataclass
class Push:
    """One worker's push to one shard, as its applier gets it (also the round machine's ``item``)."""

    bucket: int
    worker: int
    clock: int
    version: int  # shard version the gradient was computed on
    payload: Payload  # on the owner's device; views into ``frame`` unless landed elsewhere
    mask: tuple[bool, ...]  # per segment of the shard: the worker had a gradient for it
    frame: torch.Tensor | None = None  # receive buffer to give back once the payload is consumed
    event: Any = None  # CUDA event the applier's stream waits on before reading the payload


@dataclass
class Close:
    """Worker ``worker`` has pushed everything it ever will."""

    worker: int


@dataclass
class Depart:
    """Worker ``worker`` left the membership (it died or was dropped): no round waits for it any more."""

    worker: int


@dataclass
class Release:
    """A gated round of ``bucket`` may apply its update, scaled by ``scale`` (the clip coefficient)."""

    bucket: int
    scale: float


@dataclass
class Pause:
    """Worker ``worker`` waits in a barrier (``on``) or is back."""

    worker: int
    on: bool


@dataclass
class Call:
    """Run ``fn(applier)`` in the applier thread, between pushes; its value goes to ``result``."""

    fn: Callable[[Any], Any]
    result: Result


@dataclass
class Stop:
    """Finish: wait (at most ``timeout``) for the sends in flight, then end the thread (None: after a
    failure, end at once)."""

    timeout: datetime.timedelta | None


# -- to the push thread (worker side) ---------------------------------------------------------------
@dataclass
class BucketReady:
    """Bucket ``bucket`` of clock ``clock`` is ready to push: its gradients (None where a parameter got
    none), the shard versions they were computed on, and the event marking them complete (CUDA)."""

    bucket: int
    clock: int
    grads: list[torch.Tensor | None]
    versions: dict[int, int]
    event: Any = None


@dataclass
class Commit:
    """step() confirms clock ``clock``: send every bucket's push (Note [What step() pushes]).

    regrab: buckets whose gradients changed after the hooks saw them -> their gradients now (encode
    them again). scale: a factor on every gradient (1 / the GradScaler scale). clip: the largest norm
    this worker's push may have (per-push clipping), or None. skip: send every push as non-finite
    (GradScaler found an inf: nothing of this step is applied anywhere)."""

    clock: int
    regrab: dict[int, list[torch.Tensor | None]]
    scale: float = 1.0
    clip: float | None = None
    skip: bool = False
    event: Any = None


@dataclass
class Control:
    """A header-only message to every owner: CLOSE, PAUSE or RESUME (wire kinds)."""

    kind: int
    clock: int


# -- to a worker (from an owner) --------------------------------------------------------------------
@dataclass
class Reply:
    """Fresh values of one shard, as a worker receives them."""

    bucket: int
    shard: int
    version: int  # updates applied to the shard
    clock: int  # clock of the push this answers (-1: none)
    values: torch.Tensor  # fp32 shard values
    clocks: list[int]  # per worker: highest clock fully included in values
    final: bool = False  # the owner's last word on this shard (after every rank closed)
    frame: torch.Tensor | None = None  # the receive buffer values lives in (given back to its pool)
    event: Any = None  # CUDA event the installing stream waits on before reading values


# -- results of calls into other threads -------------------------------------------------------------
@dataclass
class Result:
    """A value (or an exception) another thread hands back once."""

    _done: threading.Event = field(default_factory=threading.Event)
    _value: Any = None
    _error: BaseException | None = None

    def set(self, value: Any) -> None:
        self._value = value
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def get(self, timeout: datetime.timedelta, what: str) -> Any:
        """The value, re-raising the other thread's exception; TimeoutError naming ``what``."""
        if not self._done.wait(timeout.total_seconds()):
            raise TimeoutError(f"pyasync: {what} did not answer within {timeout}")
        if self._error is not None:
            raise self._error
        return self._value
