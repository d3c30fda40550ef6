"""Sends in flight stay bounded: gloo's send handles only report completion through wait(), so the
engine must retire old sends by waiting on them, or every pushed/replied buffer stays pinned forever
(a leak of a model's worth of bytes per step, and a rescan of an ever longer list after every message)."""

import datetime

import pytest
import torch
from _dist import multiproc, run_workers

from pyasync.engine.owner import MAX_INFLIGHT, retire_sends
from pyasync.transport.base import Handle

TIMEOUT = datetime.timedelta(seconds=30)


class NeverDone(Handle):
    """Like a gloo send handle: done() stays False; wait() records the order and the timeout."""

    def __init__(self, i, log, fail=False):
        self.i, self.log, self.fail = i, log, fail

    def done(self):
        return False

    def wait(self, timeout):
        self.log.append((self.i, timeout))
        if self.fail:
            raise TimeoutError(f"send {self.i} to rank 3 did not complete within {timeout}")


def test_retire_waits_for_the_oldest_and_keeps_the_newest_half():
    log, handles = [], []
    for i in range(10 * MAX_INFLIGHT):
        handles.append(NeverDone(i, log))
        retire_sends(handles, TIMEOUT)
        assert len(handles) <= MAX_INFLIGHT
    waited = [i for i, _ in log]
    assert waited == list(range(len(waited)))  # oldest first, each exactly once
    assert all(t == TIMEOUT for _, t in log)
    assert [h.i for h in handles] == list(range(waited[-1] + 1, 10 * MAX_INFLIGHT))
    assert len(waited) + len(handles) == 10 * MAX_INFLIGHT  # nothing dropped without a wait


def test_retire_leaves_a_short_list_alone():
    log = []
    handles = [NeverDone(i, log) for i in range(MAX_INFLIGHT)]
    retire_sends(handles, TIMEOUT)
    assert len(handles) == MAX_INFLIGHT and log == []


def test_retire_raises_when_a_peer_stopped_receiving():
    log = []
    handles = [NeverDone(i, log, fail=(i == 0)) for i in range(MAX_INFLIGHT + 1)]
    with pytest.raises(TimeoutError, match="rank 3"):
        retire_sends(handles, TIMEOUT)


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
        eng = opt._engine
        peak = max(peak, len(eng.handles), *(len(a.handles) for a in eng.owner.appliers))
        if step in (20, 59):
            allocated.append((eng.owner.push_pool.allocated, eng.reply_pool.allocated))
    pools = (eng.owner.push_pool, eng.reply_pool)
    allocated.append(tuple(x for p in pools for x in (p._free.qsize(), p.keep)))
    n_buckets, n_shards = len(opt._engine.layouts), len(opt._engine.nonempty)
    stats = opt.stats()
    opt.close()
    return peak, n_buckets, n_shards, stats.pushes_sent, allocated


@multiproc
@pytest.mark.parametrize("policy", ["bsp", "asp"])
def test_engine_keeps_sends_in_flight_bounded(policy):
    res = run_workers(_many_steps, 3, args=(policy,), timeout=120)
    for peak, n_buckets, n_shards, pushes, allocated in res:
        assert n_buckets >= 1
        assert pushes == 60 * n_shards
        assert 2 * pushes > 2 * MAX_INFLIGHT  # far more messages than the bound
        # retired after each bucket / applier item: at most one item's sends (1 per remote peer) above
        assert peak <= MAX_INFLIGHT + (3 - 1), peak
        # Receive buffers are recycled (Note [Frame reuse]): under BSP none is made after warm-up; under
        # ASP a backlog at an applier needs more for a while (how many depends on timing), but fewer
        # than the messages received, and the pools never keep more than their cap.
        (push20, reply20), (push59, reply59), (push_free, push_keep, reply_free, reply_keep) = allocated
        if policy == "bsp":
            assert (push59, reply59) == (push20, reply20), allocated
        received = 60 * n_buckets * (3 - 1)
        assert push59 < received and reply59 < received, allocated
        assert push_free <= push_keep and reply_free <= reply_keep, allocated
