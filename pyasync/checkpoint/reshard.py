"""Re-sharding: a checkpoint saved by n ranks, loaded by m.

Note [Re-sharding]
A checkpoint saved by n ranks loads into m != n ranks when the optimizer uses a fused rule (SGD,
Adam, AdamW): bucket assignment does not depend on the world size, only the shard bounds do. Every
rank reads (and checks) all n shard files, concatenates each bucket's master values and optimizer
state tensors in rank order into the whole bucket, and cuts out its new shard; each new segment takes
the step count of the old segment that holds its first element (all segments of one parameter step
together). Error-feedback residuals are re-sharded too, see Note [Re-sharding residuals]. Versions
and clocks restart from zero as always.

Note [Re-sharding residuals]. Versions
and clocks restart from zero as always.
"""

from __future__ import annotations

import torch

from pyasync.checkpoint.common import CheckpointError
from pyasync.checkpoint.validate import check_state, layouts_for, read_shard
from pyasync.optimizer import DistributedOptimizer

__all__ = ["reshard"]


def reshard(d: str, mpath: str, m: dict, opt: DistributedOptimizer) -> dict:
    """This rank's state dict assembled from every shard file of a checkpoint saved by another number
    of ranks. See Note [Re-sharding]."""
    old_world = m["world_size"]
    old_layouts = layouts_for(opt, old_world)
    sds = [read_shard(d, mpath, m, r, opt, old_world) for r in range(old_world)]
    out_shards = {}
    for b, lay in enumerate(opt.bucket_layouts):
        new = lay.shards[opt.rank]
        if new.numel == 0:
            continue
        parts = [(r, sh) for r, sh in enumerate(old_layouts[b].shards) if sh.numel > 0]
        full: dict[str, torch.Tensor] = {}
        keys = set(sds[parts[0][0]]["shards"][str(b)]["optim"]) - {"steps"}
        for r, _ in parts:
            if set(sds[r]["shards"][str(b)]["optim"]) - {"steps"} != keys:
                raise CheckpointError(f"{mpath}: bucket {b}'s shards hold different optimizer state names")
        full["master"] = torch.cat([sds[r]["shards"][str(b)]["master"].reshape(-1) for r, _ in parts])
        for name in sorted(keys):
            full[name] = torch.cat([sds[r]["shards"][str(b)]["optim"][name].reshape(-1) for r, _ in parts])
        # Step counts: each new segment takes the count of the old segment holding its first element.
        spans = [
            (sh.begin + seg.begin, sh.begin + seg.end, int(sds[r]["shards"][str(b)]["optim"]["steps"][i]))
            for r, sh in parts
            for i, seg in enumerate(sh.segments)
        ]
        steps = []
        for seg in new.segments:
            at = new.begin + seg.begin
            steps.append(next(c for lo, hi, c in spans if lo <= at < hi))
        optim = {k: full[k][new.begin : new.end].clone() for k in keys}
        optim["steps"] = torch.tensor(steps, dtype=torch.int64)
        out_shards[str(b)] = {
            "master": full["master"][new.begin : new.end].clone(),
            "version": torch.tensor(0, dtype=torch.int64),
            "processed": torch.zeros(opt.world_size, dtype=torch.int64),
            "optim": optim,
        }
    residuals = reshard_residuals(mpath, [sd["residuals"] for sd in sds], old_layouts, opt)
    sd = dict(sds[0])
    sd.update(rank=opt.rank, world_size=opt.world_size, shards=out_shards, residuals=residuals)
    check_state(mpath + " (re-sharded)", sd, opt, opt.rank, opt.world_size, opt.bucket_layouts)
    return sd


def reshard_residuals(mpath: str, saved: list[dict], old_layouts: list, opt: DistributedOptimizer) -> dict:
    """This rank's error-feedback residuals from those of the ``len(saved)`` old workers (each already
    checked against ``old_layouts``): new worker v takes old workers v, v + m, ..., summed and scaled
    by divisor(m) / divisor(n). See Note [Re-sharding residuals]."""
    n, m, v = len(saved), opt.world_size, opt.rank
    d_old, d_new = opt.policy.divisor(n), opt.policy.divisor(m)
    mine = [w for w in range(n) if w % m == v]
    out: dict[tuple[int, int], torch.Tensor] = {}
    for b, (old, new) in enumerate(zip(old_layouts, opt.bucket_layouts, strict=True)):
        total = None
        for w in mine:
            res = saved[w]
            if not any((b, r) in res for r in range(n)):
                continue  # worker w never compressed into bucket b: it owes nothing there
            pieces = []
            for r, sh in enumerate(old.shards):  # w's slots of bucket b, in shard order: the whole bucket
                e = res.get((b, r))
                e = torch.zeros(sh.numel, dtype=torch.float64) if e is None else e.reshape(-1).double()
                pieces.append(e)
            full = torch.cat(pieces)
            total = full if total is None else total + full  # ascending w, in float64
        if total is None:
            continue  # no old worker maps to this one here: its slots start from zero, as a fresh worker's
        f = (total * d_new / d_old).float()
        if not bool(torch.isfinite(f).all()):
            raise CheckpointError(
                f"{mpath}: bucket {b}'s error-feedback residual for rank {v} of {m} overflows float32 when "
                f"scaled by {d_new}/{d_old}"
            )
        for r, sh in enumerate(new.shards):
            if sh.numel > 0:
                out[(b, r)] = f[sh.begin : sh.end].clone()
    return out


