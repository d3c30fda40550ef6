"""Clocks, deadlines and waiting: every wait in the engine has the optimizer's timeout and a clear
error naming what (which ranks) it was waiting for."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from pyasync.errors import EngineError, PeerFailure

__all__ = ["Deadline", "EngineError", "as_raised", "wait_at_most", "wait_until"]


class Deadline:
    """A point in time ``timeout`` from now (monotonic clock)."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout
        self.end = time.monotonic() + timeout.total_seconds()

    def remaining(self) -> float:
        """Seconds left (>= 0)."""
        return max(0.0, self.end - time.monotonic())


def as_raised(err: BaseException) -> BaseException:
    """What a call raises for a failure recorded by a background thread (or an earlier call): the same
    PeerFailure (every survivor gets that type, naming the rank), a TimeoutError for an earlier timeout,
    an EngineError naming the thread otherwise."""
    if isinstance(err, PeerFailure):
        out: BaseException = PeerFailure(str(err), err.ranks)
    elif isinstance(err, TimeoutError):
        out = TimeoutError(
            f"{err} (an earlier wait timed out: the optimizer cannot go on; close() it and resume "
            "from a checkpoint)"
        )
    else:
        out = EngineError(f"pyasync engine failed: {err}")
    out.__cause__ = err
    return out


def wait_until(
    cond: threading.Condition,
    ready: Callable[[], bool],
    timeout: datetime.timedelta,
    what: Callable[[], str],
    error: Callable[[], BaseException | None],
    progress: Callable[[], int] | None = None,
) -> float:
    """Wait on ``cond`` (held by the caller) until ``ready()``; returns the seconds waited.

    Raises the background failure from ``error()`` (see as_raised) as soon as one is recorded, and
    TimeoutError with ``what()`` (e.g. "answers from owner ranks [2, 3] for buckets [0]") when
    ``timeout`` passes first. With ``progress`` (a counter that only grows), the deadline starts again
    whenever the counter moved: the wait fails only after ``timeout`` without progress."""
    t0 = time.monotonic()
    deadline = Deadline(timeout)
    seen = progress() if progress is not None else 0
    while True:
        err = error()
        if err is not None:
            raise as_raised(err)
        if ready():
            return time.monotonic() - t0
        if progress is not None and progress() != seen:
            seen, deadline = progress(), Deadline(timeout)
        left = deadline.remaining()
        if left <= 0:
            raise TimeoutError(
                f"pyasync: timed out after {timeout.total_seconds():g} s waiting for {what()}; "
                "a rank may have died, hung or stopped calling step()/close() "
                "(raise the DistributedOptimizer timeout if it is merely slow)"
            )
        cond.wait(min(left, 1.0))


def wait_at_most(
    cond: threading.Condition,
    ready: Callable[[], bool],
    seconds: float,
    error: Callable[[], BaseException | None],
) -> float:
    """Wait on ``cond`` (held by the caller) until ``ready()`` or ``seconds`` have passed, whichever is
    first; returns the seconds waited. For a wait that is a preference, not a need (ASP's patience with
    its own answers): running out of time is no error. A failure recorded in ``error()`` is raised."""
    t0 = time.monotonic()
    end = t0 + seconds
    while True:
        err = error()
        if err is not None:
            raise as_raised(err)
        now = time.monotonic()
        if ready() or now >= end:
            return now - t0
        cond.wait(min(end - now, 1.0))
