"""The bounded intake of an owner: counted slots for the pushes it holds.

Note [Bounded intake]
    An owner never holds more than ``intake_limit(n, S)`` = 2 n S + 2 n received pushes (S: the shards it
    owns, n: the workers), queued or being applied: the receiver takes a buffer from a pool with that
    limit and waits when it is exhausted, so it stops reading, TCP's flow control stops the senders'
    writes, and their push threads (then their ``step()``) wait: a slow owner slows its senders down
    instead of growing without bound. The limit leaves room for what a round may hold back (under BSP
    and Quorum at most one push per worker and shard waits for lower ranks, Note [Rank-order sum]) plus
    one more push per worker, so a round can always complete. This rank's own pushes skip the network
    and are bounded apart: at most ``local_limit(n, S)`` wait for the applier (``local_push`` waits, at
    most the timeout without progress), a remote sender's fair share (Note [Fair intake]).

Note [Fair intake]
    A slow owner must slow every sender alike and never fail a live one. Two things decide who it serves.
    (1) Who gets a free slot: the receiver reads the ready senders round robin (``TcpTransport.recv_any``
    starts after the peer it served last). It used to read "the first ready socket", and epoll lists ready
    sockets in the same order at every call, so one sender got every freed slot while another sat in
    ``send()`` until its timeout (4 ranks, rank 0's owner +20 ms per update: rank 2 finished 150 steps
    while the others had done 28-34, one stalled 14.7 s; at 900 steps the job died: a starved worker's
    step() waited 30 s for its push thread). (2) How fast a held push is served: the appliers take their
    queues in arrival order, so each sender's share of the updates is its share of the pushes held
    (Little's law). Round robin gives each of the n - 1 remote senders about ``intake_limit / (n - 1)`` of
    them; this rank's own worker holds at most ``local_limit``, which is that same share (it was 2 per
    shard: 6 against about 11 each at n = 4, and the owner's own worker ran 2.2x slower than the others).
    So every backlogged sender, local or remote, holds the same number and is served at the same rate: n
    senders at 1/n of the owner's rate each.

    A send that waits on a slow owner is then never cut short while the owner drains it. A sender whose
    socket buffers are full waits for room, and the owner reads it every n - 1 messages; but Linux wakes a
    blocked writer only once a third of its send buffer is free (with 4 MiB buffers and 4 KB pushes,
    hundreds of this sender's messages: at 20 ms per update and n = 4 that can pass 30 s). So
    ``TcpTransport.send`` writes whenever there is any room (a non-blocking write, looking again every 50
    ms), and the timeout is no longer a deadline per system call: a wait without room fails only after the
    timeout during which the peer took none of the bytes queued on that connection (SIOCOUTQ did not
    shrink), like ``Intake.take``'s deadline, which restarts on progress. A receiver that stopped, or
    stopped reading this sender, still fails the send after the timeout. The signal is coarse: the peer's
    kernel reopens its window only once about max(MSS, a sixteenth of its receive buffer), some 0.5 MB
    here, is free, so an owner must take about that much from each sender per timeout (at 4 KB pushes and
    n = 4: slower than about 60 ms per update, a live owner can still fail a sender). The engine's own
    wait for the push thread (``step()``: "the push thread to send the pushes of step t") restarts the
    same way, whenever a push goes out or this rank sees the job move (its owner processing pushes,
    replies arriving): a send that truly stalls fails in the push thread, which ends that wait.

    The gloo transport (not the default) is not made fair here: its any-source receive takes whichever
    pending send gloo's ``recvFromAny`` picks (older gloo scans the ranks in order, newer gloo its list
    of pending sends), and its sends wait on gloo's own timeout.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from pyasync.transport.frames import PoolClosed

__all__ = ["Intake", "intake_limit", "local_limit"]

_time = time.monotonic


def intake_limit(world_size: int, owned: int) -> int:
    """Received pushes an owner of ``owned`` shards may hold at once (Note [Bounded intake])."""
    return 2 * world_size * max(1, owned) + 2 * world_size


def local_limit(world_size: int, owned: int) -> int:
    """This rank's own pushes an owner of ``owned`` shards may hold at once: what each remote sender
    holds of the intake when all are backlogged, ceil(intake_limit / (n - 1)), and at least 2 per owned
    shard (Note [Fair intake])."""
    own = 2 * max(1, owned)
    if world_size < 2:
        return own
    return max(own, -(-intake_limit(world_size, owned) // (world_size - 1)))


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
