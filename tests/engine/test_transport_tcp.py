"""The TCP transport (pyasync/transport/tcp.py): messages between real processes over loopback, a dead
peer named exactly, receivers that abort() wakes, goodbyes that are not failures."""

import datetime
import os
import signal
import socket
import threading

import pytest
import torch
import torch.distributed as dist
from _dist import multiproc, run_workers

from pyasync.errors import PeerFailure
from pyasync.transport import tcp
from pyasync.transport.base import TransportClosed
from pyasync.transport.sockets import LENGTH

TIMEOUT = datetime.timedelta(seconds=20)


def _exchange(rank, world):
    tr = tcp.TcpTransport(None, TIMEOUT)
    got = {}
    try:
        for flow in ("push", "reply"):
            for dst in range(world):
                if dst != rank:
                    msg = torch.arange(1000 + rank * 10 + dst, dtype=torch.int32)
                    tr.send(msg.view(torch.uint8), dst, flow)
            buf = torch.zeros(8 << 20, dtype=torch.uint8)
            for _ in range(world - 1):
                src = tr.recv_any(buf, flow)
                n = (1000 + src * 10 + rank) * 4
                got[(flow, src)] = torch.equal(
                    buf[:n].view(torch.int32), torch.arange(n // 4, dtype=torch.int32)
                )
        big = torch.randint(0, 255, (6 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        if rank == 0:
            tr.send(big, 1, "push")  # larger than the socket buffers: the receiver drains it while it is sent
        elif rank == 1:
            buf = torch.zeros(8 << 20, dtype=torch.uint8)
            assert tr.recv_any(buf, "push") == 0
            got["big"] = torch.equal(buf[: big.numel()], big)
        small = torch.zeros(4, dtype=torch.uint8)
        if rank == 1:
            tr.send(torch.zeros(64, dtype=torch.uint8), 0, "reply")
        elif rank == 0:
            try:
                tr.recv_any(small, "reply")
            except ValueError as e:
                got["too_big"] = str(e)
    finally:
        dist.barrier()
        tr.close()
    return got


@multiproc
def test_messages_arrive_whole_from_every_peer_on_every_flow():
    res = run_workers(_exchange, 3, timeout=120)
    for rank, got in enumerate(res):
        assert all(v for k, v in got.items() if k != "too_big"), (rank, got)
        assert len([k for k in got if isinstance(k, tuple)]) == 4
    assert res[1]["big"] is True
    assert "rank 1 sent a 64-byte message" in res[0]["too_big"] and "4-byte" in res[0]["too_big"]


def _dead_peer(rank, world):
    tr = tcp.TcpTransport(None, TIMEOUT)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    buf = torch.zeros(64, dtype=torch.uint8)
    try:
        tr.recv_any(buf, "push")
        seen = None
    except PeerFailure as e:
        seen = (e.ranks, str(e))
    try:
        tr.send(torch.zeros(8, dtype=torch.uint8), 2, "reply")
        sent = None
    except PeerFailure as e:
        sent = e.ranks
    failed = tr.failed()
    tr.close()  # a goodbye to the other survivor: its view of who failed must stay {2}
    return seen, sent, sorted(failed)


@multiproc
def test_a_dead_peer_is_named_on_receive_and_on_send():
    codes: list = []
    res = run_workers(_dead_peer, 3, timeout=120, may_die=[2], exitcodes=codes)
    for rank in (0, 1):
        seen, sent, failed = res[rank]
        assert seen is not None and seen[0] == (2,) and "rank 2 failed" in seen[1], seen
        assert sent == (2,) and failed == [2]
    assert codes[2] == -signal.SIGKILL and codes[0] == 0 and codes[1] == 0, codes


def _abort_wakes(rank, world, done):
    tr = tcp.TcpTransport(None, TIMEOUT)
    out = {}
    if rank == 1:  # stays connected, silent, until rank 0 is done
        assert done.wait(60)
        tr.close()
        return out

    def wait():
        try:
            tr.recv_any(torch.zeros(8, dtype=torch.uint8), "push")
        except TransportClosed:
            out["woken"] = True

    th = threading.Thread(target=wait)
    th.start()
    th.join(0.5)  # it waits: nothing will arrive
    out["was_waiting"] = th.is_alive()
    tr.abort()
    th.join(10)
    out["joined"] = not th.is_alive()
    done.set()
    return out


@multiproc
def test_abort_wakes_a_waiting_receiver():
    import torch.multiprocessing as mp

    done = mp.get_context("spawn").Event()
    out = run_workers(_abort_wakes, 2, args=(done,), timeout=60)[0]
    assert out == {"was_waiting": True, "woken": True, "joined": True}


def _goodbye(rank, world):
    tr = tcp.TcpTransport(None, TIMEOUT)
    if rank == 0:
        tr.send(torch.ones(4, dtype=torch.uint8), 1, "push")
        tr.close()  # a goodbye: rank 1 must not see a failure
        return None
    buf = torch.zeros(4, dtype=torch.uint8)
    assert tr.recv_any(buf, "push") == 0
    woke = {}

    def wait():
        try:
            tr.recv_any(buf, "push")  # only the goodbye comes: nothing to return, no failure
        except TransportClosed:
            woke["closed"] = True
        except PeerFailure as e:
            woke["failure"] = str(e)

    th = threading.Thread(target=wait)
    th.start()
    th.join(2.0)  # it must still be waiting (the goodbye is not a message, not a failure)
    still = th.is_alive()
    tr.abort()
    th.join(10)
    return still, woke, tr.failed()


@multiproc
def test_a_goodbye_is_not_a_failure():
    _, (still, woke, failed) = run_workers(_goodbye, 2, timeout=60)
    assert still and woke == {"closed": True} and failed == {}


def test_a_peer_stalled_mid_message_is_a_timeout_naming_it():
    a, b = socket.socketpair()
    try:
        b.settimeout(0.2)
        a.sendall(LENGTH.pack(100) + b"x" * 10)  # announces 100 bytes, sends 10, then nothing
        tr = object.__new__(tcp.TcpTransport)  # the read path only needs these fields
        tr._closed, tr.timeout_s, tr._failed, tr._failure = False, 0.2, {}, threading.Event()
        tr._gone, tr._sel, tr._heard = {"push": set()}, {}, {}
        with pytest.raises(TimeoutError, match="rank 3 stopped in the middle of a message"):
            tr._read_one(b, 3, "push", torch.zeros(128, dtype=torch.uint8))
    finally:
        a.close()
        b.close()
