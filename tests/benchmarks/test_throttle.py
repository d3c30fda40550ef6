"""The link emulator (bench/linkemu.py): Link arithmetic, ThrottledTransport over an in-process fake and
delayed futures. All in one process; the whole file runs in about a second."""

from __future__ import annotations

import datetime
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from linkemu import Link, ThrottledTransport, complete_after, steps_behind_link

from pyasync.transport.base import Handle, Transport

SEC = datetime.timedelta(seconds=1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------------
# Link
# ---------------------------------------------------------------------------------------------------


def test_link_serialises_messages():
    clock = FakeClock()
    link = Link(1.0, clock=clock)  # 1 Gbit/s: 125_000_000 bytes per second
    assert link.seconds(125_000_000) == pytest.approx(1.0)
    assert link.reserve(125_000_000) == pytest.approx(1.0)  # free link: starts now
    clock.now = 0.5
    assert link.reserve(125_000_000) == pytest.approx(2.0)  # queues behind the first
    assert link.busy_until == pytest.approx(2.0)
    clock.now = 5.0
    assert link.reserve(0) == pytest.approx(5.0)  # idle gap: nothing carried over
    assert link.reserve(250_000_000) == pytest.approx(7.0)
    assert link.bytes_reserved == 500_000_000 and link.messages == 4


def test_link_bandwidth_scales_wire_time():
    clock = FakeClock()
    slow = Link(0.1, clock=clock)
    assert slow.reserve(1_250_000) == pytest.approx(0.1)  # 10 Mbit at 100 Mbit/s


def test_reserve_since_counts_from_when_the_bytes_were_ready():
    clock = FakeClock()
    link = Link(1.0, clock=clock)
    clock.now = 3.0
    assert link.reserve(125_000_000, since=2.5) == pytest.approx(3.5)  # ready at 2.5, on the wire since
    assert link.reserve(125_000_000, since=2.0) == pytest.approx(4.5)  # queues behind the first


def test_steps_behind_link_charges_each_steps_bytes():
    """BSP on collectives: step() returns once the bytes of its step would have left the link, those
    sent before it was called (the reduces the backward hooks launched) included."""
    clock = FakeClock()
    link = Link(1.0, clock=clock)
    slept = []

    class Opt:
        sent = 0

        def stats(self):
            return type("S", (), {"bytes_sent": self.sent})()

        def step(self):
            clock.now += 0.25  # the collectives took 0.25 s unthrottled
            self.sent += 125_000_000  # 1 s of this link
            return "stepped"

    opt = Opt()
    steps_behind_link(opt, link, sleep=lambda s: (slept.append(s), setattr(clock, "now", clock.now + s)))
    assert opt.step() == "stepped"
    assert slept == [pytest.approx(0.75)] and clock.now == pytest.approx(1.0)
    clock.now = 5.0  # a long compute phase: the link is idle again
    opt.step()
    assert slept[-1] == pytest.approx(0.75) and clock.now == pytest.approx(6.0)
    opt.sent += 125_000_000  # a reduce launched from the backward hooks, before step() is called
    clock.now = 10.0
    opt.step()
    assert slept[-1] == pytest.approx(1.75) and clock.now == pytest.approx(12.0)  # both steps' bytes
    fast = Opt()
    steps_behind_link(fast, Link(1e9, clock=clock), sleep=slept.append)
    fast.step()
    assert len(slept) == 3  # wire time shorter than the step itself: no wait


@pytest.mark.parametrize("gbps", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_link_rejects_bad_bandwidth(gbps):
    with pytest.raises(ValueError, match="bandwidth"):
        Link(gbps)


@pytest.mark.parametrize("nbytes", [-1, 1.5, True])
def test_link_rejects_bad_sizes(nbytes):
    with pytest.raises(ValueError, match="nbytes"):
        Link(1.0).reserve(nbytes)


def test_link_is_thread_safe():
    # A frozen clock: every message queues behind all others, so the returned times must be exactly
    # 1..N message times apart, with no two threads given the same slot.
    link = Link(8e-6, clock=lambda: 0.0)  # 1000 bytes take 1 s
    threads, per_thread, out = 8, 500, []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def worker() -> None:
        start.wait(timeout=10)
        mine = [link.reserve(1000) for _ in range(per_thread)]
        with lock:
            out.extend(mine)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=10)
    n = threads * per_thread
    assert len(out) == n
    assert sorted(round(x) for x in out) == list(range(1, n + 1))
    assert link.busy_until == pytest.approx(n) and link.bytes_reserved == 1000 * n


# ---------------------------------------------------------------------------------------------------
# ThrottledTransport over a fake in-process transport
# ---------------------------------------------------------------------------------------------------


class FakeHandle(Handle):
    def __init__(self, complete: threading.Event) -> None:
        self.complete = complete

    def done(self) -> bool:
        return self.complete.is_set()

    def wait(self, timeout: datetime.timedelta) -> None:
        if not self.complete.wait(timeout.total_seconds()):
            raise TimeoutError("fake send did not complete")


class FakeTransport(Transport):
    """Records when each send was issued; sends complete at once unless ``hold`` is set."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 2
        self.sent: list[tuple[float, list[int], int, str, int]] = []
        self.fail_next: BaseException | None = None
        self.hold: threading.Event | None = None
        self.closed = False
        self.recvs: list[tuple] = []

    def send(self, buf, dst, flow):
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e
        self.sent.append((time.monotonic(), buf.tolist(), dst, flow))
        done = self.hold if self.hold is not None else threading.Event()
        if self.hold is None:
            done.set()
        return FakeHandle(done)

    def recv(self, buf, src, flow, timeout=None):
        self.recvs.append(("recv", src, flow, timeout))
        buf.fill_(7)

    def recv_any(self, buf, flow):
        self.recvs.append(("recv_any", flow))
        buf.fill_(9)
        return 1

    def close(self):
        self.closed = True


def _gbps_for(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def test_sends_leave_at_link_time_in_order():
    inner = FakeTransport()
    msg_s = 0.02
    tr = ThrottledTransport(inner, Link(_gbps_for(1000, msg_s)))
    try:
        t0 = time.monotonic()
        handles = [
            tr.send(torch.full((250,), i, dtype=torch.int32), 1, flow)
            for i, flow in enumerate(["push", "push", "push", "reply", "push"])
        ]
        assert time.monotonic() - t0 < msg_s  # send() never waits for the link
        for i, h in enumerate(handles):
            h.wait(SEC)
            assert h.done()
            assert time.monotonic() - t0 >= (i + 1) * msg_s - 1e-3
        assert [s[1][0] for s in inner.sent] == [0, 1, 2, 3, 4]  # FIFO: order kept
        assert [s[3] for s in inner.sent] == ["push", "push", "push", "reply", "push"]
        for i, (t, *_rest) in enumerate(inner.sent):
            assert t - t0 >= (i + 1) * msg_s - 1e-3  # never before its last byte left the link
        assert tr.link.bytes_reserved == 5000
    finally:
        tr.close()


def test_handle_completes_only_after_the_inner_send():
    inner = FakeTransport()
    inner.hold = threading.Event()
    tr = ThrottledTransport(inner, Link(_gbps_for(1000, 0.03)))
    try:
        t0 = time.monotonic()
        h = tr.send(torch.zeros(1000, dtype=torch.uint8), 1, "push")
        assert not h.done()
        with pytest.raises(TimeoutError, match="fake send did not complete"):
            h.wait(datetime.timedelta(seconds=0.1))  # issued after 30 ms, inner still holding
        assert time.monotonic() - t0 >= 0.03 and len(inner.sent) == 1 and not h.done()
        inner.hold.set()
        h.wait(SEC)
        assert h.done()
    finally:
        tr.close()


def test_wait_times_out_on_a_link_backlog():
    tr = ThrottledTransport(FakeTransport(), Link(_gbps_for(1000, 5.0)))  # 5 s per message
    try:
        h = tr.send(torch.zeros(1000, dtype=torch.uint8), 1, "push")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="emulated link"):
            h.wait(datetime.timedelta(seconds=0.05))
        assert time.monotonic() - t0 < 1.0
    finally:
        tr.close()


def test_inner_send_errors_reach_wait():
    inner = FakeTransport()
    tr = ThrottledTransport(inner, Link(100.0))
    try:
        inner.fail_next = ValueError("buffers must be contiguous")
        bad = tr.send(torch.zeros(4), 1, "push")
        with pytest.raises(ValueError, match="contiguous"):
            bad.wait(SEC)
        assert bad.done()
        good = tr.send(torch.ones(4), 1, "push")  # the sender thread survived
        good.wait(SEC)
        assert len(inner.sent) == 1 and inner.sent[0][1] == [1.0] * 4
    finally:
        tr.close()


def test_close_stops_the_thread_and_fails_queued_sends():
    inner = FakeTransport()
    tr = ThrottledTransport(inner, Link(_gbps_for(1000, 30.0)))  # the send would wait 30 s
    h = tr.send(torch.zeros(1000, dtype=torch.uint8), 1, "push")
    t0 = time.monotonic()
    tr.close()
    assert time.monotonic() - t0 < 2.0
    assert not tr._thread.is_alive() and inner.closed
    with pytest.raises(RuntimeError, match="closed before the emulated link sent it"):
        h.wait(SEC)
    assert inner.sent == []
    with pytest.raises(RuntimeError, match="closed"):
        tr.send(torch.zeros(1), 1, "push")
    tr.close()  # idempotent


def test_receives_delegate():
    inner = FakeTransport()
    tr = ThrottledTransport(inner, Link(1.0))
    try:
        assert (tr.rank, tr.world_size) == (0, 2)
        buf = torch.zeros(3, dtype=torch.int64)
        tr.recv(buf, 1, "reply", timeout=SEC)
        assert buf.tolist() == [7, 7, 7]
        assert tr.recv_any(buf, "push") == 1 and buf.tolist() == [9, 9, 9]
        assert inner.recvs == [("recv", 1, "reply", SEC), ("recv_any", "push")]
    finally:
        tr.close()


def test_constructor_checks_types():
    with pytest.raises(TypeError, match="Transport"):
        ThrottledTransport(object(), Link(1.0))
    with pytest.raises(TypeError, match="Link"):
        ThrottledTransport(FakeTransport(), 1.0)


# ---------------------------------------------------------------------------------------------------
# Delayed futures (the DDP side of the emulation)
# ---------------------------------------------------------------------------------------------------


def test_complete_after_waits_for_the_link_time():
    fut: torch.futures.Future = torch.futures.Future()
    t0 = time.monotonic()
    out = complete_after(fut, t0 + 0.05)
    fut.set_result(torch.tensor([1.0, 2.0]))
    assert not out.done()  # the value is there, the link time is not
    assert out.wait().tolist() == [1.0, 2.0]
    assert time.monotonic() - t0 >= 0.05


def test_complete_after_waits_for_the_value():
    fut: torch.futures.Future = torch.futures.Future()
    out = complete_after(fut, time.monotonic() - 1.0)  # link time already passed
    assert not out.done()
    fut.set_result(torch.tensor([3.0]))
    assert out.done() and out.value().tolist() == [3.0]


def test_complete_after_propagates_errors():
    fut: torch.futures.Future = torch.futures.Future()
    out = complete_after(fut, time.monotonic() + 0.01)
    fut.set_exception(RuntimeError("all-reduce failed"))
    with pytest.raises(RuntimeError, match="all-reduce failed"):
        out.wait()
