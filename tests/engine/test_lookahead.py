"""Look-ahead replies and spike clipping through the engine (Note [Look-ahead replies] and Note [Spike
clipping] in pyasync/policy.py), on real processes over gloo: what a worker installs is the owner's
look-ahead of the master, what it ends with is the master itself, and replicas end equal. The math
against reference formulas is in tests/engine/test_async_math.py."""

import datetime

import pytest
import torch
from _dist import multiproc, run_workers

TIMEOUT = datetime.timedelta(seconds=30)
LR, MU = 0.05, 0.9


def _one_rank(rank, world, policy, k):
    """One rank, SSP(0) (each step waits for its answer) under ``policy``: every step it installs
    master - lr * (mu + ... + mu^k) * buf, the master and buf being torch's SGD run on the same
    gradients; after close() it holds the master."""
    import pyasync

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40))
    ref = torch.nn.Parameter(p.detach().clone())
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=LR, momentum=MU), policy=policy, timeout=TIMEOUT
    )
    ref_opt = torch.optim.SGD([ref], lr=LR, momentum=MU)
    reach = sum(MU**j for j in range(1, k + 1))
    worst = 0.0
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        target = torch.randn(40, generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        (p - target).pow(2).sum().backward()
        # The gradient was taken at the look-ahead point; torch's reference steps the same gradient.
        ref.grad = p.grad.detach().clone()
        opt.step()
        ref_opt.step()
        want = ref.detach() - LR * reach * ref_opt.state[ref]["momentum_buffer"]
        worst = max(worst, (p.detach() - want).abs().max().item())
    opt.close()
    return {"worst": worst, "final": (p.detach() - ref.detach()).abs().max().item()}


@multiproc
@pytest.mark.parametrize(
    "policy, k",
    # A fixed k; "auto" (the default) follows one rank's staleness, 0, under SSP; under ASP it spans
    # at least half the momentum's memory, 0.5 / (1 - 0.9) = 5 updates (one worker: per-round moments
    # are per push); "stale" follows the staleness under ASP too.
    [
        ("ssp:0:lookahead=3:clip=off", 3),
        ("ssp:0:clip=off", 0),
        ("asp:clip=off:patience=inf", 5),
        ("asp:lookahead=stale:clip=off:patience=inf", 0),
    ],
)
def test_one_rank_installs_the_lookahead_and_ends_on_the_master(policy, k):
    (o,) = run_workers(_one_rank, 1, args=(policy, k), timeout=120)
    assert o["worst"] < 1e-5, f"installed values differ from master - lr * reach * buf by {o['worst']}"
    assert o["final"] < 1e-5, f"after close() the parameters differ from the master by {o['final']}"


def _async_run(rank, world, policy, compression):
    """ASP with look-ahead and clipping on every rank, a straggler, momentum and Adam: the job ends, no
    parameter is non-finite, and every replica holds the same values after close()."""
    import pyasync

    out = {}
    for name, make in (
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
        ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    ):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = pyasync.DistributedOptimizer(
            make(model.parameters()), policy=policy, compression=compression, timeout=TIMEOUT
        )
        g = torch.Generator().manual_seed(10 + rank)
        for step in range(30):
            x = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            scale = 50.0 if step == 7 and rank == 1 else 1.0  # one outlier push: the clip takes it
            (scale * (model(x) - x.sum(1, keepdim=True)).pow(2).mean()).backward()
            opt.step()
            if rank == world - 1:
                torch.ones(200, 200).matmul(torch.ones(200, 200))  # a little slower
        opt.close()
        out[name] = torch.cat([q.detach().flatten() for q in model.parameters()])
    return out


@multiproc
def test_asp_with_lookahead_and_clip_ends_with_equal_finite_replicas():
    for policy, compression in (
        ("asp:lookahead=auto:clip=1.5", None),
        ("ssp:1:lookahead=auto:clip=1.5", "int8"),
    ):
        res = run_workers(_async_run, 3, args=(policy, compression), timeout=150)
        for name in ("sgd", "adamw"):
            first = res[0][name]
            assert torch.isfinite(first).all(), (policy, name)
            for r, o in enumerate(res[1:], 1):
                assert torch.equal(o[name], first), f"{policy} {name}: rank {r}'s replica differs at close()"
