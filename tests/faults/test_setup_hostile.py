"""The TCP transport's set-up (pyasync/transport/tcp.py, Note [Hostile connections at set-up]) against
connections that are not the job's: one that sends 2 bytes and holds, one with a full handshake and a
wrong token, one that connects and sends nothing. Real processes on loopback; the attacker is a thread
of the test process, told each rank's listening port as the rank announces it.

How the attacker learns the port: each rank wraps ``tcp._pack_addr`` (called with the listener's port
right after ``listen()``, before the address table is all-gathered), sends the port to the attacker and
waits until it is attacked. So the attacker's connections are in the listener's queue before any peer's:
the set-up meets them first, as it would under a port scan."""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import threading

import pytest
import torch
from _dist import multiproc, run_workers
from _faults import ctx

import pyasync
from pyasync.errors import PeerFailure
from pyasync.transport import tcp

TIMEOUT = datetime.timedelta(seconds=20)
WORLD = 4
STEPS = 6
OTHER = "127.0.0.2"  # a loopback address that is not the announced one (Linux routes all of 127/8 here)


def _on_listen(rank: int, ports, acks, first: int) -> None:
    """In a rank: from the ``first``-th transport set-up on, tell the attacker (rank, set-up, host, port)
    and wait until it has attacked."""
    pack, calls = tcp._pack_addr, [0]

    def announce(host, port, token):
        calls[0] += 1
        if calls[0] >= first:
            ports.put((rank, calls[0], host, port))
            acks[rank].get(timeout=60)  # bounded: the attacker answers at once, or the test fails
        return pack(host, port, token)

    tcp._pack_addr = announce


class Attacker:
    """A thread of the test process that attacks every announced listener three ways and holds its
    connections open until ``stop()``; it also tries the listener's port on another local address."""

    def __init__(self, world: int) -> None:
        c = ctx()
        self.ports = c.Queue()
        self.acks = [c.Queue() for _ in range(world)]
        self.held: list[socket.socket] = []
        self.seen: list[tuple[int, int, str, int, str]] = []  # rank, set-up, host, port, other address
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                item = self.ports.get(timeout=600)
            except queue.Empty:
                return
            if item is None:
                return
            rank, call, host, port = item
            try:
                self.held += self._attack(host, port)
                self.seen.append((rank, call, host, port, self._other(port)))
            except OSError as e:
                self.errors.append(f"rank {rank}: {e!r}")
            finally:
                self.acks[rank].put(True)

    @staticmethod
    def _attack(host: str, port: int) -> list[socket.socket]:
        two = socket.create_connection((host, port), timeout=10)
        two.sendall(b"\x50\x59")  # 2 bytes of a handshake, then nothing
        wrong = socket.create_connection((host, port), timeout=10)
        wrong.sendall(tcp._HANDSHAKE.pack(tcp._MAGIC, 12345, 0, 0))  # claims rank 0, flow 0: wrong token
        silent = socket.create_connection((host, port), timeout=10)  # connects, says nothing
        return [two, wrong, silent]

    @staticmethod
    def _other(port: int) -> str:
        try:
            with socket.create_connection((OTHER, port), timeout=5):
                return "connected"
        except ConnectionRefusedError:
            return "refused"

    def stop(self) -> None:
        self.ports.put(None)
        self.thread.join(30)
        for s in self.held:
            s.close()


def _train(rank: int, world: int, ports, acks, first: int, victim: int | None):
    os.environ["PYASYNC_SOCKET_ADDR"] = "127.0.0.1"
    _on_listen(rank, ports, acks, first)
    p = torch.nn.Parameter(torch.zeros(64))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.1), policy="asp", timeout=TIMEOUT, elastic=victim is not None
    )
    for t in range(STEPS * 2 if victim is not None else STEPS):
        if rank == victim and t == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        p.grad = torch.full_like(p, float(rank + 1))
        opt.step()
    opt.close()
    st = opt.stats()
    return {"p": p.detach().clone(), "epochs": st.epochs, "clock": st.clock}


@multiproc
def test_hostile_connections_do_not_break_the_constructor():
    """On main, each rank that accepts read the 2-byte connection's handshake under the whole set-up
    deadline, one connection at a time: all ranks failed the constructor ("TimeoutError: timed out")."""
    att = Attacker(WORLD)
    try:
        res = run_workers(_train, WORLD, args=(att.ports, att.acks, 1, None), timeout=150)
    finally:
        att.stop()
    assert not att.errors, att.errors
    assert sorted(r for r, *_ in att.seen) == list(range(WORLD)), att.seen
    for rank, call, host, port, other in att.seen:
        assert host == "127.0.0.1" and call == 1, att.seen
        # Bound to the announced address: the same port on another local address is closed.
        assert other == "refused", (rank, port, other)
    for r in res:
        assert r["clock"] == STEPS and r["epochs"] == []
        torch.testing.assert_close(r["p"], res[0]["p"], rtol=0, atol=0)
    assert float(res[0]["p"].abs().sum()) > 0  # the steps did move the parameters


@multiproc
def test_hostile_connections_during_an_epoch_change_drop_no_one():
    """Rank 2 is killed; the survivors' new transport (their second set-up) is attacked: the epoch change
    still loses rank 2 only, and every survivor trains on to the end."""
    victim = 2
    att = Attacker(WORLD)
    try:
        res = run_workers(
            _train, WORLD, args=(att.ports, att.acks, 2, victim), timeout=200, may_die=(victim,)
        )
    finally:
        att.stop()
    assert not att.errors, att.errors
    survivors = [r for r in range(WORLD) if r != victim]
    assert sorted(r for r, *_ in att.seen) == survivors, att.seen  # the epoch change's set-ups
    assert all(call == 2 and other == "refused" for _, call, _, _, other in att.seen), att.seen
    assert res[victim] is None
    for r in survivors:
        (ep,) = res[r]["epochs"]
        assert ep["lost"] == [victim] and ep["members"] == survivors, ep
        assert res[r]["clock"] == STEPS * 2
        torch.testing.assert_close(res[r]["p"], res[survivors[0]]["p"], rtol=0, atol=0)


# -- the acceptor alone, in this process ------------------------------------------------------------


def _listener() -> tuple[socket.socket, int]:
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    return ls, ls.getsockname()[1]


def test_a_stalled_connection_does_not_hold_up_a_peer_behind_it():
    ls, port = _listener()
    held = []
    try:
        held.append(socket.create_connection(("127.0.0.1", port)))
        held[0].sendall(b"\x50\x59")  # first in the queue, stalls
        held.append(socket.create_connection(("127.0.0.1", port)))
        held[1].sendall(tcp._HANDSHAKE.pack(tcp._MAGIC, 7, 0, 1))
        got = tcp._accept_peers(ls, 7, {(0, tcp.FLOWS[1])}, rank=1, timeout_s=60.0)
        assert [(peer, flow) for _, peer, flow in got] == [(0, tcp.FLOWS[1])]
        for s, _, _ in got:
            s.close()
    finally:
        ls.close()
        for s in held:
            s.close()


def test_missing_ranks_are_named_with_what_was_refused():
    ls, port = _listener()
    held = []
    try:
        wrong = socket.create_connection(("127.0.0.1", port))
        wrong.sendall(tcp._HANDSHAKE.pack(tcp._MAGIC, 8, 0, 0))  # another job's token
        short = socket.create_connection(("127.0.0.1", port))
        short.sendall(b"\x50\x59")
        short.shutdown(socket.SHUT_WR)  # 2 bytes, then the end
        stall = socket.create_connection(("127.0.0.1", port))  # nothing at all
        junk = socket.create_connection(("127.0.0.1", port))
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 40)  # not pyasync
        held += [wrong, short, stall, junk]
        expected = {(0, f) for f in tcp.FLOWS}
        with pytest.raises(PeerFailure) as ei:
            tcp._accept_peers(ls, 7, expected, rank=1, timeout_s=1.0, handshake_s=0.3)
        msg = str(ei.value)
        assert ei.value.ranks == (0,), msg
        assert "ranks [0] did not connect to rank 1" in msg, msg
        assert "4 other connections were refused" in msg, msg
        for what in ("wrong token", "closed after 2 of 32 handshake bytes", "no handshake", "not a pyasync"):
            assert what in msg, (what, msg)
        assert f"from 127.0.0.1:{wrong.getsockname()[1]}" in msg, msg
    finally:
        ls.close()
        for s in held:
            s.close()


def test_the_listener_binds_the_announced_address(monkeypatch):
    monkeypatch.setenv("PYASYNC_SOCKET_ADDR", "127.0.0.1")
    monkeypatch.delenv("PYASYNC_SOCKET_BIND", raising=False)
    ls = tcp._listen(tcp._announced())
    try:
        assert ls.getsockname()[0] == "127.0.0.1"
    finally:
        ls.close()
    monkeypatch.setenv("PYASYNC_SOCKET_BIND", "0.0.0.0")  # the override (NAT)
    ls = tcp._listen(tcp._announced())
    try:
        assert ls.getsockname()[0] == "0.0.0.0"
    finally:
        ls.close()
    monkeypatch.delenv("PYASYNC_SOCKET_BIND")
    monkeypatch.setenv("PYASYNC_SOCKET_ADDR", "198.51.100.7")  # not an address of this host
    with pytest.raises(OSError, match="PYASYNC_SOCKET_BIND=0.0.0.0"):
        tcp._listen(tcp._announced())
