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
    receiver that stops reading (a bounded intake, see pyasync/engine/p2p/owner.py).

Wire: every message is an 8-byte little-endian length, then that many bytes (the length prefix and
the markers are pyasync/transport/sockets.py's). A length of ``BYE`` says the sender closed cleanly:
its connection's end is not a failure. A length of ``GAVE_UP``, then a length and a text, says the
sender stopped because of a failure of its own (``abort(reason)``): its peers report that reason, so
the first cause travels instead of "rank i died". A length of ``HEARTBEAT`` says the sender is alive
(Note [Heartbeats] in pyasync/transport/heartbeats.py). Connections are set up
once: every rank listens, the ranks all-gather (address, port) on a gloo group with the job's token,
and rank i connects to every rank j > i once per flow, with a handshake (magic, token, rank, flow) that the
accepting side checks (connections that are not the job's are refused without harm: Note [Hostile
connections at set-up]). ``PYASYNC_SOCKET_ADDR`` sets the address a rank announces (default: the address
of this host that reaches ``MASTER_ADDR``, else its hostname's address, else 127.0.0.1); the set-up
listener binds that address only, the one its peers connect to. ``PYASYNC_SOCKET_BIND`` overrides the
address bound: ``PYASYNC_SOCKET_BIND=0.0.0.0`` listens on every interface, for a host behind NAT whose
announced address is not one of its own.

Note [Hostile connections at set-up]
    The listener is open to anyone who can reach it while the transport is set up (a port scanner, a
    health checker, another job's rank, a stray client), and such a connection must neither stop nor
    slow the job. So the accepting side (:func:`_accept_peers`) never blocks on one connection: it
    accepts in a loop over a selector and reads every pending handshake non-blockingly, concurrently,
    each with its own short deadline (``_HANDSHAKE_S``, at most the timeout). A job's rank sends its
    32 bytes right after connecting, so a short deadline costs it nothing. A connection that fails the
    handshake (closed or stalled before 32 bytes, wrong magic, wrong token, unknown flow, a rank that
    does not connect to this one or has already connected) is closed and logged; nothing else changes.
    At most ``_PENDING_MAX`` handshakes are awaited at once (a flood drops the oldest), so a flood
    cannot exhaust descriptors. Only ranks that really fail to connect by the set-up deadline fail it:
    the PeerFailure names them and lists the connections refused meanwhile ("wrong token from
    10.0.0.7:5555"), so an attack or a misconfiguration shows in the message. The listener binds the
    announced address, not every interface: peers connect to exactly that address, so nothing they
    need is lost, and other networks of the host cannot reach the listener at all. A rank that cannot
    listen still takes part in the address exchange (announcing port 0), so its peers name it at once
    instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
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
from pyasync.session import groups
from pyasync.transport.base import FLOWS, Handle, Transport, TransportClosed
from pyasync.transport.frames import FrameRing
from pyasync.transport.heartbeats import Heartbeats
from pyasync.transport.sockets import (
    BYE,
    GAVE_UP,
    HEARTBEAT,
    LENGTH,
    Deadline,
    as_bytes,
    recv_exact,
    recv_exact_into,
    send_while_taken,
)

__all__ = ["TcpTransport", "TransportClosed"]

_MAGIC = 0x5059415359544350  # "PYASYTCP"
_HANDSHAKE = struct.Struct("<qqqq")  # magic, token, rank, flow
_BUF_BYTES = 4 << 20  # socket send / receive buffer asked for
#: How long an accepted connection may take to send its handshake (Note [Hostile connections at set-up]).
_HANDSHAKE_S = 5.0
_PENDING_MAX = 64  # handshakes awaited at once at set-up; beyond, the oldest connection is dropped
_LOGGED_MAX = 16  # refused set-up connections logged one by one (then only counted)

_log = logging.getLogger("pyasync")


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


def _announced() -> str:
    """The IPv4 address this rank announces to its peers (``_local_address()``, resolved)."""
    addr = _local_address()
    try:
        return socket.gethostbyname(addr)
    except OSError as e:
        raise OSError(
            e.errno,
            f"pyasync: the address {addr!r} this rank would announce does not resolve ({e}); set "
            "PYASYNC_SOCKET_ADDR to an IPv4 address of this host that the other ranks reach",
        ) from e


def _listen(host: str, backlog: int = 128) -> socket.socket:
    """The set-up listener, bound to ``host`` (the announced address) or to ``PYASYNC_SOCKET_BIND``."""
    bind = os.environ.get("PYASYNC_SOCKET_BIND", "").strip() or host
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((bind, 0))
        ls.listen(backlog)
    except OSError as e:
        ls.close()
        raise OSError(
            e.errno,
            f"pyasync: the transport cannot listen on {bind} ({e.strerror or e}). It binds the address it "
            "announces to its peers: set PYASYNC_SOCKET_ADDR to an address of this host that the other "
            "ranks reach, or, behind NAT, PYASYNC_SOCKET_BIND=0.0.0.0 to listen on every interface",
        ) from e
    return ls


def _judge(raw: bytes, token: int, expected: set[tuple[int, str]], rank: int) -> tuple[str | None, int, str]:
    """(why the handshake ``raw`` is refused, or None; its rank; its flow)."""
    magic, tok, peer, fi = _HANDSHAKE.unpack(raw)
    if magic != _MAGIC:
        return "not a pyasync handshake (wrong magic)", -1, ""
    if tok != token:
        return f"a handshake with a wrong token (claiming rank {peer}: another job's?)", -1, ""
    if not 0 <= fi < len(FLOWS):
        return f"a handshake naming an unknown flow {fi} (claiming rank {peer})", -1, ""
    flow = FLOWS[fi]
    if (peer, flow) not in expected:
        if 0 <= peer < rank:
            return f"a second connection claiming rank {peer} on flow {flow}", -1, ""
        return f"a handshake claiming rank {peer}, which does not connect to rank {rank}", -1, ""
    return None, peer, flow


class _Acceptor:
    """The accepting side of the set-up (Note [Hostile connections at set-up])."""

    def __init__(self, listener, token, expected, rank, timeout_s, end, handshake_s) -> None:
        self.listener, self.token, self.rank, self.timeout_s = listener, token, rank, timeout_s
        self.expected = set(expected)
        self.end = end
        self.handshake_s = min(handshake_s, timeout_s)
        self.taken: list[tuple[socket.socket, int, str]] = []
        self.pending: dict[socket.socket, tuple[str, bytearray, float]] = {}  # oldest first
        self.refused: list[str] = []
        self.sel = selectors.DefaultSelector()

    def run(self) -> list[tuple[socket.socket, int, str]]:
        ok = False
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        try:
            while self.expected:
                now = time.monotonic()
                for s in [s for s, (_, _, end) in self.pending.items() if end <= now]:
                    got = len(self.pending[s][1])
                    why = f"no handshake within {self.handshake_s:g} s ({got} of {_HANDSHAKE.size} bytes)"
                    self.refuse(s, why)
                if now >= self.end:
                    raise self.missing()
                wait = min([self.end - now] + [end - now for _, _, end in self.pending.values()])
                for key, _ in self.sel.select(max(wait, 0.0)):
                    if key.fileobj is self.listener:
                        self.accept()
                    elif key.fileobj in self.pending:
                        self.read(key.fileobj)
            ok = True
            return self.taken
        finally:
            self.sel.close()
            if ok and self.pending:  # strangers still silent when the last peer came: closed now
                _log.warning(
                    "pyasync: rank %d closed %d connection(s) to its transport set-up that sent no full "
                    "handshake: from %s",
                    self.rank,
                    len(self.pending),
                    ", ".join(name for name, _, _ in list(self.pending.values())[:8]),
                )
            for s in self.pending:
                s.close()
            if not ok:
                for s, _, _ in self.taken:
                    s.close()

    def accept(self) -> None:
        for _ in range(_PENDING_MAX):  # then back to the reads: a flood does not starve them
            try:
                s, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError:  # out of descriptors: make room, or give up if there is none to make
                if not self.pending:
                    raise
                self.refuse(next(iter(self.pending)), "dropped: out of file descriptors")
                return
            if len(self.pending) >= _PENDING_MAX:
                self.refuse(next(iter(self.pending)), "dropped: too many connections awaiting a handshake")
            s.setblocking(False)
            self.pending[s] = (f"{addr[0]}:{addr[1]}", bytearray(), time.monotonic() + self.handshake_s)
            self.sel.register(s, selectors.EVENT_READ, None)

    def read(self, s: socket.socket) -> None:
        _, buf, _ = self.pending[s]
        try:
            chunk = s.recv(_HANDSHAKE.size - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.refuse(s, f"its connection broke ({e.strerror or e})")
            return
        if not chunk:
            self.refuse(s, f"closed after {len(buf)} of {_HANDSHAKE.size} handshake bytes")
            return
        buf += chunk
        if len(buf) < _HANDSHAKE.size:
            return
        why, peer, flow = _judge(bytes(buf), self.token, self.expected, self.rank)
        if why is not None:
            self.refuse(s, why)
            return
        del self.pending[s]
        self.sel.unregister(s)
        self.expected.discard((peer, flow))
        self.taken.append((s, peer, flow))

    def refuse(self, s: socket.socket, why: str) -> None:
        name, _, _ = self.pending.pop(s)
        self.sel.unregister(s)
        s.close()
        self.refused.append(f"{why} from {name}")
        if len(self.refused) <= _LOGGED_MAX:
            _log.warning(
                "pyasync: rank %d refused a connection to its transport set-up: %s from %s",
                self.rank,
                why,
                name,
            )

    def missing(self) -> PeerFailure:
        ranks = sorted({i for i, _ in self.expected})
        seen = ""
        if self.refused:
            n = len(self.refused)
            seen = f"; {n} other connection{'s were' if n > 1 else ' was'} refused meanwhile: " + "; ".join(
                self.refused[:8]
            )
            seen += f"; and {n - 8} more" if n > 8 else ""
        return PeerFailure(
            f"pyasync: ranks {ranks} did not connect to rank {self.rank} within {self.timeout_s:g} s while "
            f"the transport was set up (are they alive? can they reach this host?){seen}",
            ranks,
        )


def _accept_peers(
    listener: socket.socket,
    token: int,
    expected: set[tuple[int, str]],
    rank: int,
    timeout_s: float,
    end: float | None = None,
    handshake_s: float = _HANDSHAKE_S,
) -> list[tuple[socket.socket, int, str]]:
    """Accept on ``listener`` one connection per (rank, flow) in ``expected`` whose handshake carries
    ``token``: [(socket, rank, flow)]. Other connections are refused and logged, without effect on the
    others (Note [Hostile connections at set-up]). Raises PeerFailure naming the ranks still missing at
    ``end`` (a ``time.monotonic()`` value; default: ``timeout_s`` from now), with what was refused."""
    end = time.monotonic() + timeout_s if end is None else end
    return _Acceptor(listener, token, expected, rank, timeout_s, end, handshake_s).run()


class TcpTransport(Transport):
    """Point-to-point messages among the ranks of ``process_group`` over TCP.

    ``process_group`` (a gloo group; None: the default group) is used once, to exchange addresses;
    ``timeout`` bounds the set-up and every send and every message once it started arriving. It owns
    its :class:`~pyasync.transport.heartbeats.Heartbeats` (elastic membership, Note [Heartbeats])."""

    probes_liveness = True

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
        registered = groups.is_registered(process_group)  # a later epoch's group is not (session/groups.py)
        self.rank = dist.get_rank(process_group) if registered else process_group.rank()
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
        self._served = {f: -1 for f in FLOWS}  # the peer recv_any took the last message from, per flow
        self._woken = False  # the wake-up bytes are written: the pipes may be released
        self._heard: dict[int, float] = {}  # peer -> when something last came from it (heartbeats)
        self._closed = False
        self._heartbeats = Heartbeats(
            self.rank,
            self.world_size,
            socks=self._socks,
            locks=self._locks,
            heard=self._heard,
            failed=self._failed,
            gone=self._gone,
            departed=lambda: self.departed,
            closed=lambda: self._closed,
            lose=self.lose,
        )
        self._wake = {f: socket.socketpair() for f in FLOWS}
        self._sel = {f: selectors.DefaultSelector() for f in FLOWS}
        for f in FLOWS:
            self._wake[f][0].setblocking(False)
            self._sel[f].register(self._wake[f][0], selectors.EVENT_READ, None)
        if self.world_size > 1:
            self._connect(process_group)

    # -- set-up ---------------------------------------------------------------------------------------
    def _connect(self, group) -> None:
        host, listener, err = "0.0.0.0", None, None
        try:
            host = _announced()
            listener = _listen(host, max(128, 2 * self.world_size))
        except OSError as e:
            err = e  # raised after the address exchange, where port 0 tells the peers
        try:
            port = listener.getsockname()[1] if listener is not None else 0
            mine = _pack_addr(host, port, secrets.randbits(62))
            table = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(table, mine, group=group)
            if err is not None:
                raise err
            unable = [r for r in range(self.world_size) if int(table[r][1]) == 0]
            if unable:
                raise PeerFailure(
                    f"pyasync: ranks {unable} could not open their transport listener while the transport "
                    "was set up (their own error says why)",
                    unable,
                )
            token = int(table[0][2])  # rank 0's token names the job
            deadline = Deadline(self.timeout_s)
            for j in range(self.rank + 1, self.world_size):
                addr = (socket.inet_ntoa(int(table[j][0]).to_bytes(4, "big")), int(table[j][1]))
                for fi, f in enumerate(FLOWS):
                    s = None
                    try:
                        s = socket.create_connection(addr, timeout=deadline.left())
                        s.sendall(_HANDSHAKE.pack(_MAGIC, token, self.rank, fi))
                    except OSError as e:
                        if s is not None:
                            s.close()
                        raise PeerFailure(
                            f"pyasync: rank {self.rank} could not connect to rank {j} at {addr[0]}:{addr[1]} "
                            f"while the transport was set up ({e})",
                            [j],
                        ) from e
                    self._adopt(s, j, f)
            expected = {(i, f) for i in range(self.rank) for f in FLOWS}
            taken = _accept_peers(listener, token, expected, self.rank, self.timeout_s, deadline.end)
            for s, peer, f in taken:
                self._adopt(s, peer, f)
        except BaseException:
            self.abort()
            raise
        finally:
            if listener is not None:
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

    # -- heartbeats -----------------------------------------------------------------------------------
    def start_heartbeats(self, deadline, watched) -> None:
        """Send heartbeats and drop the ``watched()`` peers silent for ``deadline()`` seconds (Note
        [Heartbeats] in pyasync/transport/heartbeats.py)."""
        self._heartbeats.start(deadline, watched)

    def stop_heartbeats(self) -> None:
        """Stop sending heartbeats and watching for silence (bounded join)."""
        self._heartbeats.stop()

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
                head = s.recv(LENGTH.size, socket.MSG_PEEK)
                while len(head) == LENGTH.size and LENGTH.unpack(head)[0] == HEARTBEAT:
                    s.recv(LENGTH.size)  # a heartbeat nobody read: consume it, look behind it
                    if not select.select([s], [], [], 0)[0]:
                        head = None
                        break
                    head = s.recv(LENGTH.size, socket.MSG_PEEK)
                if head is None:
                    continue
                if head == b"":
                    self._fail(peer, f"its connection on flow {f} ended without a goodbye")
                elif len(head) == LENGTH.size and LENGTH.unpack(head)[0] == GAVE_UP:
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
                send_while_taken(s, [LENGTH.pack(len(view)), view], self.timeout_s)
            except TimeoutError as e:
                raise TimeoutError(
                    f"pyasync: rank {dst} did not take a {len(view)}-byte message on flow {flow}, nor any "
                    f"byte queued before it, for {self.timeout_s:g} s (is it alive? stopped? a receiver "
                    "that stopped reading?)"
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
                ready = [key for key, _ in sel.select()]
                if any(key.data is None for key in ready):  # the wake-up pipe
                    raise TransportClosed("the transport was closed")
                # Round robin over the ready peers, from the one after the peer served last (Note [Fair
                # intake] in pyasync/engine/p2p/intake.py): the selector lists them in the same order at
                # every call, so "the first ready one" would serve one sender and starve the others.
                last = self._served[flow]
                ready.sort(key=lambda key: (key.data <= last, key.data))
                for key in ready:
                    peer = key.data
                    try:
                        if self._read_one(key.fileobj, peer, flow, buf):
                            self._served[flow] = peer
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
            head = recv_exact(s, LENGTH.size)
            (n,) = LENGTH.unpack(head)
            self._heard[peer] = time.monotonic()
            if n == HEARTBEAT:
                return None
            if n == BYE:
                self._gone[flow].add(peer)
                self._sel[flow].unregister(s)
                return False
            if n == GAVE_UP:
                (m,) = LENGTH.unpack(recv_exact(s, LENGTH.size))
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
                        s.sendall(LENGTH.pack(BYE))
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
                    s.sendall(LENGTH.pack(GAVE_UP) + LENGTH.pack(len(why)) + why)
                except OSError:
                    pass
                finally:
                    lock.release()

    def _shutdown(self) -> None:
        self._heartbeats.halt()
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
