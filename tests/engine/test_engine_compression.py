"""Compression inside the engine: with error feedback no update is lost.

Worker w pushes known random gradients c[w, t]; with plain SGD every rank ends (after close) at
p0 - lr / n * sum_w (sum_t c[w, t] - e_w), where e_w is worker w's final error-feedback residual (the
part of its gradients still waiting to be sent)."""

import datetime

import torch
from _dist import multiproc, run_workers

pytestmark = multiproc
T, SIZE, LR = 8, 300, 0.5
CASES = [
    ("asp", "int8"),
    ("bsp", "int8:64"),
    ("ssp:1", "topk:0.1"),
    ("quorum:2", "sign"),
    ("asp", "fp16"),
    ("bsp", None),
]


def _grad(w: int, t: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(1000 * w + t))


def _train(rank: int, policy: str, comp: str | None, momentum: float):
    """T steps of worker ``rank`` on its known gradients, then close(); returns (parameter, optimizer)."""
    import pyasync

    p = torch.nn.Parameter(torch.zeros(SIZE))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=LR, momentum=momentum),
        policy=policy,
        compression=comp,
        timeout=datetime.timedelta(seconds=30),
    )
    for t in range(T):
        opt.zero_grad()
        (_grad(rank, t) * p).sum().backward()
        opt.step()
    opt.close()
    return p, opt


def _compression_suite(rank, world):
    out = {}
    for policy, comp in CASES:
        p, opt = _train(rank, policy, comp, momentum=0.0)
        lay = opt.bucket_layouts[0]
        res = torch.zeros(SIZE)
        for r, sh in enumerate(lay.shards):
            e = opt.compressor.residual((0, r))
            if e is not None:
                res[sh.begin : sh.end] = e
        st = opt.stats()
        out[(policy, comp)] = {
            "final": p.detach().clone(),
            "residual": res,
            "ratio": st.compression_ratio,
            "dropped": st.pushes_dropped,
        }
    return out


def test_error_feedback_loses_no_update():
    n = 2
    res = run_workers(_compression_suite, n, timeout=150)
    for case in CASES:
        finals = [r[case]["final"] for r in res]
        assert all(torch.equal(finals[0], f) for f in finals), f"{case}: replicas differ"
        assert sum(r[case]["dropped"] for r in res) == 0
        divisor = n  # SSP/ASP scale each push by 1/n; BSP and Quorum(n) average n pushes
        sent = sum(sum(_grad(w, t) for t in range(T)) - res[w][case]["residual"] for w in range(n))
        want = -LR / divisor * sent
        assert torch.allclose(finals[0], want, atol=2e-5, rtol=1e-5), (
            f"{case}: max error {(finals[0] - want).abs().max().item()}"
        )
        if case[1] is None:
            assert all(r[case]["residual"].abs().max() == 0 for r in res)
            assert res[0][case]["ratio"] == 1.0
        else:
            assert res[0][case]["ratio"] > 1.9, case


DGC_CASES = [("bsp", "topk:0.05"), ("asp", "topk:0.05"), ("ssp:1", "topk:0.2")]  # 0.2: no masking
MU = 0.9


def _dgc_suite(rank, world):
    out = {}
    for policy, comp in DGC_CASES:
        p, opt = _train(rank, policy, comp, momentum=MU)
        out[(policy, comp)] = {
            "final": p.detach().clone(),
            "shards": [(sh.begin, sh.end) for sh in opt.bucket_layouts[0].shards],
            "bound": opt.compressor.momentum,
            "dropped": opt.stats().pushes_dropped,
        }
    return out


def test_momentum_corrected_topk_ledger():
    """TopK under SGD momentum takes the momentum step on the workers (dgc="auto"): every worker's
    pushes are exactly what pyasync.reference.topk.dgc_encode sends for its gradients, slice by
    slice (factor masking where ratio < 1 - momentum), and the owners apply them with momentum 0, so
    every rank ends at -lr / n times the sum of everything sent. Owners that also applied their own
    momentum would land far from it."""
    from pyasync.ops.codecs import topk_count
    from pyasync.reference.topk import dgc_encode

    n = 2
    res = run_workers(_dgc_suite, n, timeout=150)
    for case in DGC_CASES:
        finals = [r[case]["final"] for r in res]
        assert all(torch.equal(finals[0], f) for f in finals), f"{case}: replicas differ"
        assert sum(r[case]["dropped"] for r in res) == 0
        assert res[0][case]["bound"] == MU, f"{case}: momentum correction not bound"
        ratio = float(case[1].split(":")[1])
        sent = torch.zeros(SIZE, dtype=torch.float64)
        for w in range(n):
            for a, z in res[0][case]["shards"]:
                if z == a:
                    continue
                k = topk_count(z - a, ratio)
                u, e = torch.zeros(z - a), torch.zeros(z - a)
                for t in range(T):
                    pay, u, e = dgc_encode(_grad(w, t)[a:z].contiguous(), u, e, k, MU, mask=ratio < 1 - MU)
                    sent[a:z].index_add_(0, pay.indices.long(), pay.codes.double())
        want = (-LR / n * sent).float()
        assert torch.allclose(finals[0], want, atol=2e-5, rtol=1e-5), (
            f"{case}: max error {(finals[0] - want).abs().max().item()}"
        )
