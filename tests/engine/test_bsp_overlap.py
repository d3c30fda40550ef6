"""BSP on collectives launches each bucket's reduce from the backward hooks (Note [Reduces launched from
backward]), and still reduces what ``.grad`` holds when step() is called: an edit on one rank makes every
rank reduce that bucket again. Real processes over loopback (gloo, CPU)."""

import datetime

import pytest
import torch
from _dist import multiproc, run_workers

pytestmark = multiproc
TIMEOUT = datetime.timedelta(seconds=60)
STEPS, PARAMS = 6, 4
EDIT = (2, 1, 2)  # at step 2, rank 1 scales parameter 2's gradient by 5 after backward


def _ledger(rank, world, codec, edit, grad_edits="detect"):
    """PARAMS parameters, one bucket each. At step t, rank r's gradient of parameter i is -(i + 1) at
    position t * world + r (0 elsewhere); under SGD(lr=1) each position ends at the mean gradient."""
    import pyasync

    ps = [torch.nn.Parameter(torch.zeros(STEPS * world)) for _ in range(PARAMS)]
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(ps, lr=1.0),
        policy="bsp",
        compression=codec,
        bucket_cap_mb=1e-6,
        timeout=TIMEOUT,
        grad_edits=grad_edits,
    )
    err = None
    for t in range(STEPS):
        w = torch.zeros(STEPS * world)
        w[t * world + rank] = 1.0
        opt.zero_grad()
        sum(-(i + 1) * (w * p).sum() for i, p in enumerate(ps)).backward()
        if edit is not None and t == edit[0] and edit[1] in (rank, -1):
            ps[edit[2]].grad.mul_(5.0)
        try:
            opt.step()
        except RuntimeError as e:
            err = str(e)
            break
    opt.close()  # after a failure already raised: stops without raising it again
    st = opt.stats()
    return [p.detach().clone() for p in ps], st.buckets_early, st.buckets_reencoded, err


def _expected(world, edit):
    out = []
    for i in range(PARAMS):
        v = torch.full((STEPS * world,), (i + 1) / world)
        if edit is not None and edit[2] == i:
            v[edit[0] * world + edit[1]] *= 5.0
        out.append(v)
    return out


def _run_ledger(codec, edit):
    """Every rank's (parameters, buckets launched from hooks, buckets reduced again), each parameter
    checked against the mean gradient of every step (with the edit)."""
    world = 3
    res = run_workers(_ledger, world, args=(codec, edit), timeout=120)
    for rank, (ps, _early, _again, err) in enumerate(res):
        assert err is None, err
        for i, (got, want) in enumerate(zip(ps, _expected(world, edit))):
            assert torch.allclose(got, want, rtol=0, atol=1e-6), f"rank {rank}, parameter {i}: {got}"
    return [(early, again) for _ps, early, again, _err in res]


@pytest.mark.parametrize("codec", ["none", "fp16", "topk:0.5"])
def test_reduces_launch_from_the_hooks_and_equal_the_mean(codec):
    # Every bucket of every step was launched inside backward(), none reduced twice.
    for rank, counts in enumerate(_run_ledger(codec, None)):
        assert counts == (STEPS * PARAMS, 0), (rank, counts)


@pytest.mark.parametrize("codec", ["none", "fp16", "topk:0.5"])
def test_an_edit_on_one_rank_is_reduced_again_by_every_rank(codec):
    """Rank 1 scales one bucket after its hook launched that bucket's reduce: the step applies the
    edited gradient, on every rank (rank 0 and 2, which edited nothing, reduce the bucket again too),
    and the hooks then launch nothing for the rounds of the back-off."""
    for rank, (early, again) in enumerate(_run_ledger(codec, EDIT)):
        assert again == 1, f"rank {rank}: {again} buckets reduced again, expected the edited one"
        assert early == (EDIT[0] + 1) * PARAMS, f"rank {rank}: {early} buckets launched from hooks"


def test_forbid_refuses_an_edit_after_the_hooks_launched_its_reduce():
    """grad_edits='forbid': no flags are exchanged; ranks that edit after backward() get a clear error
    instead of a step that silently reduced the unedited gradient."""
    for rank, (_ps, early, _again, err) in enumerate(
        run_workers(_ledger, 2, args=("none", (2, -1, 1), "forbid"), timeout=120)
    ):
        assert err is not None and "grad_edits='forbid'" in err and "detect" in err, (rank, err)
        assert early == 3 * PARAMS, (rank, early)
