"""Sharded checkpoints (pyasync.save_checkpoint / load_checkpoint), gloo on CPU, 2-4 ranks.

* Resume: stop at step K, save, load into a fresh model + optimizer, continue: the parameters are
  bit-identical to an uninterrupted run at every later step, on 2 and 4 ranks (SGD momentum, AdamW,
  SGD + Int8 with error feedback, a bf16 parameter).
* Corrupt, truncated, foreign and mismatched checkpoints: CheckpointError on every rank, naming the
  file and the problem on the rank that found it, and the optimizer and model are left untouched.
* An interrupted save (the manifest write fails) leaves the previous checkpoint whole and loadable.
* Re-sharding into another world size: masters and optimizer state bit for bit; error-feedback
  residuals by the rule of Note [Re-sharding residuals] (checked exactly against the saved files, 4 -> 2,
  4 -> 3, 2 -> 4), the total owed update preserved and, with plain SGD, delivered after the load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import pytest
import torch
from _ckpt import reseal, whole
from _dist import multiproc, run_workers

pytestmark = multiproc
K, MORE = 3, 4
PLAIN_LR = 0.5


def _model(seed: int, hidden: int = 7) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def _make(kind: str, seed: int, hidden: int = 7, policy: str = "bsp"):
    import pyasync

    model = _model(seed, hidden)
    comp = None
    if kind == "sgd":
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    elif kind == "adamw":
        base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    elif kind == "sgd-int8":
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        comp = pyasync.compression.Int8(block=4)
    elif kind in ("plain-int8", "plain-topk"):  # plain SGD: the applied total is a ledger of the pushes
        base = torch.optim.SGD(model.parameters(), lr=PLAIN_LR)
        comp = pyasync.compression.Int8(block=4) if kind == "plain-int8" else pyasync.compression.TopK(0.1)
    elif kind == "sgd-topk":  # momentum-corrected top-k: the workers' velocities are state
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        comp = pyasync.compression.TopK(0.3)
    elif kind == "adamw-bf16":
        model.to(torch.bfloat16)
        base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        raise ValueError(kind)
    opt = pyasync.DistributedOptimizer(
        base,
        policy=policy,
        compression=comp,
        bucket_cap_mb=1e-4,  # several buckets, shards cut through parameters
        named_parameters=model.named_parameters(),
        timeout=datetime.timedelta(seconds=30),
    )
    return model, opt


def _train_step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(8, 5, generator=g)
    y = torch.randn(8, 3, generator=g)
    opt.zero_grad()
    out = model(x.to(model[0].weight.dtype)).float()
    torch.nn.functional.mse_loss(out, y).backward()
    opt.step()


def _equal(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return len(xs) == len(ys) and all(torch.equal(a, b) for a, b in zip(xs, ys, strict=True))


def _snap(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _resume(rank, world, root, kinds):
    import pyasync

    out = {}
    for kind in kinds:
        d = os.path.join(root, kind)
        model, opt = _make(kind, seed=0)
        for t in range(K):
            _train_step(model, opt, rank, t)
        pyasync.save_checkpoint(d, opt)
        at_save = _snap(model)
        ref = []
        for t in range(K, K + MORE):
            _train_step(model, opt, rank, t)
            ref.append(_snap(model))
        opt.close()

        model2, opt2 = _make(kind, seed=100 + rank)  # different values everywhere before the load
        pyasync.load_checkpoint(d, opt2)
        loaded = _snap(model2)
        got = []
        for t in range(K, K + MORE):
            _train_step(model2, opt2, rank, t)
            got.append(_snap(model2))
        opt2.close()
        out[kind] = {
            "loaded_equal": _equal(at_save, loaded),
            "steps_equal": [_equal(r, g) for r, g in zip(ref, got, strict=True)],
            "worst": [
                max((a.float() - b.float()).abs().max().item() for a, b in zip(r, g, strict=True))
                for r, g in zip(ref, got, strict=True)
            ],
            "moved": max(
                (a.float() - b.float()).abs().max().item() for a, b in zip(ref[-1], at_save, strict=True)
            ),
        }
    return out


@pytest.mark.parametrize(
    "world, kinds",
    [(2, ("sgd", "adamw", "sgd-int8", "adamw-bf16", "sgd-topk")), (4, ("adamw", "sgd-int8", "sgd-topk"))],
    ids=["n2-sgd-adamw-int8-bf16-topk", "n4-adamw-int8-topk"],
)
def test_resume_is_bit_identical(tmp_path, world, kinds):
    """Bit-identical at every later step, on any number of ranks: a BSP owner sums the round's pushes
    in rank order, not arrival order (Note [Rank-order sum] in pyasync/engine/p2p/owner.py)."""
    res = run_workers(_resume, world, args=(str(tmp_path), kinds), timeout=180)
    for rank, r in enumerate(res):
        for kind in kinds:
            what = f"rank {rank} {kind}"
            assert r[kind]["loaded_equal"], f"{what}: loaded parameters differ from the saved ones"
            assert r[kind]["steps_equal"] == [True] * MORE, f"{what}: resumed run diverges {r[kind]['worst']}"
            assert r[kind]["moved"] > 1e-3, f"{what}: the model did not train after the save"
    m = json.loads((tmp_path / kinds[0] / "manifest.json").read_text())
    assert m["format"] == "pyasync-checkpoint" and m["world_size"] == world
    assert m["clocks"] == [K] * world
    assert len(m["shards"]) == world and all(len(s["sha256"]) == 64 for s in m["shards"])
    assert sorted(os.listdir(tmp_path / kinds[0])) == sorted(
        ["manifest.json", ".pyasync-lock"] + [s["file"] for s in m["shards"]]
    )
    assert (tmp_path / kinds[0] / ".pyasync-lock").read_bytes() == b"", "the lock was not released"


def _state(model, opt) -> list[torch.Tensor]:
    """Every tensor the load could touch: parameters, masters, optimizer state, residuals."""
    sd = opt.state_dict()
    out = _snap(model)
    for b in sorted(sd["shards"]):
        out.append(sd["shards"][b]["master"])
        out.extend(v for _, v in sorted(sd["shards"][b]["optim"].items()))
    out.extend(v for _, v in sorted(sd["residuals"].items()))
    out.append(torch.tensor([g["lr"] for g in opt.param_groups]))
    return out


def _errors(rank, world, root):
    import pyasync
    from pyasync.checkpoint import CheckpointError

    good = os.path.join(root, "good")
    model, opt = _make("sgd-int8", seed=0)
    for t in range(2):
        _train_step(model, opt, rank, t)
    pyasync.save_checkpoint(good, opt)
    saved = _state(model, opt)
    for t in range(2, 4):
        _train_step(model, opt, rank, t)
    opt.close()

    # A fresh optimizer that has trained a little (non-zero state and residuals) and gets lr changed.
    model2, opt2 = _make("sgd-int8", seed=5)
    _train_step(model2, opt2, rank, 50)
    for g in opt2.param_groups:
        g["lr"] = 0.01
    before = _state(model2, opt2)
    m = json.loads(Path(os.path.join(good, "manifest.json")).read_text())
    files = [os.path.join(good, s["file"]) for s in m["shards"]]

    def variant(name, make, target=None):
        """Copy the good checkpoint to root/name (rank 0 builds it), let make() break it, try to load."""
        import shutil

        import torch.distributed as dist

        d = os.path.join(root, name)
        if rank == 0:
            shutil.copytree(good, d)
            make(d)
        dist.barrier()
        try:
            pyasync.load_checkpoint(d, target or opt2)
        except CheckpointError as e:
            return str(e)
        return "LOADED"

    def flip(d):
        p = os.path.join(d, os.path.basename(files[1]))
        data = bytearray(Path(p).read_bytes())
        data[len(data) // 2] ^= 0x10
        Path(p).write_bytes(bytes(data))

    def truncate(d):
        p = os.path.join(d, os.path.basename(files[0]))
        data = Path(p).read_bytes()
        Path(p).write_bytes(data[: len(data) // 2])

    def truncate_manifest(d):
        p = os.path.join(d, "manifest.json")
        data = Path(p).read_bytes()
        Path(p).write_bytes(data[: len(data) // 2])

    def foreign_manifest(d):
        Path(os.path.join(d, "manifest.json")).write_text(json.dumps({"model": "resnet", "epoch": 3}))

    def no_manifest(d):
        os.unlink(os.path.join(d, "manifest.json"))

    def pickled_object(d):  # a valid checksum over a pickle that is not plain data: never unpickled
        import hashlib
        import io

        buf = io.BytesIO()
        torch.save({"shards": argparse.Namespace(evil=True)}, buf)
        data = buf.getvalue()
        mm = json.loads(Path(os.path.join(d, "manifest.json")).read_text())
        Path(os.path.join(d, mm["shards"][1]["file"])).write_bytes(data)
        mm["shards"][1].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        Path(os.path.join(d, "manifest.json")).write_text(json.dumps(mm))

    def world3(d):
        mm = json.loads(Path(os.path.join(d, "manifest.json")).read_text())
        mm["world_size"] = 3
        Path(os.path.join(d, "manifest.json")).write_text(json.dumps(mm))

    out = {
        "corrupt": variant("corrupt", flip),
        "truncated": variant("truncated", truncate),
        "truncated_manifest": variant("truncated_manifest", truncate_manifest),
        "foreign": variant("foreign", foreign_manifest),
        "no_manifest": variant("no_manifest", no_manifest),
        "pickled_object": variant("pickled_object", pickled_object),
        "world_size": variant("world_size", world3),
    }
    out["untouched"] = _equal(before, _state(model2, opt2))
    opt2.close()

    # Mismatched model (another hidden width) and mismatched optimizer (AdamW instead of SGD).
    model3, opt3 = _make("sgd-int8", seed=0, hidden=8)
    before3 = _state(model3, opt3)
    out["other_model"] = variant("other_model", lambda d: None, opt3)
    out["untouched_other_model"] = _equal(before3, _state(model3, opt3))
    opt3.close()
    _, opt4 = _make("adamw", seed=0)
    out["other_optimizer"] = variant("other_optimizer", lambda d: None, opt4)
    opt4.close()
    _, opt6 = _make("sgd-int8", seed=0, policy="ssp:1")
    out["other_policy"] = variant("other_policy", lambda d: None, opt6)
    opt6.close()

    # The good checkpoint still loads, and gives exactly the saved state.
    model5, opt5 = _make("sgd-int8", seed=9)
    pyasync.load_checkpoint(good, opt5)
    out["good_loads"] = _equal(saved, _state(model5, opt5))
    opt5.close()
    return out


def test_bad_checkpoints_raise_everywhere_and_load_nothing(tmp_path):
    res = run_workers(_errors, 2, args=(str(tmp_path),), timeout=120)
    for rank, r in enumerate(res):
        assert r["untouched"], f"rank {rank}: a failed load modified the optimizer or the model"
        assert r["untouched_other_model"], f"rank {rank}: a mismatched load modified the optimizer"
        assert r["good_loads"], f"rank {rank}: the good checkpoint does not restore the saved state"
        for key in (
            "corrupt",
            "truncated",
            "truncated_manifest",
            "foreign",
            "no_manifest",
            "pickled_object",
            "world_size",
            "other_model",
            "other_optimizer",
            "other_policy",
        ):
            assert r[key] != "LOADED", f"rank {rank}: the {key} checkpoint was loaded"
            assert "nothing was loaded" in r[key], (key, r[key])
    c0, c1 = res[0]["corrupt"], res[1]["corrupt"]
    assert "sha256 checksum mismatch" in c1 and "-r1-of-2.pt" in c1  # the rank that read the file
    assert "rank(s) [1]" in c0  # the other rank is told who failed
    t0, t1 = res[0]["truncated"], res[1]["truncated"]
    assert "-r0-of-2.pt" in t0 and "truncated" in t0 and "rank(s) [0]" in t1
    for rank in (0, 1):
        r = res[rank]
        assert "manifest.json" in r["truncated_manifest"] and "not valid JSON" in r["truncated_manifest"]
        assert "not a pyasync checkpoint manifest" in r["foreign"]
        assert "manifest.json: missing" in r["no_manifest"]
        assert "holds rank 0 of 2, expected rank 0 of 3" in r["world_size"]
        assert "the parameters differ" in r["other_model"] and "shape" in r["other_model"]
        assert "the optimizer differ" in r["other_optimizer"]
        assert "saved with policy 'bsp', this optimizer uses 'ssp:1'" in r["other_policy"]
    assert "weights_only" in res[1]["pickled_object"] and "-r1-of-2.pt" in res[1]["pickled_object"]


def _interrupted(rank, world, root):
    import pyasync
    from pyasync.checkpoint import CheckpointError

    d = os.path.join(root, "ckpt")
    model, opt = _make("adamw", seed=0)
    _train_step(model, opt, rank, 0)
    pyasync.save_checkpoint(d, opt)
    first = _state(model, opt)
    first_files = sorted(os.listdir(d))
    _train_step(model, opt, rank, 1)

    # The manifest's rename fails (as a full disk or a crash between write and rename would): the
    # real temporary-file path runs, and the shard files of the new save were already written.
    real = os.replace

    def failing(src, dst, *a, **kw):
        if os.path.basename(dst) == "manifest.json":
            raise OSError(28, "No space left on device (simulated)")
        return real(src, dst, *a, **kw)

    os.replace = failing
    try:
        pyasync.save_checkpoint(d, opt)
        err = "SAVED"
    except CheckpointError as e:
        err = str(e)
    finally:
        os.replace = real
    import torch.distributed as dist

    dist.barrier()
    files_after = sorted(os.listdir(d))
    opt.close()

    model2, opt2 = _make("adamw", seed=3)
    pyasync.load_checkpoint(d, opt2)
    ok = _equal(first, _state(model2, opt2))
    opt2.close()
    return {"err": err, "same_files": files_after == first_files, "previous_loads": ok}


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    res = run_workers(_interrupted, 2, args=(str(tmp_path),), timeout=90)
    for rank, r in enumerate(res):
        assert r["err"] != "SAVED", f"rank {rank}: the failed save did not raise"
        assert "manifest.json" in r["err"] and "previous checkpoint" in r["err"], r["err"]
        assert r["same_files"], f"rank {rank}: the failed save left files behind or removed the old ones"
        assert r["previous_loads"], f"rank {rank}: the previous checkpoint no longer loads exactly"
    assert "No space left on device" in res[0]["err"]


def _single_rank_misuse(rank, world, root):
    import pyasync

    model, opt = _make("sgd", seed=0)
    out = {}
    for name, call in (
        ("path", lambda: pyasync.save_checkpoint(3, opt)),
        ("opt", lambda: pyasync.load_checkpoint(root, torch.optim.SGD(model.parameters(), lr=0.1))),
    ):
        try:
            call()
            out[name] = "OK"
        except TypeError as e:
            out[name] = str(e)
    opt.close()
    try:
        pyasync.save_checkpoint(root, opt)
        out["closed"] = "OK"
    except RuntimeError as e:
        out["closed"] = str(e)
    return out


def test_bad_arguments(tmp_path):
    (r,) = run_workers(_single_rank_misuse, 1, args=(str(tmp_path),), timeout=60)
    assert "path must be a str or os.PathLike" in r["path"]
    assert "opt must be a pyasync.DistributedOptimizer" in r["opt"]
    assert "closed" in r["closed"]


def _async_save(rank, world, root):
    import pyasync

    for policy in ("asp", "ssp:1"):
        d = os.path.join(root, policy.replace(":", ""))
        model, opt = _make("sgd", seed=0, policy=policy)
        for t in range(5):
            _train_step(model, opt, rank, t)
        pyasync.save_checkpoint(d, opt)
        opt.close()
        model2, opt2 = _make("sgd", seed=1, policy=policy)
        pyasync.load_checkpoint(d, opt2)
        _train_step(model2, opt2, rank, 5)
        opt2.close()
    return True


def test_async_save_holds_every_push_made_before_it(tmp_path):
    """Under ASP and SSP the save drains: every shard has processed (= applied) every push that every
    rank made before the save, as the shard files' own counters show."""
    run_workers(_async_save, 2, args=(str(tmp_path),), timeout=60)
    for policy in ("asp", "ssp1"):
        d = tmp_path / policy
        m = json.loads((d / "manifest.json").read_text())
        assert m["clocks"] == [5, 5] and m["policy"] == policy.replace("ssp1", "ssp:1")
        for s in m["shards"]:
            sd = torch.load(d / s["file"], weights_only=True)
            assert int(sd["clock"]) == 5
            assert sd["shards"], "every rank owns a shard of some bucket here"
            for b, sh in sd["shards"].items():
                assert sh["processed"].tolist() == m["clocks"], (policy, s["rank"], b)
                assert int(sh["version"]) == 5 * 2, (policy, s["rank"], b)  # one update per push


def _reshard_save(rank, world, root, policy):
    import pyasync

    model, opt = _make("adamw", seed=0, policy=policy)
    for t in range(K):
        _train_step(model, opt, rank, t)
    pyasync.save_checkpoint(root, opt)
    out = (_snap(model), opt.state_dict()["shards"])
    opt.close()
    return out


def _reshard_load(rank, world, root, policy):
    import pyasync

    model, opt = _make("adamw", seed=4 + rank, policy=policy)
    pyasync.load_checkpoint(root, opt)
    out = (_snap(model), opt.state_dict()["shards"], [lay.numel for lay in opt.bucket_layouts])
    _train_step(model, opt, rank, K)  # and it trains on
    out += (_snap(model),)
    opt.close()
    return out




@pytest.mark.parametrize("policy", ["bsp", "asp:gap=on"], ids=["bsp", "asp-gap"])
def test_reshard_to_another_world_size(tmp_path, policy):
    """AdamW saved by 2 ranks loads into 3: every bucket's master values and both moments (and, with
    the gap-aware penalty, its running mean step "gap_step": Note [Gap-aware penalty]), reassembled
    over the new ranks, equal the saved ones bit for bit; step counts are kept."""
    saved = run_workers(_reshard_save, 2, args=(str(tmp_path), policy), timeout=60)
    new_world = 3
    loaded = run_workers(_reshard_load, new_world, args=(str(tmp_path), policy), timeout=60)
    for rank in range(new_world):
        # ASP's workers hold look-ahead answers, not the masters: there the masters are compared below
        assert policy != "bsp" or _equal(saved[0][0], loaded[rank][0]), rank
        assert not _equal(loaded[rank][0], loaded[rank][3]), "no training"
    names = ("master", "state1", "state2") + (("gap_step",) if "gap" in policy else ())
    updates = K if policy == "bsp" else 2 * K  # ASP: every push of the 2 workers is an update
    for b in range(len(loaded[0][2])):
        for name in names:
            old = whole([s[1] for s in saved], b, name)
            new = whole([s[1] for s in loaded], b, name)
            assert old.numel() == loaded[0][2][b] and torch.equal(old, new), (b, name)
            assert name != "gap_step" or old.abs().max() > 0, "the running mean step never moved"
        for shards in (s[1] for s in loaded):
            if str(b) in shards:
                steps = shards[str(b)]["optim"]["steps"].tolist()
                assert steps == [updates] * len(steps)


# -- error-feedback residuals across world sizes (Note [Re-sharding residuals]) -------------------------
# (compression kind, policy) saved by 4 and by 2 ranks. Quorum(2) saved by 4 ranks is also the regression
# test of Note [Quorum and save] in pyasync/checkpoint/save.py (before the owner paused, such a save timed out
# in about half the runs).
EF_CASES = {4: [("plain-int8", "asp"), ("plain-topk", "bsp"), ("plain-int8", "quorum:2")]}
EF_CASES[2] = EF_CASES[4]
EF_ZERO_STEPS = 6  # steps with zero gradients after the load: they send (part of) the loaded residuals


def _ef_dir(root: str, kind: str, policy: str) -> str:
    return os.path.join(root, f"{kind}-{policy.replace(':', '')}")


def _buckets(opt) -> list[torch.Tensor]:
    """Every bucket's parameter values, flat in bucket order (what the masters hold after close)."""
    return [
        torch.cat([opt._params[p].detach().reshape(-1).float() for p in lay.params])
        for lay in opt.bucket_layouts
    ]


def _ef_save(rank, world, root):
    import pyasync

    for kind, policy in EF_CASES[world]:
        model, opt = _make(kind, seed=0, policy=policy)
        for t in range(K):
            _train_step(model, opt, rank, t)
        pyasync.save_checkpoint(_ef_dir(root, kind, policy), opt)
        opt.close()
    return True


def _ef_load(rank, world, root, cases):
    import pyasync

    out = {}
    for kind, policy in cases:
        model, opt = _make(kind, seed=4 + rank, policy=policy)
        # Residuals the load must replace, also on ranks that receive none: non-zero in every slot.
        opt.compressor.load_state_dict(
            {
                (b, r): torch.full((sh.numel,), 0.5 + rank)
                for b, lay in enumerate(opt.bucket_layouts)
                for r, sh in enumerate(lay.shards)
                if sh.numel > 0
            }
        )
        pyasync.load_checkpoint(_ef_dir(root, kind, policy), opt)
        res = opt.compressor.state_dict()
        loaded = _buckets(opt)
        for _ in range(EF_ZERO_STEPS):
            opt.zero_grad()
            sum((p * 0).sum() for p in model.parameters()).backward()  # zero gradients
            opt.step()
        opt.close()
        out[(kind, policy)] = {
            "residuals": res,
            "loaded": loaded,
            "final": _buckets(opt),
            "final_residuals": opt.compressor.state_dict(),
            "bounds": [[sh.begin for sh in lay.shards] + [lay.numel] for lay in opt.bucket_layouts],
            "dropped": opt.stats().pushes_dropped,
        }
    return out


def _whole_residuals(res: dict, bounds: list[list[int]]) -> list[torch.Tensor]:
    """One worker's residual for every whole bucket (float64), from its (bucket, shard) slots."""
    return [
        torch.cat(
            [
                res.get((b, r), torch.zeros(bb[r + 1] - bb[r])).reshape(-1).double()
                for r in range(len(bb) - 1)
            ]
        )
        for b, bb in enumerate(bounds)
    ]


def _saved_residuals(d, name: str = "residuals") -> list[list[torch.Tensor]]:
    """[old worker][bucket]: the whole-bucket residuals (or top-k velocities), read from the
    checkpoint's own files."""
    m = json.loads((d / "manifest.json").read_text())
    bounds = [b["shard_bounds"] for b in m["buckets"]]
    out = []
    for s in sorted(m["shards"], key=lambda s: s["rank"]):
        sd = torch.load(d / s["file"], weights_only=True)
        out.append(_whole_residuals(sd[name], bounds))
    return out


def _velocity_save(rank, world, root):
    import pyasync

    model, opt = _make("sgd-topk", seed=0)
    for t in range(K):
        _train_step(model, opt, rank, t)
    pyasync.save_checkpoint(root, opt)
    opt.close()
    return True


def _velocity_load(rank, world, root):
    import pyasync

    model, opt = _make("sgd-topk", seed=5 + rank)
    pyasync.load_checkpoint(root, opt)
    out = {
        "velocities": opt.compressor.velocity_state_dict(),
        "bounds": [[sh.begin for sh in lay.shards] + [lay.numel] for lay in opt.bucket_layouts],
    }
    _train_step(model, opt, rank, K)  # the loaded velocities step on
    opt.close()
    return out


def test_reshard_carries_topk_velocities(tmp_path):
    """Momentum-corrected top-k saved by 4 ranks loads into 2: each new worker's velocities are those
    of its old workers w = v mod 2, summed and scaled by d_new / d_old, as the residuals (the
    velocity is owed displacement too: Note [Momentum correction for top-k])."""
    run_workers(_velocity_save, 4, args=(str(tmp_path),), timeout=120)
    saved = _saved_residuals(tmp_path, "velocities")
    assert any(float(b.abs().max()) > 0 for w in saved for b in w), "nothing to re-shard"
    loaded = run_workers(_velocity_load, 2, args=(str(tmp_path),), timeout=120)
    for v in range(2):
        got = _whole_residuals(loaded[v]["velocities"], loaded[v]["bounds"])
        for b, have in enumerate(got):
            want = ((saved[v][b] + saved[v + 2][b]) * 2 / 4).float().double()
            assert torch.equal(have, want), f"rank {v} bucket {b}"


@pytest.fixture(scope="module")
def ef_checkpoints(tmp_path_factory):
    """The EF_CASES checkpoints, saved by 4 ranks and by 2 ranks after K steps."""
    root = tmp_path_factory.mktemp("ef")
    for n in (4, 2):
        run_workers(_ef_save, n, args=(str(root / f"n{n}"),), timeout=180)
    return root


@pytest.mark.parametrize("old, new", [(4, 2), (4, 3), (2, 4)], ids=["4to2", "4to3", "2to4"])
def test_reshard_carries_error_feedback_residuals(ef_checkpoints, old, new):
    """New worker v holds (d_new / d_old) * sum of old workers w = v mod new's whole-bucket residuals
    (bit for bit, as computed here from the saved files), cut at the new shard bounds; ranks that get
    none hold zeros; the total owed update sum_v F_v / d_new equals sum_w E_w / d_old; and with plain
    SGD and zero gradients after the load, the owed update reaches the parameters.

    Quorum(2) keeps its divisor 2 in every world size (scale 2/2 = 1, where ASP and BSP get
    new/old). Saved by 4 ranks it is Quorum(k < n): a rank may still wait in step() when the others
    enter the save (Note [Quorum and save]); the owners' pause must let it through."""
    from pyasync.policy import parse_policy

    cases = EF_CASES[old]
    loaded = run_workers(_ef_load, new, args=(str(ef_checkpoints / f"n{old}"), cases), timeout=180)
    for kind, policy in cases:
        case = (kind, policy)
        d = ef_checkpoints / f"n{old}" / os.path.basename(_ef_dir("", kind, policy))
        saved = _saved_residuals(d)
        pol = parse_policy(policy)
        d_old, d_new = pol.divisor(old), pol.divisor(new)
        nb = len(saved[0])
        for w in range(old):  # the test means something: every old worker owes something
            assert any(saved[w][b].abs().max() > 0 for b in range(nb)), (case, w)
        got = [_whole_residuals(loaded[v][case]["residuals"], loaded[v][case]["bounds"]) for v in range(new)]
        for v in range(new):
            ws = [w for w in range(old) if w % new == v]
            for b in range(nb):
                have = got[v][b].float()
                if not ws:
                    assert have.abs().max() == 0, f"{case}: rank {v} of {new} received a residual"
                    continue
                want = (sum(saved[w][b] for w in ws) * d_new / d_old).float()
                assert torch.equal(have, want), (
                    f"{case}: rank {v} bucket {b}: max difference {(have - want).abs().max().item()}"
                )
            for (b, r), t in loaded[v][case]["residuals"].items():  # slots cut at the new bounds
                bb = loaded[v][case]["bounds"][b]
                assert t.numel() == bb[r + 1] - bb[r] > 0, (case, v, b, r)
        for b in range(nb):
            owed_old = sum(saved[w][b] for w in range(old)) / d_old
            owed_new = sum(got[v][b] for v in range(new)) / d_new
            bound = sum(got[v][b].abs() for v in range(new)) / d_new * 2.0**-23  # one fp32 rounding each
            assert ((owed_new - owed_old).abs() <= bound).all(), (case, b)
            assert owed_old.abs().max() > 0
        if policy.startswith("quorum"):
            continue  # Quorum(k < n) may drop a push carrying part of it (by policy), so no ledger here
        # Plain SGD, zero gradients: p_final = p_loaded - lr / d_new * sum_v (F_v - e_v), e_v the
        # residual left at the end; so p_final - lr / d_new * sum_v e_v == p_loaded - lr * owed_old.
        assert all(loaded[v][case]["dropped"] == 0 for v in range(new))
        bounds = loaded[0][case]["bounds"]
        left = [_whole_residuals(loaded[v][case]["final_residuals"], bounds) for v in range(new)]
        for b in range(nb):
            p_loaded = loaded[0][case]["loaded"][b].double()
            p_final = loaded[0][case]["final"][b].double()
            finals = [loaded[v][case]["final"][b] for v in range(new)]
            assert all(torch.equal(f, finals[0]) for f in finals), f"{case}: replicas differ"
            owed_old = sum(saved[w][b] for w in range(old)) / d_old
            lhs = p_final - PLAIN_LR / d_new * sum(left[v][b] for v in range(new))
            rhs = p_loaded - PLAIN_LR * owed_old
            err = (lhs - rhs).abs().max().item()
            assert err < 2e-6, f"{case} bucket {b}: owed update not delivered, off by {err}"
        delivered = max((loaded[0][case]["final"][b] - loaded[0][case]["loaded"][b]).abs().max().item()
                        for b in range(nb))
        assert delivered > 1e-4, f"{case}: the loaded residuals moved nothing ({delivered})"




def _ef_bad(rank, world, src, root):
    import shutil

    import torch.distributed as dist

    import pyasync
    from pyasync.checkpoint import CheckpointError

    kind, policy = EF_CASES[4][0]
    model, opt = _make(kind, seed=4 + rank, policy=policy)
    before = _state(model, opt)

    def grow(sd):
        sd["residuals"][(0, 1)] = torch.cat([sd["residuals"][(0, 1)], torch.zeros(1)])

    def nan(sd):
        sd["residuals"][(0, 1)][0] = float("nan")

    def stray_bucket(sd):
        sd["residuals"][(99, 0)] = torch.zeros(1)

    def stray_shard(sd):
        sd["residuals"][(0, 4)] = torch.zeros(1)

    def not_tensor(sd):
        sd["residuals"][(0, 1)] = [1.0, 2.0]

    out = {}
    for name, edit in (
        ("grow", grow), ("nan", nan), ("stray_bucket", stray_bucket), ("stray_shard", stray_shard),
        ("not_tensor", not_tensor),
    ):
        d = os.path.join(root, name)
        if rank == 0:
            shutil.copytree(src, d)
            reseal(d, 1, edit)
        dist.barrier()
        try:
            pyasync.load_checkpoint(d, opt)
            out[name] = "LOADED"
        except CheckpointError as e:
            out[name] = str(e)
    out["untouched"] = _equal(before, _state(model, opt))
    pyasync.load_checkpoint(src, opt)  # the unbroken one still loads
    opt.close()
    return out


def test_reshard_refuses_bad_residual_entries(ef_checkpoints, tmp_path):
    """A 4-rank checkpoint whose rank-1 file holds a bad residual (resealed, so only the structure check
    sees it), loaded into 2 ranks: every rank reads every old file, so every rank names the file and
    the entry; nothing is loaded."""
    kind, policy = EF_CASES[4][0]
    src = ef_checkpoints / "n4" / os.path.basename(_ef_dir("", kind, policy))
    res = run_workers(_ef_bad, 2, args=(str(src), str(tmp_path)), timeout=120)
    for rank, r in enumerate(res):
        assert r["untouched"], f"rank {rank}: a failed load modified the optimizer or the model"
        for name, needle in (
            ("grow", "residuals[(0, 1)] has"),
            ("nan", "residuals[(0, 1)] holds NaN or Inf"),
            ("stray_bucket", "residual key (99, 0) is not a (bucket, shard)"),
            ("stray_shard", "residual key (0, 4) is not a (bucket, shard)"),
            ("not_tensor", "residuals[(0, 1)] must be a dense torch.float32 tensor"),
        ):
            msg = r[name]
            assert "-r1-of-4.pt" in msg and needle in msg and "nothing was loaded" in msg, (rank, name, msg)
