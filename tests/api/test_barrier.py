"""opt.barrier(): ranks meet in the middle of training under every policy, including Quorum(k < n),
where a plain barrier can leave a slow rank waiting for a round nobody else will join."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
from _dist import multiproc, run_workers

TIMEOUT = datetime.timedelta(seconds=30)


def _train_with_barriers(rank, world, policy):
    import pyasync

    p = torch.nn.Parameter(torch.zeros(4 * world))
    opt = pyasync.DistributedOptimizer(torch.optim.SGD([p], lr=0.125), policy=policy, timeout=TIMEOUT)
    done = 0
    for _block in range(3):
        for t in range(6):
            if rank == world - 1 and t == 3:
                # The slow rank's push of this step arrives after the others finished the block: it is
                # late, caught up to the newest version, and its next push opens a round only it joins.
                time.sleep(1.0)
            opt.zero_grad()
            (-p.sum()).backward()
            opt.step()
            done += 1
        opt.barrier()
    opt.close()
    return done, p.detach().clone()


@multiproc
@pytest.mark.parametrize("policy", ["quorum:3", "bsp", "asp"])
def test_barrier_mid_training(policy):
    res = run_workers(_train_with_barriers, 4, args=(policy,), timeout=150)
    assert all(r[0] == 18 for r in res)
    final = res[0][1]
    assert all(torch.equal(final, r[1]) for r in res)  # close() leaves every replica equal
    assert torch.isfinite(final).all() and (final > 0).all()
