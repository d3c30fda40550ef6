"""The engine with CUDA parameters: three processes share one GPU (each with its model on cuda:0) and
talk over gloo, staging pushes and replies through host memory. Public API only
(``DistributedOptimizer``, ``step``, ``close``, ``stats``), so these tests hold while the engine's
internals change.

* BSP equals DDP run on the same GPU (DDP all-reduces the CUDA gradients over gloo), SGD with
  momentum and AdamW, two buckets.
* No lost update: worker w pushes known gradients c[w, t] for T steps, then F steps of zero gradients
  that flush its error-feedback residual (top-k sends k residual entries per step, int8 shrinks the
  residual 254-fold per step), so with plain SGD every replica must end at
  ``p0 - lr / d * sum_{w,t} c[w, t]``, d = n for BSP, SSP, ASP and Quorum(n) (each push counts 1/n)
  and d = k for Quorum(k) with late pushes folded (each push counts 1/k, none is dropped), for every
  compression none / int8 / top-k.
"""

from __future__ import annotations

import copy
import datetime
import math

import pytest
import torch
from _dist import multiproc, run_workers

pytestmark = [pytest.mark.cuda, multiproc]

WORLD = 3
TIMEOUT = datetime.timedelta(seconds=30)

# ------------------------------------------------------------------------------------------------
# BSP against DDP on one GPU

STEPS = 15


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))


def _optim(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)
    raise ValueError(kind)


def _device(name: str) -> torch.device:
    """Every rank on the same device: cuda:0 (the workers take the name so that the suites can also be
    tried on the CPU)."""
    if name == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device(name)


def _bsp_vs_ddp(rank: int, world: int, device: str = "cuda") -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pyasync

    dev = _device(device)
    out = {}
    for kind in ("sgd", "adamw"):
        model = _model(seed=rank).to(dev)  # different on every rank: both sides start from rank 0's
        ref = DDP(copy.deepcopy(model))  # gloo all-reduces the CUDA gradients through the host
        opt = pyasync.DistributedOptimizer(
            _optim(kind, model.parameters()),
            policy="bsp",
            bucket_cap_mb=1e-4,  # one bucket per layer's weight + bias at most: several buckets
            timeout=TIMEOUT,
        )
        ref_opt = _optim(kind, ref.module.parameters())
        g = torch.Generator().manual_seed(1000 + rank)
        worst = 0.0
        for _ in range(STEPS):
            x = torch.randn(16, 6, generator=g).to(dev)
            y = torch.randn(16, 4, generator=g).to(dev)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            worst = max(
                worst,
                max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.module.parameters())),
            )
        start = _model(0).to(dev)
        moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), start.parameters()))
        st = opt.stats()
        opt.close()
        out[kind] = {
            "worst": worst,
            "moved": moved,
            "clock": st.clock,
            "min_included_clock": st.min_included_clock,
            "staleness": dict(st.staleness),
            "on_device": all(p.device == dev for p in model.parameters()),
            "final": [p.detach().cpu() for p in model.parameters()],
        }
    return out


@pytest.fixture(scope="module")
def bsp_results():
    return run_workers(_bsp_vs_ddp, WORLD, timeout=120)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_bsp_equals_ddp_on_one_gpu(kind, bsp_results):
    res = [r[kind] for r in bsp_results]
    for rank, r in enumerate(res):
        what = f"rank {rank} {kind}"
        assert r["on_device"], f"{what}: the parameters left the GPU"
        assert r["moved"] > 1e-2, f"{what}: the model did not train"
        assert r["worst"] < 2e-5, f"{what}: BSP differs from DDP by {r['worst']}"
        assert r["clock"] == STEPS and r["min_included_clock"] == STEPS - 1, what
        assert set(r["staleness"]) == {0}, f"{what}: BSP applied a stale gradient: {r['staleness']}"
    for r in res[1:]:
        same = all(torch.equal(a, b) for a, b in zip(r["final"], res[0]["final"]))
        assert same, "replicas differ after close()"


# ------------------------------------------------------------------------------------------------
# No lost update, every policy, with and without compression

T, SIZE, LR = 6, 301, 0.5
SHAPE2 = (7, 13)  # a second parameter, in a bucket of its own
TOPK = 0.25
FLUSH = math.ceil(1 / TOPK) + 1  # zero-gradient steps that empty every residual (see the docstring)
# (policy, d): each applied push moves the parameters by lr / d times its gradient
POLICIES = [
    ("bsp", WORLD), ("ssp:1", WORLD), ("asp", WORLD), (f"quorum:{WORLD}", WORLD), ("quorum:2:fold", 2),
]
COMPRESSION = [None, "int8", f"topk:{TOPK}"]
CASES = [(policy, d, comp) for policy, d in POLICIES for comp in COMPRESSION]


def _grads(w: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker w's gradients at step t (CPU, seeded): zeros during the flush steps."""
    if t >= T:
        return torch.zeros(SIZE), torch.zeros(SHAPE2)
    g = torch.Generator().manual_seed(1000 * w + t)
    return torch.randn(SIZE, generator=g), torch.randn(SHAPE2, generator=g)


def _lost_update_suite(rank: int, world: int, device: str = "cuda") -> dict:
    import pyasync

    dev = _device(device)
    out = {}
    for policy, _, comp in CASES:
        p1 = torch.nn.Parameter(torch.zeros(SIZE, device=dev))
        p2 = torch.nn.Parameter(torch.zeros(SHAPE2, device=dev))
        opt = pyasync.DistributedOptimizer(
            torch.optim.SGD([p1, p2], lr=LR),
            policy=policy,
            compression=comp,
            bucket_cap_mb=1e-3,  # 1 KiB: p1 and p2 in separate buckets
            timeout=TIMEOUT,
        )
        for t in range(T + FLUSH):
            c1, c2 = _grads(rank, t)
            opt.zero_grad()
            ((c1.to(dev) * p1).sum() + (c2.to(dev) * p2).sum()).backward()
            opt.step()
        opt.close()
        st = opt.stats()
        out[(policy, comp)] = {
            "final": [p1.detach().cpu(), p2.detach().cpu()],
            "on_device": p1.device == dev and p2.device == dev,
            "clock": st.clock,
            "dropped": st.pushes_dropped,
            "applied": st.pushes_applied,
            "nonfinite": st.nonfinite_skipped,
            "ratio": st.compression_ratio,
        }
    return out


@pytest.fixture(scope="module")
def lost_update_results():
    return run_workers(_lost_update_suite, WORLD, timeout=150)


@pytest.mark.parametrize("policy, divisor, comp", CASES, ids=[f"{p}-{c or 'none'}" for p, _, c in CASES])
def test_no_lost_update(policy, divisor, comp, lost_update_results):
    res = [r[(policy, comp)] for r in lost_update_results]
    final = res[0]["final"]
    for rank, r in enumerate(res):
        assert r["on_device"], f"rank {rank}: the parameters left the GPU"
        assert r["clock"] == T + FLUSH
        assert r["dropped"] == 0 and r["nonfinite"] == 0, f"rank {rank}: {r}"
        assert r["applied"] > 0
        same = all(torch.equal(a, b) for a, b in zip(r["final"], final))
        assert same, f"rank {rank}: replicas differ after close()"
        if comp is not None:
            assert r["ratio"] > 1.5, f"rank {rank}: compression ratio {r['ratio']}"
        else:
            assert r["ratio"] == 1.0
    for i in range(2):
        pushed = sum(_grads(w, t)[i] for w in range(WORLD) for t in range(T))
        want = -LR / divisor * pushed
        err = (final[i] - want).abs().max().item()
        assert torch.allclose(final[i], want, rtol=1e-5, atol=2e-5), f"parameter {i}: max error {err}"
