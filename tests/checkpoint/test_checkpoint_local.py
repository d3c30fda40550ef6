"""Checkpoints under local steps (Note [Checkpoints under local steps] in pyasync/local.py), gloo on CPU.

* Resume mid-way between outer steps: a run saved 2 inner steps after an outer step, loaded into fresh
  models and optimizers (other values everywhere) and continued, is bit-identical to the run that never
  stopped at every later step (local:4 with inner AdamW on collectives, with int8 both ways, and point
  to point with elastic=True): replica, anchor, counts and inner state all come back.
* Asynchronous (local:4:async): each worker gets its own replica, anchor (older than the masters),
  counts and inner state back exactly, and trains on.
* Re-sharded 2 -> 3: the global values and the outer momentum whole, bit for bit; new worker v takes
  old worker v mod 2's inner state and none of its progress, and its next outer step is H steps later.
* A corrupt local part is refused on every rank before anything is loaded; a save while an outer step
  that timed out is still in flight says what to do.
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
from _ckpt import reseal, whole
from _dist import multiproc, run_workers

pytestmark = multiproc
H, SAVE_AT, MORE = 4, 6, 8  # local steps per outer step; save after step 6 (2 past an outer step); then 8


def _make(seed: int, policy: str = "local:4", **kw):
    import pyasync

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    opt = pyasync.DistributedOptimizer(
        inner,
        policy=policy,
        bucket_cap_mb=1e-4,  # several buckets, shards cut through parameters
        named_parameters=model.named_parameters(),
        timeout=datetime.timedelta(seconds=30),
        **kw,
    )
    return model, opt


def _train_step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(7919 * step + rank)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _snap(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(xs, ys) -> bool:
    return len(xs) == len(ys) and all(torch.equal(a, b) for a, b in zip(xs, ys, strict=True))


def _worker_state(opt) -> dict:
    loc = opt.local_steps
    inner = opt.optimizer.state_dict()["state"]
    return {
        "anchor": [a.clone() for a in loc.anchor],
        "counts": (loc.inner_steps, loc.outer_steps),
        "inner": [v.clone() for s in inner.values() for v in s.values() if torch.is_tensor(v)],
    }


def _resume(rank, world, root, policy, kw):
    import pyasync

    model, opt = _make(0, policy, **kw)
    for t in range(SAVE_AT):
        _train_step(model, opt, rank, t)
    pyasync.save_checkpoint(root, opt)
    at_save, state = _snap(model), _worker_state(opt)
    ref = []
    for t in range(SAVE_AT, SAVE_AT + MORE):
        _train_step(model, opt, rank, t)
        ref.append(_snap(model))
    opt.close()

    model2, opt2 = _make(100 + rank, policy, **kw)  # other values everywhere before the load
    pyasync.load_checkpoint(root, opt2)
    loaded, loaded_state = _snap(model2), _worker_state(opt2)
    got = []
    for t in range(SAVE_AT, SAVE_AT + MORE):
        _train_step(model2, opt2, rank, t)
        got.append(_snap(model2))
    clock = opt2.engine.clock
    opt2.close()
    return {
        "replica_back": _equal(at_save, loaded),
        "anchor_back": _equal(state["anchor"], loaded_state["anchor"]),
        "inner_back": _equal(state["inner"], loaded_state["inner"]) and len(state["inner"]) > 0,
        "counts": (state["counts"], loaded_state["counts"]),
        "ahead": max((a - b).abs().max().item() for a, b in zip(at_save, state["anchor"], strict=True)),
        "steps_equal": [_equal(r, g) for r, g in zip(ref, got, strict=True)],
        "after_outer": ref[H - 1 - SAVE_AT % H],  # right after the first outer step following the save
        "clock": clock,
        "moved": max((a - b).abs().max().item() for a, b in zip(got[-1], loaded, strict=True)),
        "finite": all(bool(torch.isfinite(p).all()) for p in got[-1]),
    }


@pytest.mark.parametrize(
    "policy, kw",
    [("local:4", {}), ("local:4", {"compression": "int8"}), ("local:4", {"elastic": True})],
    ids=["collectives", "int8", "p2p-elastic"],
)
def test_resume_between_outer_steps_is_bit_identical(tmp_path, policy, kw):
    res = run_workers(_resume, 3, args=(str(tmp_path), policy, kw), timeout=180)
    for rank, r in enumerate(res):
        assert r["ahead"] > 1e-4, "the save was not between outer steps (replica == anchor)"
        assert r["replica_back"] and r["anchor_back"] and r["inner_back"], (rank, r)
        assert r["counts"] == ((SAVE_AT, 1), (SAVE_AT, 1)), r["counts"]
        assert _equal(r["after_outer"], res[0]["after_outer"]), f"rank {rank} holds other global values"
        assert r["steps_equal"] == [True] * MORE, f"rank {rank}: the resumed run diverges"
        assert r["clock"] == 2 and r["moved"] > 1e-3  # outer steps at 8 and 12, and it trained
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["policy"] == "local:4" and m["clocks"] == [1, 1, 1]


def test_asynchronous_resume_gives_each_worker_its_own_state_back(tmp_path):
    """local:4:async: every worker's replica, anchor, counts and inner state come back exactly (the run
    after it is not reproducible: arrivals order the owners' steps) and it trains on."""
    res = run_workers(_resume, 3, args=(str(tmp_path), "local:4:async", {}), timeout=180)
    for rank, r in enumerate(res):
        assert r["replica_back"] and r["anchor_back"] and r["inner_back"], (rank, r)
        assert r["counts"][0] == r["counts"][1] == (SAVE_AT, 1)
        assert r["clock"] == 2 and r["finite"] and r["moved"] > 1e-3


def _reshard_save(rank, world, root):
    import pyasync

    model, opt = _make(0)
    for t in range(SAVE_AT):
        _train_step(model, opt, rank, t)
    pyasync.save_checkpoint(root, opt)
    out = {"state": _worker_state(opt), "shards": opt.state_dict()["shards"]}
    opt.close()
    return out


def _reshard_load(rank, world, root):
    import pyasync

    model, opt = _make(4 + rank)
    pyasync.load_checkpoint(root, opt)
    out = {"params": _snap(model), "state": _worker_state(opt), "shards": opt.state_dict()["shards"]}
    clocks = []
    for t in range(H):
        _train_step(model, opt, rank, SAVE_AT + t)
        clocks.append(opt.engine.clock)
    out["clocks"] = clocks
    opt.close()
    return out




def test_reshard_keeps_the_global_state_and_drops_each_workers_progress(tmp_path):
    saved = run_workers(_reshard_save, 2, args=(str(tmp_path),), timeout=120)
    loaded = run_workers(_reshard_load, 3, args=(str(tmp_path),), timeout=120)
    glob = saved[0]["state"]["anchor"]  # synchronous: every anchor is the global values
    assert _equal(glob, saved[1]["state"]["anchor"])
    for v, r in enumerate(loaded):
        assert _equal(r["params"], glob) and _equal(r["state"]["anchor"], glob), v
        assert _equal(r["state"]["inner"], saved[v % 2]["state"]["inner"]), v
        assert r["state"]["counts"] == (H, 1), r["state"]["counts"]  # a fresh period: no progress
        assert r["clocks"] == [0, 0, 0, 1], r["clocks"]  # the next outer step H steps after the load
    for b in range(len(saved[0]["shards"]) + len(saved[1]["shards"])):
        if not any(str(b) in s["shards"] for s in saved):
            continue
        for name in ("master", "state1"):  # the outer Nesterov momentum is state1
            old = whole([s["shards"] for s in saved], b, name)
            assert torch.equal(old, whole([s["shards"] for s in loaded], b, name)), (b, name)
        assert whole([s["shards"] for s in saved], b, "state1").abs().max() > 0, "no outer momentum"




def _bad(rank, world, root):
    import pyasync

    model, opt = _make(0)
    for t in range(SAVE_AT):
        _train_step(model, opt, rank, t)
    good = os.path.join(root, "good")
    pyasync.save_checkpoint(good, opt)
    opt.close()

    edits = {
        "replica": lambda sd: sd["local"]["replica"].pop(),
        "inner": lambda sd: sd["local"]["inner"]["param_groups"][0]["params"].pop(),
        "nan": lambda sd: sd["local"]["anchor"][0].fill_(float("nan")),
        "missing": lambda sd: sd.pop("local"),
    }
    out = {}
    for name, edit in edits.items():
        d = os.path.join(root, name)
        if rank == 0:
            import shutil

            shutil.copytree(good, d)
            reseal(d, 1, edit)
        torch.distributed.barrier()
        model2, opt2 = _make(50 + rank)
        before = _snap(model2)
        with pytest.raises(pyasync.CheckpointError) as e:
            pyasync.load_checkpoint(d, opt2)
        out[name] = (str(e.value), _equal(before, _snap(model2)))
        opt2.close()
    return out


def test_a_corrupt_local_part_is_refused_everywhere_and_loads_nothing(tmp_path):
    res = run_workers(_bad, 2, args=(str(tmp_path),), timeout=180)
    for rank, r in enumerate(res):
        for name, (msg, untouched) in r.items():
            assert untouched, f"rank {rank}: {name} changed the model"
            assert "nothing was loaded" in msg, msg
    msgs = {name: msg for name, (msg, _) in res[1].items()}
    assert "local['replica'] must be a list of 4 tensors" in msgs["replica"]
    assert "local['inner'] holds param groups of [3] parameters" in msgs["inner"]
    assert "local['anchor'][0]" in msgs["nan"] and "NaN" in msgs["nan"]
    assert "holds no local-steps state" in msgs["missing"]
    assert "rank(s) [1]" in res[0]["replica"][0]


def test_a_save_with_an_outer_step_in_flight_says_to_step_first():
    import pyasync
    from pyasync.local import LocalSteps

    w = torch.nn.Parameter(torch.zeros(3))
    loc = LocalSteps(pyasync.Local(2), [w], None)
    loc.pending = True
    with pytest.raises(RuntimeError, match="call step\\(\\) again"):
        loc.state_dict(torch.optim.SGD([w], lr=0.1))
