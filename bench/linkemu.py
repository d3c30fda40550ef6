"""Link emulation for the benchmarks: a sending NIC of fixed bandwidth in front of any Transport, to study
slow links on one machine.

    link = Link(1.0)                    # 1 Gbit/s, one per process
    opt = pyasync.DistributedOptimizer(
        sgd, transport=lambda group, timeout: ThrottledTransport(GlooTransport(group, timeout), link))

Note [Link emulation]
    One :class:`Link` models the sending side of one network interface per process: messages leave it
    one after the other at ``gbps`` gigabits per second. A message of ``nbytes`` reserved at time ``now``
    starts at ``start = max(now, busy_until)`` (it queues behind what is already on the wire) and its
    last byte leaves at ``busy_until = start + nbytes * 8 / (gbps * 1e9)``. :class:`ThrottledTransport`
    holds each send back until that time and only then hands it to the wrapped transport (loopback gloo
    in a local run, which is then nearly instantaneous), so a receiver sees the message no earlier than a
    real link of that bandwidth would deliver its last byte. Only the sender is modelled: there is no
    latency (propagation, switch, protocol round trips) and no receive-side contention (a rank receiving
    from three peers at once gets all three at full speed), so the emulation is optimistic for
    all-to-one patterns and exact only for the serialisation delay of what each rank sends.

    The emulated wire time is the one wait in the sender thread (a Condition wait until the message's
    time); ``send`` itself never blocks, as a NIC's queue does not. Messages are issued in the order they
    were reserved (one FIFO per process, reservation and enqueue under one lock), so every flow keeps its
    order. The benchmark harness (``bench/harness/ddp.py``) uses the same :class:`Link` to delay DDP's
    all-reduce futures, so both systems pay for their bytes alike.
"""

from __future__ import annotations

import collections
import datetime
import heapq
import itertools
import math
import threading
import time
import warnings
from collections.abc import Callable

import torch

from pyasync.transport.base import Handle, Transport

__all__ = ["Link", "ThrottledTransport", "complete_after"]

#: How long an idle background thread waits before it looks at its stop flag again (seconds).
_IDLE_WAIT_S = 1.0


class Link:
    """The sending side of one emulated network link of ``gbps`` gigabits per second (1e9 bit/s).

    Thread-safe: any number of threads may reserve; their messages serialise. ``clock`` (seconds,
    monotonic) is injectable for tests. See Note [Link emulation].
    """

    def __init__(self, gbps: float, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not 0 < gbps < math.inf:
            raise ValueError(f"link bandwidth must be a finite number > 0 of Gbit/s, got {gbps!r}")
        self.gbps = float(gbps)
        self._clock = clock
        self._lock = threading.Lock()
        self._busy_until = 0.0  # when the last reserved byte leaves (clock seconds)
        self.bytes_reserved = 0  # bytes reserved so far
        self.messages = 0  # messages reserved so far

    def seconds(self, nbytes: int) -> float:
        """Wire time of ``nbytes`` bytes on this link, in seconds."""
        return nbytes * 8.0 / (self.gbps * 1e9)

    def reserve(self, nbytes: int, since: float | None = None) -> float:
        """Put a message of ``nbytes`` bytes on the link; returns the clock time (s) its last byte leaves.

        The message starts when the link is free (``max(now, busy_until)``; with ``since``, a clock time
        in the past, ``max(since, busy_until)``: bytes that were ready then) and occupies it for
        ``nbytes * 8 / (gbps * 1e9)`` seconds.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        with self._lock:
            start = max(self._clock() if since is None else since, self._busy_until)
            self._busy_until = start + self.seconds(nbytes)
            self.bytes_reserved += nbytes
            self.messages += 1
            return self._busy_until

    @property
    def busy_until(self) -> float:
        """Clock time (s) at which everything reserved so far has left the link."""
        with self._lock:
            return self._busy_until

    def __repr__(self) -> str:
        return f"Link(gbps={self.gbps:g})"


def steps_behind_link(opt, link: Link, sleep: Callable[[float], None] = time.sleep) -> None:
    """Put the collectives of BSP on collectives behind ``link``: they run on gloo inside ``step()``,
    not through the transport, so ``ThrottledTransport`` never sees them. Each ``opt.step()`` then
    returns no earlier than the bytes of this step (the growth of ``opt.stats().bytes_sent`` since the
    previous step returned: the reduce's, launched from the backward hooks before ``step()`` was called,
    and the gather's) would have left the link, counted from when step() was called.

    Pessimistic for the reduces the hooks launched during backward (a real link would have started them
    then; on a model of one bucket that is the end of backward, about when step() is called), and
    optimistic by what separates the two collectives (the owner's update): a real link would send the
    gather's bytes only after the reduce's had arrived and the shard was updated."""
    inner = opt.step
    last = [opt.stats().bytes_sent]  # bytes sent when the previous step returned

    def step(*args, **kwargs):
        t0 = link._clock()
        out = inner(*args, **kwargs)
        now = opt.stats().bytes_sent
        done = link.reserve(int(now - last[0]), since=t0)
        last[0] = now
        left = done - link._clock()
        if left > 0:
            sleep(left)
        return out

    opt.step = step


# ---------------------------------------------------------------------------------------------------
# A transport behind the link
# ---------------------------------------------------------------------------------------------------


class _ThrottledHandle(Handle):
    """A send waiting for the emulated link, then in flight on the wrapped transport."""

    def __init__(self, nbytes: int, dst: int, flow: str, at: float) -> None:
        self.nbytes, self.dst, self.flow, self.at = nbytes, dst, flow, at
        self._issued = threading.Event()  # set once the inner send was started (or failed to start)
        self._inner: Handle | None = None
        self._error: BaseException | None = None

    def _settle(self, inner: Handle | None, error: BaseException | None) -> None:
        self._inner, self._error = inner, error
        self._issued.set()

    def done(self) -> bool:
        """True once the send is over: completed on the wrapped transport, or failed (wait() raises)."""
        if not self._issued.is_set():
            return False
        return self._error is not None or self._inner.done()

    def wait(self, timeout: datetime.timedelta) -> None:
        """Block until the emulated link has sent the message and the wrapped send completed.

        Raises TimeoutError after ``timeout`` (the link's backlog counts against it), and the wrapped
        transport's own error when its send failed.
        """
        total_s = timeout.total_seconds()
        deadline = time.monotonic() + total_s
        if not self._issued.wait(max(0.0, total_s)):
            raise TimeoutError(
                f"send of {self.nbytes} bytes to rank {self.dst} on flow {self.flow} was not put on the "
                f"emulated link within {timeout} (it was due {self.at - time.monotonic():.3f} s from now)"
            )
        if self._error is not None:
            raise self._error
        # At least 1 ms: some transports read a zero timeout as "no timeout".
        left = max(deadline - time.monotonic(), 1e-3)
        self._inner.wait(datetime.timedelta(seconds=left))


class ThrottledTransport(Transport):
    """``inner`` behind an emulated sending link: each send leaves when ``link`` says its last byte would.

    ``send`` reserves the message's bytes on the link and queues it (it never blocks); one background
    thread issues the queued sends on ``inner`` in order, each at its reserved time. Receives are
    ``inner``'s. ``close`` stops the thread (within ``close_timeout_s`` seconds), fails sends that were
    still queued, and closes ``inner``. See Note [Link emulation].
    """

    def __init__(self, inner: Transport, link: Link, close_timeout_s: float = 10.0) -> None:
        if not isinstance(inner, Transport):
            raise TypeError(f"inner must be a Transport, got {type(inner).__name__}")
        if not isinstance(link, Link):
            raise TypeError(f"link must be a Link, got {type(link).__name__}")
        self.inner = inner
        self.link = link
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.host_buffers = inner.host_buffers  # staging is the wrapped transport's
        self._close_timeout_s = close_timeout_s
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (handle, buf, dst, flow), by time
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pyasync-link", daemon=True)
        self._thread.start()

    def send(self, buf: torch.Tensor, dst: int, flow: str) -> Handle:
        nbytes = buf.numel() * buf.element_size()
        with self._cond:
            if self._closing:
                raise RuntimeError("send on a closed ThrottledTransport")
            # Reserve and enqueue under one lock: the FIFO is in reservation (= time) order.
            at = self.link.reserve(nbytes)
            handle = _ThrottledHandle(nbytes, dst, flow, at)
            self._queue.append((handle, buf, dst, flow))
            self._cond.notify_all()
        return handle

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait(_IDLE_WAIT_S)
                if self._closing:
                    pending = list(self._queue)
                    self._queue.clear()
                    break
                handle = self._queue[0][0]
                left = handle.at - self.link._clock()
                if left > 0:
                    # The emulated wire time; a close wakes it up.
                    self._cond.wait(left)
                    continue
                _, buf, dst, flow = self._queue.popleft()
            try:
                inner = self.inner.send(buf, dst, flow)
            except BaseException as e:  # handed to the handle's wait()
                handle._settle(None, e)
            else:
                handle._settle(inner, None)
        for handle, *_ in pending:
            handle._settle(
                None,
                RuntimeError(
                    f"send of {handle.nbytes} bytes to rank {handle.dst} on flow {handle.flow}: the "
                    "transport was closed before the emulated link sent it"
                ),
            )

    def recv(
        self,
        buf: torch.Tensor,
        src: int,
        flow: str,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        self.inner.recv(buf, src, flow, timeout)

    def recv_any(self, buf: torch.Tensor, flow: str) -> int:
        return self.inner.recv_any(buf, flow)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(self._close_timeout_s)
        self.inner.close()
        if self._thread.is_alive():
            raise TimeoutError(
                f"the emulated link's sender thread did not stop within {self._close_timeout_s} s"
            )


# ---------------------------------------------------------------------------------------------------
# Delayed futures (DDP communication hooks)
# ---------------------------------------------------------------------------------------------------


class _Timer:
    """One background thread that runs callbacks at given monotonic times (earliest first)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name="pyasync-link-timer", daemon=True)
        self._thread.start()

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), fn))
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._heap:
                    self._cond.wait(_IDLE_WAIT_S)
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception as e:  # keep serving the other callbacks
                warnings.warn(f"pyasync: a delayed completion failed: {e!r}", RuntimeWarning, stacklevel=1)


_timer: _Timer | None = None
_timer_lock = threading.Lock()


def _shared_timer() -> _Timer:
    global _timer
    with _timer_lock:
        if _timer is None:
            _timer = _Timer()
        return _timer


def complete_after(fut: torch.futures.Future, at: float) -> torch.futures.Future:
    """A future with ``fut``'s result (or error) that completes no earlier than monotonic time ``at``.

    Never blocks the caller: the result is handed over from ``fut``'s callback when ``at`` has passed,
    otherwise from a shared timer thread at ``at``. Used to charge a DDP communication hook the wire time
    of what its all-reduce sends (see Note [Link emulation]).
    """
    out: torch.futures.Future = torch.futures.Future()

    def settle(f: torch.futures.Future) -> None:
        try:
            value = f.value()
        except BaseException as e:  # handed to the waiter
            out.set_exception(e)
            return
        if time.monotonic() >= at:
            out.set_result(value)
        else:
            _shared_timer().call_at(at, lambda: out.set_result(value))

    fut.add_done_callback(settle)
    return out
