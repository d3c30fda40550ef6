"""The bounded intake of an owner: counted slots for the pushes it holds.

Note [Bounded intake]
    An owner never holds more than ``intake_limit(n, S)`` = 2 n S + 2 n received pushes (S: the shards it
    owns, n: the workers), queued or being applied: the receiver takes a buffer from a pool with that
    limit and waits when it is exhausted, so it stops reading, TCP's flow control stops the senders'
    writes, and their push threads (then their ``step()``) wait: a slow owner slows its senders down
    instead of growing without bound. The limit leaves room for what a round may hold back (under BSP
    and Quorum at most one push per worker and shard waits for lower ranks, Note [Rank-order sum]) plus
    one more push per worker, so a round can always complete. This rank's own pushes skip the network
    and are bounded apart: at most 2 per owned shard wait for the applier (``local_push`` waits, at most
    the timeout without progress).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from pyasync.transport.frames import PoolClosed

__all__ = ["Intake", "intake_limit"]

_time = time.monotonic


def intake_limit(world_size: int, owned: int) -> int:
    """Received pushes an owner of ``owned`` shards may hold at once (Note [Bounded intake])."""
    return 2 * world_size * max(1, owned) + 2 * world_size


class Intake:
    """Counted slots for the pushes an owner holds (Note [Bounded intake]): ``take`` waits while ``limit``
    are out, ``give`` returns one; ``close`` wakes every waiter (PoolClosed). With ``timeout``, a wait
    fails after that long without ``progress()`` moving; without, it waits as long as it takes (an idle
    receiver)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.out = 0
        self.peak = 0  # most slots out at once
        self.cond = threading.Condition()
        self.closed = False

    def take(
        self,
        timeout: datetime.timedelta | None = None,
        progress: Callable[[], int] | None = None,
        what: str = "",
    ) -> None:
        with self.cond:
            seen = progress() if progress is not None else 0
            deadline = None if timeout is None else _time() + timeout.total_seconds()
            while self.out >= self.limit and not self.closed:
                if deadline is not None:
                    if progress is not None and progress() != seen:  # progress: the deadline starts again
                        seen, deadline = progress(), _time() + timeout.total_seconds()
                    elif _time() >= deadline:
                        raise TimeoutError(f"pyasync: {what} for {timeout} ({self.out} waiting)")
                self.cond.wait(None if deadline is None else min(max(deadline - _time(), 0.01), 1.0))
            if self.closed:
                raise PoolClosed("the owner was stopped")
            self.out += 1
            self.peak = max(self.peak, self.out)

    def give(self) -> None:
        with self.cond:
            self.out -= 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
