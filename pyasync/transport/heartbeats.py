"""Heartbeats of the TCP transport (elastic membership): an object transport/tcp.py's TcpTransport owns
and builds with the tables it shares (its sockets and their send locks, what was heard from each peer,
the peers that failed or said goodbye) and the callbacks it answers (is it closed, who departed, lose).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Collection

from pyasync.transport.base import FLOWS
from pyasync.transport.sockets import HEARTBEAT, LENGTH

__all__ = ["Heartbeats"]

_log = logging.getLogger("pyasync")


class Heartbeats:
    """The heartbeat thread of one TcpTransport (Note [Heartbeats]): it sends a HEARTBEAT to every peer
    on the push flow and drops the watched peers that stay silent.

    Shared with the transport (read, and written where said): ``socks`` (flow -> peer -> socket),
    ``locks`` ((flow, peer) -> the lock a send on that connection holds), ``heard`` (peer -> when
    something last came from it, ``time.monotonic()``; the transport's reads write it, and so does
    this object), ``failed`` (peer -> what happened; a silent peer is written into it) and ``gone``
    (flow -> the peers that said goodbye on it). ``departed()`` gives the ranks that left the
    membership, ``closed()`` whether the transport is closed, and ``lose(ranks)`` drops ranks from the
    membership (the transport's ``lose``)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        socks: dict[str, dict[int, socket.socket]],
        locks: dict[tuple[str, int], threading.Lock],
        heard: dict[int, float],
        failed: dict[int, str],
        gone: dict[str, set[int]],
        departed: Callable[[], Collection[int]],
        closed: Callable[[], bool],
        lose: Callable[[list[int]], None],
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.socks, self.locks, self.heard, self.failed, self.gone = socks, locks, heard, failed, gone
        self.departed, self.closed, self.lose = departed, closed, lose
        self._thread: threading.Thread | None = None
        self._off = threading.Event()

    def start(self, deadline, watched) -> None:
        """Send heartbeats and drop the peers that stay silent.

        Note [Heartbeats]
            A stopped process (SIGSTOP) or a partitioned host closes no connection, so under elastic
            membership every rank sends a HEARTBEAT (an 8-byte marker, no message) on its push flow
            to every peer every ``deadline() / 5`` seconds, and reads count whatever comes from a peer
            as a sign of life. A peer of ``watched()`` (the workers that may still push to this rank's
            owner) from which nothing came for ``deadline()`` seconds, and that has nothing waiting
            unread (a receiver that stopped reading, a bounded intake, is not a silent peer), is
            dropped: its connections are shut down, which the receivers report as a departure (and
            the dropped rank, if it ever runs again, sees its connections closed). ``deadline()``
            comes from the engine: a multiple of the measured step time, at most the timeout."""
        now = time.monotonic()
        for peer in range(self.world_size):
            if peer != self.rank:
                self.heard.setdefault(peer, now)
        self._thread = threading.Thread(
            target=self._beat, args=(deadline, watched), name="pyasync-heartbeat", daemon=True
        )
        self._thread.start()

    def halt(self) -> None:
        """Tell the thread to stop, without waiting for it (the transport is shutting down; this may be
        the heartbeat thread itself, losing a peer)."""
        self._off.set()

    def stop(self) -> None:
        """Stop sending heartbeats and watching for silence (the engine stopped; bounded join, and a
        warning if the thread is still running after it)."""
        self._off.set()
        if self._thread is not None:
            self._thread.join(5.0)
            if self._thread.is_alive():
                _log.warning(
                    "pyasync: rank %d: the heartbeat thread did not stop within 5 s (inside a send?); "
                    "it is a daemon thread and may still run when the interpreter exits",
                    self.rank,
                )

    def _beat(self, deadline, watched) -> None:
        while not self.closed() and not self._off.is_set():
            d = max(0.05, float(deadline()))
            for peer, s in list(self.socks["push"].items()):
                if peer in self.failed or peer in self.departed() or peer in self.gone["push"]:
                    continue
                lock = self.locks[("push", peer)]
                if not lock.acquire(blocking=False):
                    continue  # a send is under way: that is a sign of life already
                try:
                    if select.select([], [s], [], 0)[1]:
                        s.sendall(LENGTH.pack(HEARTBEAT))
                except OSError:
                    pass
                finally:
                    lock.release()
            now = time.monotonic()
            for peer in sorted(set(watched()) - set(self.departed()) - set(self.failed)):
                if now - self.heard.get(peer, now) <= d or self._pending(peer):
                    continue
                self.failed.setdefault(peer, f"nothing came from it for {now - self.heard[peer]:.1f} s")
                for f in FLOWS:
                    sk = self.socks[f].get(peer)
                    if sk is not None:
                        with contextlib.suppress(OSError):
                            sk.shutdown(socket.SHUT_RDWR)
                self.lose([peer])
            if self._off.wait(d / 5):
                return

    def _pending(self, peer: int) -> bool:
        """Bytes from ``peer`` wait unread on one of its connections (it is alive)."""
        socks = [self.socks[f][peer] for f in FLOWS if peer in self.socks[f]]
        try:
            ready = select.select(socks, [], [], 0)[0]
        except (OSError, ValueError):
            return False
        if ready:
            self.heard[peer] = time.monotonic()
        return bool(ready)
