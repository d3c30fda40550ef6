"""BSP on collectives with a lossy compressor compresses the replies too (Note [Compressed replies] in
pyasync/engine/collective/gather.py): every rank installs the same decoded values after every step, the values
trail the masters by what the codec drops, close() ends the run on the exact masters, a checkpoint
loaded mid-run keeps the replicas equal, and the bytes sent fall to about the codec's ratio."""

import datetime

import pytest
import torch
from _dist import multiproc, run_workers

pytestmark = multiproc
STEPS = 10
TIMEOUT = datetime.timedelta(seconds=60)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _own_gap(opt, model, masters, rank) -> float:
    """Largest |parameter - master| over this rank's shards."""
    params = list(model.parameters())
    worst = 0.0
    for b, m in masters.items():
        lay = opt.bucket_layouts[b]
        vals = torch.cat([params[i].detach().reshape(-1) for i in lay.params])
        sh = lay.shards[rank]
        worst = max(worst, (vals[sh.begin : sh.end] - m.reshape(-1)).abs().max().item())
    return worst


def _train(rank, world, codec, ckpt):
    import pyasync

    model = _model()
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        policy="bsp",
        compression=codec,
        bucket_cap_mb=0.01,
        timeout=TIMEOUT,
    )
    g = torch.Generator().manual_seed(10 + rank)
    per_step, gaps = [], []
    for t in range(STEPS):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 32, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if ckpt and t == 2:
            pyasync.save_checkpoint(ckpt, opt)
        if ckpt and t == 6:
            pyasync.load_checkpoint(ckpt, opt)  # back to step 2: the replica is read again
        per_step.append(_flat(model))
        masters = opt.engine.shards.masters()
        gaps.append(_own_gap(opt, model, masters, rank))
    st = opt.stats()
    opt.close()
    return {
        "per_step": per_step,
        "gaps": gaps,
        "final_gap": _own_gap(opt, model, masters, rank),
        "final": _flat(model),
        "bytes": st.bytes_sent,
        "n_buckets": len(opt.bucket_layouts),
    }


@pytest.mark.parametrize("codec", ["int8", "topk:0.1"])
def test_compressed_replies_keep_replicas_equal_and_end_on_the_masters(codec, tmp_path):
    world = 3
    res = run_workers(_train, world, args=(codec, str(tmp_path / "ck")), timeout=240)
    assert res[0]["n_buckets"] >= 2
    for t in range(STEPS):
        for r in range(1, world):
            assert torch.equal(res[r]["per_step"][t], res[0]["per_step"][t]), f"step {t}: rank {r} differs"
    assert max(g for r in res for g in r["gaps"]) > 0, "the replies were not compressed (no gap ever)"
    for r in range(world):
        assert res[r]["final_gap"] == 0.0, f"rank {r} did not end on its masters"
        assert torch.equal(res[r]["final"], res[0]["final"])


def test_compressed_replies_cut_the_bytes():
    world = 3
    plain = run_workers(_train, world, args=("none", None), timeout=240)
    int8 = run_workers(_train, world, args=("int8", None), timeout=240)
    for r in range(world):
        ratio = int8[r]["bytes"] / plain[r]["bytes"]
        # int8: 1 byte per value + a scale per 256-value block + 128-byte headers, both directions.
        assert ratio < 0.3, f"rank {r}: int8 BSP sent {ratio:.3f}x the uncompressed bytes"
        assert plain[r]["gaps"] == [0.0] * STEPS  # uncompressed: the replicas are the masters


def _uneven(rank, world, codec):
    import pyasync

    model = _model()
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        policy="bsp",
        compression=codec,
        bucket_cap_mb=0.01,
        max_grad_norm=1.0,  # the norm's all-reduce runs in the joined steps too
        timeout=TIMEOUT,
    )
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(3 if rank == 0 else 6):  # rank 0 stops early: its close() serves the others' steps
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 32, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.close()
    st = opt.stats()
    return _flat(model), st.pushes_applied, len([b for b in range(len(opt.bucket_layouts))])


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_rank_that_closes_early_serves_the_others_steps(codec):
    world = 3
    res = run_workers(_uneven, world, args=(codec,), timeout=240)
    for r in range(world):
        assert torch.equal(res[r][0], res[0][0]), f"rank {r}: replicas differ after close()"
        # Each owned shard applied every stepping rank's push: 3 + 6 + 6 per step-bucket, never a
        # joined rank's zeros.
        assert res[r][1] == (3 + 6 * (world - 1)) * res[r][2], (r, res[r][1])
