"""SSP(s) bounds, read from the parameters themselves; no lost update under SSP/ASP.

Every push carries a one-hot gradient: worker w at clock t pushes -n on element w*T + t of a parameter
vector, so with plain SGD (lr 1) the push moves exactly that element from 0 to 1. The installed
parameters therefore show exactly which pushes are included, and a worker starting clock t must see
element w*T + c equal to 1 for every worker w and every clock c <= t - s - 1.
"""

import datetime
import random
import time

import pytest
import torch
from _dist import multiproc, run_workers

pytestmark = multiproc
T = 12  # steps per worker


def _onehot_run(rank, world, policy, s, delays, lr_scale_check=False, own=None):
    import pyasync

    n, parts = world, 4
    size = n * T // parts
    params = [torch.nn.Parameter(torch.zeros(size)) for _ in range(parts)]
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(params, lr=1.0),
        policy=policy,
        bucket_cap_mb=20 / 2**20,
        timeout=datetime.timedelta(seconds=30),
    )
    rng = random.Random(rank * 7919 + hash(policy) % 1000)
    violations, seen_missing = [], 0
    for t in range(T):
        flat = torch.cat([p.detach() for p in params])
        assert set(flat.unique().tolist()) <= {0.0, 1.0} or lr_scale_check, flat
        if s is not None:
            for w in range(n):
                for c in range(t):
                    got = flat[w * T + c].item()
                    if c <= t - s - 1 and got != 1.0:
                        violations.append((t, w, c, got))
                    if got == 0.0:
                        seen_missing += 1
        if own is not None:  # ASP's max_unanswered: the worker's own pushes of clocks <= t - own - 1
            mine = flat[rank * T : rank * T + max(0, t - own)]
            violations += [(t, rank, c, v) for c, v in enumerate(mine.tolist()) if v != 1.0]
        if delays:
            time.sleep(rng.random() * (0.03 if rank == n - 1 else 0.005))  # injected delay, rank n-1 slowest
        opt.zero_grad()
        (-float(n) * torch.cat(list(params))[rank * T + t]).backward()
        opt.step()
    opt.close()
    st = opt.stats()
    final = torch.cat([p.detach() for p in params])
    owned = []  # element indices this rank owns, to match its staleness histogram
    for lay in opt.bucket_layouts:
        sh = lay.shards[rank]
        for seg in sh.segments:
            start = seg.param * size + seg.param_begin
            owned.extend(range(start, start + seg.end - seg.begin))
    nonempty = sum(1 for lay in opt.bucket_layouts for sh in lay.shards if sh.numel > 0)
    return {
        "nonempty": nonempty,
        "violations": violations,
        "seen_missing": seen_missing,
        "final": final,
        "staleness": st.staleness,
        "applied": st.pushes_applied,
        "owned": owned,
        "clock": st.clock,
        "mic": st.min_included_clock,
    }


def _ssp_suite(rank, world):
    out = {}
    for s in (0, 1, 3):
        out[f"ssp{s}"] = _onehot_run(rank, world, pyasync_policy("ssp", s), s, delays=True)
    out["asp"] = _onehot_run(rank, world, "asp", None, delays=True)
    return out


def _unanswered_suite(rank, world):
    import pyasync

    # patience=inf: the bound itself, waited for until the timeout (the default patience would let a
    # step start without an answer that is merely slow on a loaded machine)
    policies = {m: pyasync.ASP(max_unanswered=m, patience=float("inf")) for m in (0, 1, 3)}
    return {m: _onehot_run(rank, world, p, None, delays=True, own=m) for m, p in policies.items()}


def test_asp_max_unanswered_bounds_the_own_pushes_a_step_may_miss():
    """ASP(max_unanswered=m): a worker starts step t on values holding its own pushes of every clock
    <= t - m - 1 (m = 0, the default: all of them), whatever the others do; nothing is lost."""
    n = 3
    res = run_workers(_unanswered_suite, n, timeout=150)
    for m in (0, 1, 3):
        for r, out in enumerate(res):
            assert out[m]["violations"] == [], f"max_unanswered={m}: rank {r} missed {out[m]['violations']}"
            assert torch.equal(out[m]["final"], torch.ones(n * T)), (m, r, out[m]["final"])


def pyasync_policy(kind, s):
    import pyasync

    return pyasync.SSP(s)


def test_ssp_bounds_and_no_lost_update():
    n = 3
    res = run_workers(_ssp_suite, n, timeout=150)
    for name in ("ssp0", "ssp1", "ssp3", "asp"):
        finals = [r[name]["final"] for r in res]
        for r, out in enumerate(res):
            o = out[name]
            assert o["violations"] == [], (
                f"{name}: rank {r} computed on parameters missing pushes {o['violations']}"
            )
            assert o["clock"] == T
            # No lost update, none applied twice: after close every element is exactly 1 on every rank.
            assert torch.equal(o["final"], torch.ones(n * T)), f"{name}: rank {r} final {o['final']}"
            assert torch.equal(finals[0], o["final"])
            assert o["mic"] == T - 1  # after close every push of every worker is included
        # Every push of every worker to every non-empty shard was applied exactly once.
        assert sum(r[name]["applied"] for r in res) == n * T * res[0][name]["nonempty"]
    # SSP(0) never shows a missing push of an earlier clock (it equals BSP for plain SGD).
    for r in res:
        assert r["ssp0"]["violations"] == []


def _inverse_run(rank, world, policy):
    import pyasync

    n = world
    p = torch.nn.Parameter(torch.zeros(10 * n))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), policy=policy, timeout=datetime.timedelta(seconds=30)
    )
    rng = random.Random(rank)
    for _ in range(T):
        time.sleep(rng.random() * (0.03 if rank == n - 1 else 0.003))  # injected delay
        opt.zero_grad()
        (-float(n) * p.sum()).backward()  # every push moves every element by lr * factor = factor
        opt.step()
    opt.close()
    st = opt.stats()
    sh = opt.bucket_layouts[0].shards[rank]
    return {"final": p.detach().clone(), "staleness": st.staleness, "begin": sh.begin, "end": sh.end}


INVERSE = ["ssp:2:inverse", "asp:inverse"]


def _inverse_suite(rank, world):
    return {policy: _inverse_run(rank, world, policy) for policy in INVERSE}


@pytest.fixture(scope="module")
def inverse_results():
    return run_workers(_inverse_suite, 3, timeout=120)


@pytest.mark.parametrize("policy", INVERSE)
def test_lr_scale_inverse_divides_each_update_by_its_staleness(policy, inverse_results):
    res = [r[policy] for r in inverse_results]
    assert all(torch.equal(res[0]["final"], r["final"]) for r in res)
    for r in res:
        # One bucket: rank r owns one shard; its elements moved by sum over pushes of 1 / max(1, staleness).
        expected = sum(c / max(1, st) for st, c in r["staleness"].items())
        assert sum(r["staleness"].values()) == 3 * T
        got = r["final"][r["begin"] : r["end"]]
        assert torch.allclose(got, torch.full_like(got, expected), rtol=1e-5, atol=1e-5), (got, expected)
