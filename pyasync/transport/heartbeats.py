"""Heartbeats of the TCP transport (elastic membership): a mixin of transport/tcp.py's TcpTransport,
which owns the sockets, their locks and what was heard from each peer.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time

from pyasync.transport.base import FLOWS

__all__ = ["HEARTBEAT", "Heartbeats"]

_LEN = struct.Struct("<Q")  # the length prefix of every message on the TCP transport
_log = logging.getLogger("pyasync")
HEARTBEAT = (1 << 64) - 3  # nothing follows: the sender is alive (elastic membership, Note [Heartbeats])


class Heartbeats:
    """start_heartbeats / stop_heartbeats for TcpTransport (Note [Heartbeats])."""

    def start_heartbeats(self, deadline, watched) -> None:
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
                self._heard.setdefault(peer, now)
        self._beats = threading.Thread(
            target=self._beat, args=(deadline, watched), name="pyasync-heartbeat", daemon=True
        )
        self._beats.start()

    def stop_heartbeats(self) -> None:
        """Stop sending heartbeats and watching for silence (the engine stopped; bounded join, and a
        warning if the thread is still running after it)."""
        self._beats_off.set()
        if self._beats is not None:
            self._beats.join(5.0)
            if self._beats.is_alive():
                _log.warning(
                    "pyasync: rank %d: the heartbeat thread did not stop within 5 s (inside a send?); "
                    "it is a daemon thread and may still run when the interpreter exits",
                    self.rank,
                )

    def _beat(self, deadline, watched) -> None:
        while not self._closed and not self._beats_off.is_set():
            d = max(0.05, float(deadline()))
            for peer, s in list(self._socks["push"].items()):
                if peer in self._failed or peer in self.departed or peer in self._gone["push"]:
                    continue
                lock = self._locks[("push", peer)]
                if not lock.acquire(blocking=False):
                    continue  # a send is under way: that is a sign of life already
                try:
                    if select.select([], [s], [], 0)[1]:
                        s.sendall(_LEN.pack(HEARTBEAT))
                except OSError:
                    pass
                finally:
                    lock.release()
            now = time.monotonic()
            for peer in sorted(set(watched()) - set(self.departed) - set(self._failed)):
                if now - self._heard.get(peer, now) <= d or self._pending(peer):
                    continue
                self._failed.setdefault(peer, f"nothing came from it for {now - self._heard[peer]:.1f} s")
                for f in FLOWS:
                    sk = self._socks[f].get(peer)
                    if sk is not None:
                        with contextlib.suppress(OSError):
                            sk.shutdown(socket.SHUT_RDWR)
                self.lose([peer])
            if self._beats_off.wait(d / 5):
                return

    def _pending(self, peer: int) -> bool:
        """Bytes from ``peer`` wait unread on one of its connections (it is alive)."""
        socks = [self._socks[f][peer] for f in FLOWS if peer in self._socks[f]]
        try:
            ready = select.select(socks, [], [], 0)[0]
        except (OSError, ValueError):
            return False
        if ready:
            self._heard[peer] = time.monotonic()
        return bool(ready)
