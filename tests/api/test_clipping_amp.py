"""Gradient clipping inside the engine (max_grad_norm) and torch.amp.GradScaler, under every policy.

* BSP clips the mean gradient: it equals DDP followed by torch.nn.utils.clip_grad_norm_.
* SSP, ASP and Quorum clip each worker's push to the norm (exact on a one-hot ledger).
* GradScaler: the scale is divided out exactly; a rank that finds an inf skips its push and nothing
  deadlocks, under every policy. bfloat16 autocast, which torch supports on the CPU.
"""

import copy
import datetime

import pytest
import torch
from _dist import multiproc, run_workers

pytestmark = multiproc
TIMEOUT = datetime.timedelta(seconds=60)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _bsp_vs_ddp(rank, world, max_norm, policy, steps=12):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pyasync

    model = _model(0)
    ref = DDP(copy.deepcopy(model))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
        policy=policy,
        max_grad_norm=max_norm,
        bucket_cap_mb=0.0002,
        timeout=TIMEOUT,  # several buckets: the norm spans all of them
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    worst, norms = 0.0, []
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        norms.append(
            (float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)), opt.stats().grad_norm)
        )
        ref_opt.step()
        worst = max(
            worst, max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
        )
    n_buckets = len(opt.bucket_layouts)
    opt.close()
    return worst, norms, n_buckets


@pytest.mark.parametrize(("policy", "world"), [("bsp", 2), ("bsp", 3), ("bsp:p2p", 3)])
def test_bsp_with_max_grad_norm_equals_ddp_with_clip_grad_norm(policy, world):
    res = run_workers(_bsp_vs_ddp, world, args=(0.05, policy), timeout=180)
    for rank, (worst, norms, n_buckets) in enumerate(res):
        assert n_buckets >= 2
        assert worst < 2e-5, f"rank {rank}: BSP + max_grad_norm differs from DDP + clip_grad_norm_ by {worst}"
        for ddp_norm, ours in norms:
            assert ours == pytest.approx(ddp_norm, rel=1e-4), norms
        assert all(d > 0.05 for d, _ in norms[:3]), "the norm was never above max_norm: nothing was clipped"


STEPS = 5


def _clip_each(rank, world, policy, max_norm):
    """One-hot ledger: rank r's gradient at step t is -(r + 2) at position t * world + r, so its norm is
    r + 2 and its push, clipped, is -min(r + 2, max_norm)."""
    import pyasync

    p = torch.nn.Parameter(torch.zeros(STEPS * world))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), policy=policy, max_grad_norm=max_norm, timeout=TIMEOUT
    )
    norms = []
    for t in range(STEPS):
        w = torch.zeros_like(p)
        w[t * world + rank] = rank + 2.0
        opt.zero_grad()
        (-(w * p).sum()).backward()
        opt.step()
        norms.append(opt.stats().grad_norm)
    opt.close()
    return p.detach().clone(), norms


@pytest.mark.parametrize("policy", ["ssp:1", "asp", "quorum:3"])
def test_each_push_is_clipped_under_ssp_asp_and_quorum(policy):
    world, max_norm = 3, 2.5
    res = run_workers(_clip_each, world, args=(policy, max_norm), timeout=120)
    final = res[0][0]
    divisor = 3 if policy == "quorum:3" else world  # every push is in a round here: quorum:3 of 3 = all
    for r in range(world):
        assert torch.equal(res[r][0], final)
        assert res[r][1] == [pytest.approx(r + 2.0)] * STEPS  # the push's norm, before clipping
        want = min(r + 2.0, max_norm) / divisor
        got = final[[t * world + r for t in range(STEPS)]]
        assert torch.allclose(got, torch.full_like(got, want), rtol=1e-6), (r, got, want)


def _amp(rank, world, policy, use_scaler, inf_at):
    import pyasync

    model = _model(1)
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, timeout=TIMEOUT
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if use_scaler else None
    g = torch.Generator().manual_seed(7 + rank)
    scales = []
    for t in range(6):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if (t, rank) == inf_at:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    opt.close()
    st = opt.stats()
    return [p.detach().clone() for p in model.parameters()], scales, st.nonfinite_skipped


@pytest.mark.parametrize("policy", ["bsp", "ssp:1", "asp", "quorum:2"])
def test_grad_scaler_skips_an_inf_on_one_rank_without_deadlock(policy):
    world = 3
    res = run_workers(_amp, world, args=(policy, True, (3, 1)), timeout=120)
    for r in range(world):
        assert all(torch.equal(a, b) for a, b in zip(res[r][0], res[0][0])), "replicas differ after close()"
        assert all(torch.isfinite(a).all() for a in res[r][0])
    assert res[1][1][3] == res[1][1][2] / 2, res[1][1]  # rank 1 found the inf and halved its scale
    assert res[0][1][3] == res[0][1][2], res[0][1]  # the others did not
    assert sum(r[2] for r in res) >= 1, "no owner counted rank 1's skipped push"


def test_grad_scaler_unscales_exactly():
    """Scales are powers of two: BSP with a GradScaler ends bit-identical to BSP without one."""
    with_scaler = run_workers(_amp, 2, args=("bsp", True, None), timeout=120)
    without = run_workers(_amp, 2, args=("bsp", False, None), timeout=120)
    for a, b in zip(with_scaler[0][0], without[0][0]):
        assert torch.equal(a, b)


def _unscale_then_clip(rank, world):
    """The AMP recipe with user-side clipping: unscale_, clip_grad_norm_, step (edits after backward)."""
    import pyasync

    model = _model(2)
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), policy="bsp", timeout=TIMEOUT
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ref = copy.deepcopy(model)
    ref_opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(ref.parameters(), lr=0.1), policy="bsp", max_grad_norm=None, timeout=TIMEOUT
    )
    g = torch.Generator().manual_seed(3 + rank)
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        scaler.step(opt)
        scaler.update()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        ref_opt.step()
    opt.close()
    ref_opt.close()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def test_grad_scaler_unscale_and_clip_before_step():
    for worst in run_workers(_unscale_then_clip, 2, timeout=120):
        assert worst < 1e-6, worst
