"""on_nonfinite: a gradient holding NaN/Inf is never applied; "skip" counts it and logs once per rank with
the bucket's parameter names, "raise" raises NonFiniteGradientError on the rank that computed it after
its step completed, and training goes on afterwards with nothing lost."""

from __future__ import annotations

import datetime
import logging

import pytest
import torch
from _dist import multiproc, run_workers

TIMEOUT = datetime.timedelta(seconds=60)


def _train(opt, params, rank, steps, nan_at, catch) -> list:
    """``steps`` steps of loss -sum(params) (gradient -1 everywhere), NaN on rank 1 at the steps in
    ``nan_at``; the (step, message) of every ``catch`` that step() raised."""
    raised = []
    for t in range(steps):
        opt.zero_grad()
        loss = -sum(p.sum() for p in params)
        if rank == 1 and t in nan_at:
            loss = loss * float("nan")
        loss.backward()
        try:
            opt.step()
        except catch as e:
            raised.append((t, str(e)))
    return raised


def _run(rank, world, policy, mode):
    import pyasync

    records = []

    class Keep(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())

    logging.getLogger("pyasync").addHandler(Keep())
    model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 1, bias=False))
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        policy=policy,
        named_parameters=model.named_parameters(),
        timeout=TIMEOUT,
        on_nonfinite=mode,
    )
    params = list(model.parameters())
    # Gradients -1 for every element (loss -sum p), NaN on rank 1 at steps 1 and 3.
    raised = _train(opt, params, rank, 5, (1, 3), pyasync.NonFiniteGradientError)
    opt.close()
    st = opt.stats()
    return {
        "params": [p.detach().clone() for p in params],
        "raised": raised,
        "logs": records,
        "nonfinite": st.nonfinite_skipped,
        "applied": st.pushes_applied,
        "sent": st.pushes_sent,
    }


@multiproc
@pytest.mark.parametrize("policy", ["bsp", "asp"])
@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_nonfinite_pushes_are_skipped_counted_logged_and_raised(policy, mode):
    world = 2
    res = run_workers(_run, world, args=(policy, mode), timeout=120)
    # Every replica ends equal and finite; the ledger is exact: 10 pushes, 2 of them NaN (rank 1's
    # at steps 1 and 3, each one push per owner shard) were never applied.
    first = res[0]["params"]
    for r in res:
        assert all(torch.equal(a, b) for a, b in zip(first, r["params"]))
        assert all(torch.isfinite(p).all() for p in r["params"])
    nonfinite = sum(r["nonfinite"] for r in res)
    applied = sum(r["applied"] for r in res)
    sent = sum(r["sent"] for r in res)
    assert nonfinite == 2 * world  # 2 NaN steps x one push to each owner
    assert applied + nonfinite == sent
    # lr 1, gradient -1 per element per applied push, scaled 1/world: 8 good pushes of 10.
    for p in first:
        assert torch.equal(p, torch.full_like(p, 8 / world))
    # Rank 1 logged once, naming the parameters; rank 0 logged nothing.
    assert res[0]["logs"] == []
    assert len(res[1]["logs"]) == 1 and "0.weight" in res[1]["logs"][0] and "1.weight" in res[1]["logs"][0]
    if mode == "raise":
        assert [t for t, _ in res[1]["raised"]] == [1, 3]
        assert "non-finite gradient" in res[1]["raised"][0][1] and "0.weight" in res[1]["raised"][0][1]
        assert res[0]["raised"] == []
    else:
        assert res[0]["raised"] == [] and res[1]["raised"] == []


def test_on_nonfinite_rejects_other_values():
    import torch.distributed as dist

    import pyasync

    # Checked before torch.distributed is needed: a clear ValueError naming the argument.
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="on_nonfinite must be 'skip' or 'raise'"):
        pyasync.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), on_nonfinite="ignore")
    assert not dist.is_initialized()


def _diverging(rank, world, policy):
    """Rank 1's loss is NaN at steps 3..22 (20 in a row), finite before and after (on_nonfinite="skip")."""
    import pyasync

    p = torch.nn.Parameter(torch.zeros(8))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    opt = pyasync.DistributedOptimizer(sgd, policy=policy, timeout=TIMEOUT)
    raised = _train(opt, [p], rank, 26, range(3, 23), pyasync.DivergedError)
    opt.close()
    return {"raised": raised, "finite": bool(torch.isfinite(p).all())}


@pytest.mark.parametrize("policy", ["asp", "bsp"])
def test_a_run_whose_gradients_stay_nonfinite_raises_diverged(policy):
    """Under "skip" too: the 20th non-finite step in a row raises DivergedError on the rank that computed
    it, naming the policy and what to change; a finite step ends the streak; the model stays finite."""
    res = run_workers(_diverging, 2, args=(policy,), timeout=120)
    assert res[0]["raised"] == []
    assert [t for t, _ in res[1]["raised"]] == [22]
    msg = res[1]["raised"][0][1]
    assert "diverged on rank 1" in msg and f"Policy {policy!r}" in msg and "learning rate" in msg, msg
    assert all(r["finite"] for r in res)
