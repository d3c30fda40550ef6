"""Clocks, deadlines and waiting: every wait in the engine has the optimizer's timeout and a clear
error naming what (which ranks) it was waiting for."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from pyasync.engine.errors import EngineError

__all__ = ["Deadline", "EngineError", "wait_until"]


class Deadline:
    """A point in time ``timeout`` from now (monotonic clock)."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout
        self.end = time.monotonic() + timeout.total_seconds()

    def remaining(self) -> float:
        """Seconds left (>= 0)."""
        return max(0.0, self.end - time.monotonic())


def wait_until(
    cond: threading.Condition,
    ready: Callable[[], bool],
    timeout: datetime.timedelta,
    what: Callable[[], str],
    error: Callable[[], BaseException | None],
) -> float:
    """Wait on ``cond`` (held by the caller) until ``ready()``; returns the seconds waited.

    Raises the background failure from ``error()`` as an EngineError as soon as one is recorded, and
    TimeoutError with ``what()`` (e.g. "answers from owner ranks [2, 3] for buckets [0]") when
    ``timeout`` passes first."""
    t0 = time.monotonic()
    deadline = Deadline(timeout)
    while True:
        err = error()
        if err is not None:
            raise EngineError(f"pyasync engine failed: {err}") from err
        if ready():
            return time.monotonic() - t0
        left = deadline.remaining()
        if left <= 0:
            raise TimeoutError(
                f"pyasync: timed out after {timeout.total_seconds():g} s waiting for {what()}; "
                "a rank may have died, hung or stopped calling step()/close() "
                "(raise the DistributedOptimizer timeout if it is merely slow)"
            )
        cond.wait(min(left, 1.0))
