"""Sends in flight stay bounded: gloo's send handles only report completion through wait(), so every
send must be waited for exactly once, or every pushed/replied buffer stays pinned forever (a leak of a
model's worth of bytes per step). Every send goes through a ring of reused frames (Note [Frame reuse]
in pyasync/transport/frames.py): a frame is written again only after its previous send was waited for."""

import datetime

import pytest
import torch
from _dist import multiproc, run_workers

from pyasync.transport.base import Handle
from pyasync.transport.frames import FrameRing

TIMEOUT = datetime.timedelta(seconds=30)


class Recorded(Handle):
    """Like a gloo send handle: done() stays False; wait() records the order and the timeout."""

    def __init__(self, i, log, fail=False):
        self.i, self.log, self.fail = i, log, fail

    def done(self):
        return False

    def wait(self, timeout):
        self.log.append((self.i, timeout))
        if self.fail:
            raise TimeoutError(f"send {self.i} to rank 3 did not complete within {timeout}")


def test_a_ring_waits_for_each_frames_previous_send_exactly_once_before_reuse():
    log = []
    ring = FrameRing(16, torch.device("cpu"), count=2)
    for i in range(10):
        fr = ring.take(TIMEOUT)
        assert fr is ring.frames[i % 2]  # the least recently used frame
        fr.handle = Recorded(i, log)
        in_flight = sum(f.handle is not None for f in ring.frames)
        assert in_flight <= 2
    assert [i for i, _ in log] == list(range(8))  # oldest first, each once, before its frame was reused
    assert all(t == TIMEOUT for _, t in log)
    ring.drain(TIMEOUT)
    assert [i for i, _ in log] == list(range(10)) and all(f.handle is None for f in ring.frames)


def test_a_ring_raises_when_a_peer_stopped_receiving():
    ring = FrameRing(16, torch.device("cpu"), count=2)
    ring.take(TIMEOUT).handle = Recorded(0, [], fail=True)
    ring.take(TIMEOUT).handle = Recorded(1, [])
    with pytest.raises(TimeoutError, match="rank 3"):
        ring.take(TIMEOUT)


def _many_steps(rank, world, policy):
    import pyasync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), policy=policy, timeout=TIMEOUT
    )
    x = torch.randn(4, 8)
    peak = 0
    allocated = []
    for step in range(60):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        eng = opt.engine
        rings = [*eng.pusher.rings.values(), *eng.owner.replies.rings.values()]
        peak = max(peak, sum(f.handle is not None for r in rings for f in r.frames))
        n_frames = sum(len(r.frames) for r in rings)
        if step in (20, 59):
            allocated.append((eng.owner.push_pool.allocated, eng.mailbox.pool.allocated))
    pools = (eng.owner.push_pool, eng.mailbox.pool)
    allocated.append(tuple(x for p in pools for x in (p.free(), p.keep)))
    n_buckets = len(opt.bucket_layouts)
    n_shards = sum(s.numel > 0 for lay in opt.bucket_layouts for s in lay.shards)
    stats = opt.stats()
    opt.close()
    return peak, n_frames, n_buckets, n_shards, stats.pushes_sent, allocated


@multiproc
@pytest.mark.parametrize("policy", ["bsp:p2p", "asp"])
def test_engine_keeps_sends_in_flight_bounded(policy):
    res = run_workers(_many_steps, 3, args=(policy,), timeout=120)
    for peak, n_frames, n_buckets, n_shards, pushes, allocated in res:
        assert n_buckets >= 1
        assert pushes == 60 * n_shards
        # Frames: two per remote push shard, per (own shard, remote worker) reply and per control peer.
        assert n_frames <= 2 * (n_shards + n_buckets * (3 - 1) + (3 - 1)) < pushes, (n_frames, pushes)
        assert peak <= n_frames
        # Receive buffers are recycled (Note [Frame reuse]): under BSP none is made after warm-up; under
        # ASP a backlog at an applier needs more for a while (how many depends on timing), but fewer
        # than the messages received, and the pools never keep more than their cap.
        (push20, reply20), (push59, reply59), (push_free, push_keep, reply_free, reply_keep) = allocated
        if policy == "bsp:p2p":
            assert (push59, reply59) == (push20, reply20), allocated
        received = 60 * n_buckets * (3 - 1)
        assert push59 < received and reply59 < received, allocated
        assert push_free <= push_keep and reply_free <= reply_keep, allocated


def _copying_slow_owner(rank, world):
    """ASP, rank 0's owner 20 ms slower per update, and a transport that copies every received payload
    out of its receive buffer (as landing on a GPU does): the intake must still bound what rank 0 holds."""
    import sys
    from pathlib import Path

    import pyasync
    from pyasync.engine.p2p.owner import intake_limit
    from pyasync.transport.tcp import TcpTransport

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import soak

    class CopyingTcp(TcpTransport):
        def land(self, tensors, device):
            return [None if t is None else t.clone() for t in tensors], True

    soak._slow_owner_s = 0.02 if rank == 0 else 0.0
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = pyasync.DistributedOptimizer(soak.SlowOwnerSGD(model.parameters(), lr=1e-4),
                                       policy="asp:unanswered=inf",  # pushes pile up at the slow owner
                                       timeout=TIMEOUT, transport=lambda g, t: CopyingTcp(g, t))
    owner = opt.engine.owner
    held = 0
    for _ in range(150):
        opt.zero_grad()
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        held = max(held, owner.intake.out, sum(a.q.qsize() for a in owner.appliers) - owner.local_intake.out)
    limit = intake_limit(world, len(owner.route))
    opt.close()
    return held, limit, opt.stats().intake_peak


@multiproc
def test_the_intake_is_bounded_when_payloads_are_copied_out_of_their_buffers():
    (held, limit, peak), *_ = run_workers(_copying_slow_owner, 2, timeout=180)
    assert peak == limit, (peak, limit)  # the slow owner's intake filled up: the bound was exercised
    assert held <= limit, (held, limit)
