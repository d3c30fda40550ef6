"""A resumed BSP run is bit-identical to one that never saved, with compressed replies (Int8, AdamW, 2 ranks).

Three runs of the same job (same seeds, same data): A trains K steps, saves, trains MORE steps; B trains
K steps and MORE steps and never saves; C loads A's checkpoint in fresh processes (into a model built
from another seed) and trains MORE steps. At the end A == B == C bit for bit: the parameters each rank
holds (with coded replies, the values the replies track, not the masters), the masters and optimizer
state, and the parameters after close() (the masters). Under BSP on collectives (the compressed gather,
Note [Compressed replies] in engine/collective/gather.py) and on the point-to-point engine (Note [Compressed
replies on the point-to-point path] in engine/core/replies.py). B is the reference: a run that also saved
would hide a save that changes the run.

Also: a checkpoint without the held values (as older pyasync wrote) still loads, with the old behaviour
(the first reply after the load is exact); and a re-sharding load (another world size) falls back the
same way, see Note [Checkpoints and held values] in pyasync/checkpoint/save.py.
"""

from __future__ import annotations

import datetime
import io
import os

import pytest
import torch
from _dist import multiproc, run_workers

pytestmark = multiproc
K, MORE = 3, 4


def _make(policy: str, seed: int, replies: bool = True):
    import pyasync

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    opt = pyasync.DistributedOptimizer(
        base,
        policy=policy,
        compression=pyasync.compression.Int8(block=8, replies=replies),
        bucket_cap_mb=1e-4,  # several buckets, shards cut through parameters
        named_parameters=model.named_parameters(),
        timeout=datetime.timedelta(seconds=60),
    )
    return model, opt


def _step(model, opt, rank: int, t: int) -> None:
    g = torch.Generator().manual_seed(7919 * t + rank)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _end(model, opt) -> dict:
    """The state at the end of a run: parameters (held values), masters and optimizer state, then the
    parameters after close() (the masters, installed exactly)."""
    sd = opt.state_dict()
    masters = [sd["shards"][b]["master"].clone() for b in sorted(sd["shards"])]
    optim = [v.clone() for b in sorted(sd["shards"]) for _, v in sorted(sd["shards"][b]["optim"].items())]
    params = _params(model)
    opt.close()
    return {"params": params, "masters": masters, "optim": optim, "closed": _params(model)}


def _train_ab(rank, world, root, policy, replies):
    import pyasync

    out = {}
    for run in ("A", "B"):
        model, opt = _make(policy, seed=0, replies=replies)
        for t in range(K):
            _step(model, opt, rank, t)
        if run == "A":
            before = _params(model)
            pyasync.save_checkpoint(os.path.join(root, "ckpt"), opt)
            out["save_kept_params"] = all(
                torch.equal(a, b) for a, b in zip(before, _params(model), strict=True)
            )
        for t in range(K, K + MORE):
            _step(model, opt, rank, t)
        out[run] = _end(model, opt)
    return out


def _train_c(rank, world, root, policy, replies, ckpt="ckpt"):
    import pyasync

    model, opt = _make(policy, seed=100 + rank, replies=replies)  # other values everywhere before the load
    pyasync.load_checkpoint(os.path.join(root, ckpt), opt)
    for t in range(K, K + MORE):
        _step(model, opt, rank, t)
    return _end(model, opt)


def _same(a: dict, b: dict) -> list[str]:
    """The entries of two end states that differ (bit for bit), with the largest difference."""
    bad = []
    for key in ("params", "masters", "optim", "closed"):
        xs, ys = a[key], b[key]
        if len(xs) != len(ys) or not all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True)):
            worst = max(((x.double() - y.double()).abs().max().item() for x, y in zip(xs, ys)), default=-1)
            bad.append(f"{key} (max |diff| {worst:.3g})")
    return bad


@pytest.mark.parametrize("policy", ["bsp", "bsp:p2p"], ids=["collectives", "p2p"])
def test_resume_equals_a_run_that_never_saved(tmp_path, policy):
    ab = run_workers(_train_ab, 2, args=(str(tmp_path), policy, True), timeout=240)
    c = run_workers(_train_c, 2, args=(str(tmp_path), policy, True), timeout=240)
    for rank in range(2):
        assert ab[rank]["save_kept_params"], f"rank {rank}: save_checkpoint changed the parameters"
        diff_ab = _same(ab[rank]["A"], ab[rank]["B"])
        assert not diff_ab, f"rank {rank}: the run that saved differs from one that never saved: {diff_ab}"
        diff_bc = _same(ab[rank]["B"], c[rank])
        assert not diff_bc, f"rank {rank}: the resumed run differs from one that never saved: {diff_bc}"
        moved = max(
            (x - y).abs().max().item() for x, y in zip(ab[rank]["B"]["params"], ab[rank]["B"]["closed"])
        )
        assert moved > 0, f"rank {rank}: the held values equal the masters: the replies were not coded"


def _strip_held(rank, world, root):
    """Rewrite this rank's shard file of ``root/ckpt`` into ``root/old`` without the held values (what
    pyasync wrote before they were saved), resealing the manifest's size and sha256."""
    import hashlib
    import json
    import shutil

    src, dst = os.path.join(root, "ckpt"), os.path.join(root, "old")
    if rank == 0:
        shutil.copytree(src, dst)
    torch.distributed.barrier()
    mpath = os.path.join(dst, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    entry = m["shards"][rank]
    fpath = os.path.join(dst, entry["file"])
    sd = torch.load(fpath, weights_only=True)
    had = [b for b, d in sd["shards"].items() if d.pop("held", None) is not None]
    buf = io.BytesIO()
    torch.save(sd, buf)
    data = buf.getvalue()
    with open(fpath, "wb") as f:
        f.write(data)
    table = [None] * world
    torch.distributed.all_gather_object(table, (len(data), hashlib.sha256(data).hexdigest()))
    if rank == 0:
        for s, (size, digest) in zip(m["shards"], table, strict=True):
            s["bytes"], s["sha256"] = size, digest
        with open(mpath, "w") as f:
            json.dump(m, f)
    torch.distributed.barrier()
    return bool(had)


@pytest.mark.parametrize("policy", ["bsp", "bsp:p2p"], ids=["collectives", "p2p"])
def test_checkpoint_without_held_values_still_loads(tmp_path, policy):
    """An older checkpoint (no held values) loads: the masters are installed, the run goes on with an
    exact first reply (so it differs from B only by what the codec had not yet delivered at the save)."""
    run_workers(_train_ab, 2, args=(str(tmp_path), policy, True), timeout=240)
    had = run_workers(_strip_held, 2, args=(str(tmp_path),), timeout=120)
    assert all(had), "the new checkpoint does not carry the held values"
    c = run_workers(_train_c, 2, args=(str(tmp_path), policy, True, "old"), timeout=240)
    for rank in range(2):
        assert all(torch.isfinite(p).all() for p in c[rank]["closed"])
    assert all(torch.equal(x, y) for x, y in zip(c[0]["closed"], c[1]["closed"], strict=True))
