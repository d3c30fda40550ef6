"""What ``.grad`` holds when step() is called is what gets pushed (Note [What step() pushes]): edits made
between backward() and step() are seen, never raced. Real processes over loopback, every policy."""

import datetime

import pytest
import torch
from _dist import multiproc, run_workers

pytestmark = multiproc
TIMEOUT = datetime.timedelta(seconds=60)
POLICIES = ["bsp", "ssp:1", "asp", "quorum:2"]
CODECS = ["none", "fp16", "bf16", "int8", "sign", "topk:0.25"]
EDITS = ["zero_", "clip_to_0", "reassign_zeros", "set_none", "mul_0"]


def _edit(p: torch.nn.Parameter, how: str) -> None:
    if how == "zero_":
        p.grad.zero_()
    elif how == "clip_to_0":
        torch.nn.utils.clip_grad_norm_([p], max_norm=0.0)
    elif how == "reassign_zeros":
        p.grad = torch.zeros_like(p.grad)
    elif how == "set_none":
        p.grad = None
    elif how == "mul_0":
        p.grad.mul_(0.0)
    else:
        raise AssertionError(how)


def _zeroed_after_backward(rank, world):
    import pyasync

    out = {}
    for policy in POLICIES:
        for codec in CODECS:
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(64 * world))
            opt = pyasync.DistributedOptimizer(
                torch.optim.SGD([p], lr=0.5), policy=policy, compression=codec, timeout=TIMEOUT
            )
            p0 = p.detach().clone()
            for t in range(len(EDITS)):
                opt.zero_grad()
                ((t + 1 + rank) * p.square()).sum().backward()  # a gradient that would move p
                _edit(p, EDITS[t])
                opt.step()
            opt.close()
            out[(policy, codec)] = (p.detach() - p0).abs().max().item()
    return out


def test_gradients_zeroed_after_backward_never_move_a_parameter():
    """Clip to 0, zero_(), mul_(0), reassigned zeros, .grad = None: under every policy and codec the
    parameters end exactly where they started (an early encode of the unedited gradient, sent anyway,
    would move them)."""
    for rank, moved in enumerate(run_workers(_zeroed_after_backward, 2, timeout=300)):
        bad = {k: v for k, v in moved.items() if v != 0.0}
        assert not bad, f"rank {rank}: parameters moved although every gradient was zeroed: {bad}"


STEPS = 6


def _ledger(rank, world, policy, codec, scale, nan_at):
    """One-hot ledger: at step t, rank r's gradient is -1 at position t * world + r (0 elsewhere); after
    backward it is scaled by ``scale``, and at (step, rank) ``nan_at`` a NaN is written into it."""
    import pyasync

    p = torch.nn.Parameter(torch.zeros(STEPS * world))
    opt = pyasync.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), policy=policy, compression=codec,
                                       timeout=TIMEOUT)
    for t in range(STEPS):
        w = torch.zeros_like(p)
        w[t * world + rank] = 1.0
        opt.zero_grad()
        (-(w * p).sum()).backward()
        p.grad.mul_(scale)
        if (t, rank) == nan_at:
            p.grad[(t * world + rank + 1) % p.numel()] = float("nan")
        opt.step()
    opt.close()
    st = opt.stats()
    return p.detach().clone(), st.nonfinite_skipped, st.buckets_reencoded


@pytest.mark.parametrize("policy", ["bsp", "bsp:p2p", "ssp:1", "asp"])
@pytest.mark.parametrize("codec", ["none", "fp16", "topk:0.5"])
def test_a_gradient_scaled_after_backward_is_applied_scaled_exactly(policy, codec):
    world = 3
    res = run_workers(_ledger, world, args=(policy, codec, 3.0, None), timeout=120)
    final = res[0][0]
    # BSP on collectives reduces the first step's edited bucket again, then launches nothing from the
    # hooks for the next 50 rounds (Note [Reduces launched from backward]): once in all.
    again = 1 if policy == "bsp" else STEPS
    for r in range(world):
        assert torch.equal(res[r][0], final), f"rank {r}: replicas differ after close()"
        assert res[r][2] == again, f"rank {r}: {res[r][2]} buckets encoded again, expected {again}"
    # Every push applied once, x 3 (the edit), / n (the mean, or each push's 1/n under SSP/ASP).
    assert torch.equal(final, torch.full_like(final, 3.0 / world)), final


def test_quorum_applies_a_scaled_push_scaled_or_drops_it():
    world = 3
    res = run_workers(_ledger, world, args=("quorum:2", "none", 3.0, None), timeout=120)
    final = res[0][0]
    assert set(final.tolist()) <= {0.0, 1.5} and (final == 1.5).sum() >= STEPS * 2, final


@pytest.mark.parametrize("policy", ["bsp", "ssp:1", "asp", "quorum:2"])
def test_a_nan_written_after_backward_is_always_skipped(policy):
    world = 3
    nan_at = (2, 1)
    res = run_workers(_ledger, world, args=(policy, "none", 1.0, nan_at), timeout=120)
    final = res[0][0]
    assert sum(r[1] for r in res) >= 1, "no owner counted the non-finite push"
    assert torch.isfinite(final).all()
    # The push carrying the NaN is never applied: rank 1's one-hot entry of step 2 stays 0.
    assert final[nan_at[0] * world + nan_at[1]] == 0.0, final
    if policy != "quorum:2":
        others = [i for i in range(STEPS * world) if i != nan_at[0] * world + nan_at[1]]
        assert torch.equal(final[others], torch.full((len(others),), 1.0 / world)), final


def _raise_on_nan(rank, world):
    import pyasync

    p = torch.nn.Parameter(torch.zeros(4 * world))
    opt = pyasync.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), policy="bsp", on_nonfinite="raise",
                                       timeout=TIMEOUT)
    raised = []
    for t in range(4):
        opt.zero_grad()
        (-p.sum()).backward()
        if rank == 1 and t == 1:
            p.grad[0] = float("inf")
        try:
            opt.step()
        except pyasync.NonFiniteGradientError as e:
            raised.append((t, str(e)))
    opt.close()
    return raised, p.detach().clone()


def test_a_nan_written_after_backward_raises_on_the_rank_that_wrote_it():
    res = run_workers(_raise_on_nan, 2, timeout=120)
    assert res[0][0] == [] and [t for t, _ in res[1][0]] == [1], res
    assert "step 1" in res[1][0][0][1]
    # The inf is in shard 0: at step 1 that shard counted rank 1's push as zeros (BSP), so it moved by
    # 4 x 1/2 + 3 x 1/2; shard 1 got rank 1's finite slice and moved by 4 x 1.
    want = torch.tensor([3.5] * 4 + [4.0] * 4)
    assert torch.equal(res[0][1], res[1][1]) and torch.equal(res[0][1], want), res[0][1]


def _forbid(rank, world):
    import torch.distributed as dist

    import pyasync

    p = torch.nn.Parameter(torch.zeros(4 * world))
    opt = pyasync.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), policy="asp", grad_edits="forbid",
                                       timeout=TIMEOUT)
    opt.zero_grad()
    (-p.sum()).backward()
    opt.step()  # no edit: fine
    opt.zero_grad()
    (-p.sum()).backward()
    p.grad.mul_(2.0)
    try:
        opt.step()
        msg = None
    except RuntimeError as e:
        msg = str(e)
    dist.barrier()  # both ranks have failed their step: a rank that closes (aborts) now disturbs nobody
    try:
        opt.step()
        again = None
    except RuntimeError as e:
        again = str(e)
    opt.close()
    return msg, again


def test_forbid_mode_refuses_an_edit_instead_of_applying_a_stale_gradient():
    for msg, again in run_workers(_forbid, 2, timeout=120):
        assert msg is not None and "grad_edits='forbid'" in msg and "detect" in msg, msg
        assert again is not None and "forbid" in again, again  # the optimizer keeps failing with the cause
