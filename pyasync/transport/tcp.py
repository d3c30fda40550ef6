"""TCP transport: the engine's point-to-point messages over plain sockets, one connection per pair of ranks
and flow. The default transport of DistributedOptimizer.

Note [Why sockets]
    The engine's flows are point to point with self-describing frames, so they need no collective
    library. Over gloo's point-to-point each message was a rendezvous (announce, "ready", data: a round
    trip and several wake-ups of gloo's event loop per message), an idle any-source receive could not be
    interrupted (neither ``abort()`` nor ``destroy_process_group`` wakes it, and a receive that times out
    tears down its connections), a dead peer surfaced as an error with an address and a port, and the
    private groups waited 7 days in ``new_group`` when a rank died while they were built. Over sockets:
    a message is one length-prefixed write, received straight into the receiver's buffer; a receiver
    waits in ``select`` on its flow's sockets and a wake-up pipe, so ``abort()`` stops it at once; a
    connection closed without a goodbye names its rank exactly (:class:`pyasync.errors.PeerFailure`);
    every wait is bounded by the optimizer's timeout, and a send that keeps making progress is never cut
    short (the socket timeout applies per system call). TCP's own flow control is the backpressure of a
    receiver that stops reading (a bounded intake, see pyasync/engine/owner.py).

Wire: every message is an 8-byte little-endian length, then that many bytes. A length of ``BYE`` says
the sender closed cleanly: its connection's end is not a failure. A length of ``GAVE_UP``, then a
length and a text, says the sender stopped because of a failure of its own (``abort(reason)``): its
peers report that reason, so the first cause travels instead of "rank i died". Connections are set up
once: every rank listens, the ranks all-gather (address, port) on a gloo group with the job's token,
and rank i connects to every rank j > i once per flow, with a handshake (magic, token, rank, flow) that the
accepting side checks. ``PYASYNC_SOCKET_ADDR`` sets the address a rank announces (default: the address
of this host that reaches ``MASTER_ADDR``, else its hostname's address, else 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from pyasync.errors import PeerFailure
from pyasync.transport.base import FLOWS, Handle, Transport, TransportClosed
from pyasync.transport.frames import FrameRing
from pyasync.transport.heartbeats import _LEN, HEARTBEAT, Heartbeats
from pyasync.transport.sockets import Deadline, as_bytes, recv_exact, recv_exact_into, send_all

__all__ = ["TcpTransport", "TransportClosed"]

_MAGIC = 0x5059415359544350  # "PYASYTCP"
_HANDSHAKE = struct.Struct("<qqqq")  # magic, token, rank, flow
BYE = (1 << 64) - 1
GAVE_UP = (1 << 64) - 2  # then a length and the reason, utf-8: the sender stopped after a failure of its own
_BUF_BYTES = 4 << 20  # socket send / receive buffer asked for


class _Done(Handle):
    """Socket sends complete before ``send`` returns (the kernel holds the bytes)."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: datetime.timedelta) -> None:
        return None


def _local_address() -> str:
    addr = os.environ.get("PYASYNC_SOCKET_ADDR", "").strip()
    if addr:
        return addr
    master = os.environ.get("MASTER_ADDR", "").strip()
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))  # no packet is sent: this only picks the outgoing interface
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _pack_addr(host: str, port: int, token: int) -> torch.Tensor:
    raw = socket.inet_aton(socket.gethostbyname(host))
    return torch.tensor([int.from_bytes(raw, "big"), port, token], dtype=torch.int64)


class TcpTransport(Heartbeats, Transport):
    """Point-to-point messages among the ranks of ``process_group`` over TCP.

    ``process_group`` (a gloo group; None: the default group) is used once, to exchange addresses;
    ``timeout`` bounds the set-up and every send and every message once it started arriving."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group "
                "(e.g. backend='gloo') on every rank before creating the DistributedOptimizer"
            )
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.timeout_s = timeout.total_seconds()
        self._socks: dict[str, dict[int, socket.socket]] = {f: {} for f in FLOWS}
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._gone: dict[str, set[int]] = {f: set() for f in FLOWS}  # peers that said BYE
        self._failed: dict[int, str] = {}  # rank -> what happened (first failure per rank)
        self._left: dict[int, str] = {}  # ranks that stopped for others' failure -> why (not failed)
        self._failure = threading.Event()  # set when a peer fails
        self._readers = 0  # threads inside recv_any (they notice failures themselves)
        self._readers_lock = threading.Lock()
        self._woken = False  # the wake-up bytes are written: the pipes may be released
        self._heard: dict[int, float] = {}  # peer -> when something last came from it (heartbeats)
        self._beats: threading.Thread | None = None
        self._beats_off = threading.Event()
        self._closed = False
        self._wake = {f: socket.socketpair() for f in FLOWS}
        self._sel = {f: selectors.DefaultSelector() for f in FLOWS}
        for f in FLOWS:
            self._wake[f][0].setblocking(False)
            self._sel[f].register(self._wake[f][0], selectors.EVENT_READ, None)
        if self.world_size > 1:
            self._connect(process_group)

    # -- set-up ---------------------------------------------------------------------------------------
    def _connect(self, group) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("0.0.0.0", 0))
            listener.listen(max(128, 2 * self.world_size))
            mine = _pack_addr(_local_address(), listener.getsockname()[1], secrets.randbits(62))
            table = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(table, mine, group=group)
            token = int(table[0][2])  # rank 0's token names the job
            deadline = Deadline(self.timeout_s)
            for j in range(self.rank + 1, self.world_size):
                host = socket.inet_ntoa(int(table[j][0]).to_bytes(4, "big"))
                for fi, f in enumerate(FLOWS):
                    s = socket.create_connection((host, int(table[j][1])), timeout=deadline.left())
                    s.sendall(_HANDSHAKE.pack(_MAGIC, token, self.rank, fi))
                    self._adopt(s, j, f)
            expected = {(i, f) for i in range(self.rank) for f in FLOWS}
            while expected:
                listener.settimeout(deadline.left())
                try:
                    s, _ = listener.accept()
                except TimeoutError:
                    missing = sorted({i for i, _ in expected})
                    raise PeerFailure(
                        f"pyasync: ranks {missing} did not connect to rank {self.rank} within "
                        f"{self.timeout_s:g} s while the transport was set up",
                        missing,
                    ) from None
                s.settimeout(deadline.left())
                magic, tok, peer, fi = _HANDSHAKE.unpack(recv_exact(s, _HANDSHAKE.size))
                if (
                    magic != _MAGIC
                    or tok != token
                    or not 0 <= fi < len(FLOWS)
                    or (peer, FLOWS[fi]) not in expected
                ):
                    s.close()  # not one of this job's ranks: ignore it
                    continue
                expected.discard((peer, FLOWS[fi]))
                self._adopt(s, peer, FLOWS[fi])
        except BaseException:
            self.abort()
            raise
        finally:
            listener.close()

    def _adopt(self, s: socket.socket, peer: int, flow: str) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, opt, _BUF_BYTES)
        s.settimeout(self.timeout_s)
        self._socks[flow][peer] = s
        self._locks[(flow, peer)] = threading.Lock()
        self._sel[flow].register(s, selectors.EVENT_READ, peer)

    # -- failures -------------------------------------------------------------------------------------
    def failed(self) -> dict[int, str]:
        """Ranks whose connection broke (closed without a goodbye, reset): rank -> what happened."""
        return dict(self._failed)

    def wait_failures(self, seconds: float) -> dict[int, str]:
        """Peers seen failing, waiting up to ``seconds`` for one to be seen: the receivers notice a
        closed connection at once; with no receiver running (construction), this looks itself."""
        end = time.monotonic() + seconds
        while not self._failed and not self._closed:
            left = end - time.monotonic()
            if left <= 0:
                break
            if self._readers:
                self._failure.wait(min(left, 0.1))
            else:
                self._probe(min(left, 0.1))
        return dict(self._failed)

    def wake_receivers(self) -> None:
        """Wake every receiver waiting in ``recv_any`` (it raises TransportClosed); the connections stay
        open (an elastic engine stopping its threads before the epoch change)."""
        with self._readers_lock:
            for f in FLOWS:
                with contextlib.suppress(OSError, KeyError):
                    self._wake[f][1].send(b"x")

    def probe(self) -> dict[int, str]:
        """With no receiver running: the peers whose connections have ended by now (rank -> what)."""
        if self._readers == 0 and not self._closed:
            self._probe(0.0)
        return dict(self._failed)

    def _probe(self, wait_s: float) -> None:
        """With nobody reading: which connections have ended? (Only valid while no message is expected.)"""
        socks = {
            s: (f, peer) for f in FLOWS for peer, s in self._socks[f].items() if peer not in self._failed
        }
        if not socks:
            time.sleep(wait_s)
            return
        readable, _, _ = select.select(list(socks), [], [], wait_s)
        for s in readable:
            f, peer = socks[s]
            try:
                head = s.recv(_LEN.size, socket.MSG_PEEK)
                while len(head) == _LEN.size and _LEN.unpack(head)[0] == HEARTBEAT:
                    s.recv(_LEN.size)  # a heartbeat nobody read: consume it, look behind it
                    if not select.select([s], [], [], 0)[0]:
                        head = None
                        break
                    head = s.recv(_LEN.size, socket.MSG_PEEK)
                if head is None:
                    continue
                if head == b"":
                    self._fail(peer, f"its connection on flow {f} ended without a goodbye")
                elif len(head) == _LEN.size and _LEN.unpack(head)[0] == GAVE_UP:
                    s.settimeout(1.0)
                    with contextlib.suppress(PeerFailure):
                        self._read_one(s, peer, f, torch.empty(0, dtype=torch.uint8))
            except OSError as e:
                self._fail(peer, f"its connection on flow {f} broke ({e})", e)

    def _gave_up(self, peer: int, msg: bytes) -> PeerFailure:
        """``peer`` stopped after a failure of its own. When that failure named dead ranks, they are
        the ones this rank reports too (so every survivor names the same ranks, whichever it heard of
        first); otherwise ``peer`` is the failure."""
        head, _, why = msg.decode(errors="replace").partition("\n")
        ranks = sorted({int(x) for x in head.split(",") if x.strip().isdigit()} - {self.rank, peer})
        if not ranks:
            return self._fail(peer, f"it stopped after a failure of its own ({why})")
        for r in ranks:
            self._failed.setdefault(r, f"reported by rank {peer}, which stopped for it ({why})")
        self._left[peer] = why
        self._failure.set()
        text = "; ".join(f"rank {r} failed: {self._failed[r]}" for r in ranks)
        return PeerFailure(f"pyasync: {text}", ranks)

    def _fail(self, peer: int, what: str, cause: BaseException | None = None) -> PeerFailure:
        if peer in self._left:  # it left after reporting others' failure: theirs is the cause
            ranks = sorted(r for r in self._failed if r != peer)
            return PeerFailure(
                "pyasync: " + "; ".join(f"rank {r} failed: {self._failed[r]}" for r in ranks), ranks
            )
        self._failed.setdefault(peer, what)
        self._failure.set()
        err = PeerFailure(f"pyasync: rank {peer} failed: {what}", [peer])
        if cause is not None:
            err.__cause__ = cause
        return err

    # -- sending --------------------------------------------------------------------------------------
    def send(self, buf: torch.Tensor, dst: int, flow: str) -> Handle:
        s = self._sock(dst, flow)
        view = as_bytes(buf)
        with self._locks[(flow, dst)]:
            try:
                send_all(s, [_LEN.pack(len(view)), view])
            except TimeoutError as e:
                raise TimeoutError(
                    f"pyasync: rank {dst} did not take a {len(view)}-byte message on flow {flow} for "
                    f"{self.timeout_s:g} s (is it alive? stopped? a receiver that stopped reading?)"
                ) from e
            except OSError as e:
                if self._closed:
                    raise TransportClosed("the transport was closed during a send") from e
                raise self._fail(
                    dst, f"its connection broke while rank {self.rank} sent to it ({e})", e
                ) from e
        return _Done()

    def _sock(self, peer: int, flow: str) -> socket.socket:
        if self._closed:
            raise TransportClosed("send on a closed transport")
        if flow not in self._socks:
            raise ValueError(f"unknown flow {flow!r}: expected one of {list(FLOWS)}")
        if peer in self._failed:
            raise PeerFailure(f"pyasync: rank {peer} failed: {self._failed[peer]}", [peer])
        s = self._socks[flow].get(peer)
        if s is None:
            raise ValueError(
                f"no connection to rank {peer} on flow {flow} (this is rank {self.rank} of {self.world_size})"
            )
        return s

    def frame_ring(self, nbytes: int, device: torch.device, count: int = 1) -> FrameRing:
        """One frame per key is enough: a socket send is complete when ``send`` returns."""
        return FrameRing(nbytes, device, 1)

    # -- receiving ------------------------------------------------------------------------------------
    def recv_any(self, buf: torch.Tensor, flow: str) -> int:
        """Receive one message from any peer on ``flow`` into ``buf``; the sender's rank. Waits without a
        deadline for a message to start (receivers idle legitimately), then at most the timeout per
        read. Raises TransportClosed after close()/abort(), PeerFailure when a peer's connection ends
        without a goodbye."""
        with self._readers_lock:
            if self._closed:
                raise TransportClosed("the transport was closed")
            self._readers += 1
            sel = self._sel[flow]
        try:
            while True:
                if self._closed:
                    raise TransportClosed("the transport was closed")
                for key, _ in sel.select():
                    peer = key.data
                    if peer is None:  # the wake-up pipe
                        raise TransportClosed("the transport was closed")
                    try:
                        if self._read_one(key.fileobj, peer, flow, buf):
                            return peer
                    except PeerFailure as e:
                        if self.on_lost is None or self._closed:
                            raise
                        # Elastic membership: the peer left (or gave up and named others); this flow
                        # stops listening to it and the others keep going.
                        with contextlib.suppress(KeyError, ValueError):
                            sel.unregister(key.fileobj)
                        self._failed.setdefault(peer, "it left")
                        self.lose(sorted({*e.ranks, peer}))
        finally:
            with self._readers_lock:
                self._readers -= 1
                self._release()

    def recv(self, buf: torch.Tensor, src: int, flow: str, timeout: datetime.timedelta | None = None) -> None:
        s = self._sock(src, flow)
        s.settimeout(None if timeout is None else timeout.total_seconds())
        try:
            got = None
            while got is None:
                got = self._read_one(s, src, flow, buf)
            if not got:
                raise PeerFailure(f"pyasync: rank {src} closed its connection on flow {flow}", [src])
        finally:
            s.settimeout(self.timeout_s)

    def _read_one(self, s: socket.socket, peer: int, flow: str, buf: torch.Tensor) -> bool | None:
        """Read one message from ``peer`` into ``buf``; False when it was a goodbye, None for a
        heartbeat (nothing to deliver)."""
        try:
            head = recv_exact(s, _LEN.size)
            (n,) = _LEN.unpack(head)
            self._heard[peer] = time.monotonic()
            if n == HEARTBEAT:
                return None
            if n == BYE:
                self._gone[flow].add(peer)
                self._sel[flow].unregister(s)
                return False
            if n == GAVE_UP:
                (m,) = _LEN.unpack(recv_exact(s, _LEN.size))
                raise self._gave_up(peer, bytes(recv_exact(s, min(m, 1 << 16))))
            view = as_bytes(buf)
            if n > len(view):
                raise ValueError(
                    f"pyasync: rank {peer} sent a {n}-byte message on flow {flow}, larger than the "
                    f"{len(view)}-byte "
                    "receive buffer (a peer running another model or pyasync version?)"
                )
            recv_exact_into(s, view[:n])
            return True
        except TimeoutError as e:
            raise TimeoutError(
                f"pyasync: rank {peer} stopped in the middle of a message on flow {flow} for "
                f"{self.timeout_s:g} s"
            ) from e
        except (ConnectionError, EOFError, OSError) as e:
            if self._closed:
                raise TransportClosed("the transport was closed") from e
            raise self._fail(peer, f"its connection on flow {flow} ended without a goodbye ({e})", e) from e

    # -- closing --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Say goodbye on every connection and close them (after the engine's threads stopped)."""
        if self._closed:
            return
        for f in FLOWS:
            for peer, s in self._socks[f].items():
                if peer in self._failed:
                    continue
                try:
                    s.settimeout(min(self.timeout_s, 5.0))
                    with self._locks[(f, peer)]:
                        s.sendall(_LEN.pack(BYE))
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        self._shutdown()

    def abort(self, reason: str | None = None, ranks: list[int] | None = None) -> None:
        """Stop at once: every thread waiting on this transport wakes with TransportClosed (receives) or
        an error (sends); peers see the connections end without a goodbye, or, given ``reason``, are
        told it (on each connection no send is using at this moment), with the ranks whose failure
        this rank stopped for, if it knows them."""
        if self._closed:
            return
        with self._readers_lock:
            self._closed = True  # first: a receiver woken by the shutdown below must see why
        if reason is not None:
            head = ",".join(str(r) for r in ranks or [])
            self._tell(f"{head}\n{reason}".encode()[: 1 << 16])
        for f in FLOWS:
            for s in self._socks[f].values():
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        self._shutdown()

    def _tell(self, why: bytes) -> None:
        """A GAVE_UP message on every live connection whose send lock is free (a send in the middle of a
        message cannot be interrupted; that peer sees the connection end without a goodbye)."""
        for f in FLOWS:
            for peer, s in self._socks[f].items():
                lock = self._locks[(f, peer)]
                if peer in self._failed or not lock.acquire(timeout=0.05):
                    continue
                try:
                    s.settimeout(1.0)
                    s.sendall(_LEN.pack(GAVE_UP) + _LEN.pack(len(why)) + why)
                except OSError:
                    pass
                finally:
                    lock.release()

    def _shutdown(self) -> None:
        self._beats_off.set()
        with self._readers_lock:  # no reader may release the wake-up pipes while they are written
            self._closed = True
            for f in FLOWS:
                with contextlib.suppress(OSError):
                    self._wake[f][1].send(b"x")  # stays unread: every later select() returns at once
            self._woken = True
        for f in FLOWS:
            for s in self._socks[f].values():
                with contextlib.suppress(OSError):
                    s.close()
        # The wake-up pipes and selectors stay open until no receiver waits any more: closing an fd a
        # thread is about to select() on would lose the wake-up (epoll drops closed fds).
        with self._readers_lock:
            self._release()

    def _release(self) -> None:
        """Close the wake-up pipes and selectors once closed and no receiver waits (caller holds the lock)."""
        if self._woken and self._readers == 0 and self._sel:
            sel, wake = self._sel, self._wake
            self._sel, self._wake = {}, {}
            for f in FLOWS:
                sel[f].close()
                for end in wake[f]:
                    end.close()
