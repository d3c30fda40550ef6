"""load_checkpoint: every rank validates its part, the ranks agree, then every rank loads."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pyasync.checkpoint.common import MANIFEST, CheckpointError, check_args, collective
from pyasync.checkpoint.reshard import reshard
from pyasync.checkpoint.validate import compare, read_manifest, read_shard
from pyasync.optimizer import DistributedOptimizer

__all__ = ["load_checkpoint"]


def _validate(d: str, opt: DistributedOptimizer) -> dict:
    """This rank's state dict from checkpoint ``d``, fully checked; CheckpointError otherwise."""
    m = read_manifest(d)
    mpath = os.path.join(d, MANIFEST)
    compare(mpath, m, opt)
    if m["world_size"] == opt.world_size:
        return read_shard(d, mpath, m, opt.rank, opt, opt.world_size)
    return reshard(d, mpath, m, opt)


def load_checkpoint(path: str | os.PathLike, opt: DistributedOptimizer) -> None:
    """Load the checkpoint directory ``path`` into ``opt``, a DistributedOptimizer built for the same
    model, optimizer, policy, compression, bucket_cap_mb and world size (or another world size for
    SGD, Adam and AdamW: see Note [Re-sharding]). Collective: call on every rank, between steps
    (typically right after constructing ``opt``).

    Every rank validates its part first; unless every rank succeeded, nothing is modified and every
    rank raises CheckpointError (naming the file and the problem on the ranks that found it). On
    success the masters, optimizer state, error-feedback residuals and hyperparameters are restored
    and every rank's parameters are set to the saved master values. Clocks and versions restart from
    zero in the new engine (the saved ones stay in the files for inspection).
    """
    d = check_args(path, opt, "load_checkpoint")
    world = opt.world_size
    sd, err = None, ""
    try:
        sd = _validate(d, opt)
    except CheckpointError as e:
        err = str(e)
    except Exception as e:  # noqa: BLE001 - any surprise still must not leave other ranks waiting
        err = f"{d}: unexpected {type(e).__name__} while validating: {e}"
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    mine = torch.tensor([int(not err)], dtype=torch.int64)
    if world > 1:
        collective(opt, "load_checkpoint: agreeing that every rank's part is valid", dist.all_gather, flags, mine)
    else:
        flags = [mine]
    bad = [r for r in range(world) if int(flags[r].item()) != 1]
    if bad:
        raise CheckpointError(
            f"load_checkpoint: {err}; nothing was loaded"
            if err
            else f"load_checkpoint({d!r}): rank(s) {bad} found the checkpoint invalid (see their error); "
            "nothing was loaded"
        )
    assert sd is not None
    opt.load_state_dict(sd)
    _install_all(opt)


def _install_all(opt: DistributedOptimizer) -> None:
    """Give every rank's parameters the loaded master values of every shard (all_gather per bucket)."""
    rank, world = opt.rank, opt.world_size
    if world == 1:
        return  # load_state_dict already installed this rank's (= every) shard
    masters = opt.engine.masters()
    for b, lay in enumerate(opt.bucket_layouts):
        width = max(s.numel for s in lay.shards)
        if width == 0:
            continue
        mine = torch.zeros(width, dtype=torch.float32)
        if lay.shards[rank].numel > 0:
            mine[: lay.shards[rank].numel].copy_(masters[b].cpu())
        parts = [torch.empty_like(mine) for _ in range(world)]
        collective(opt, "load_checkpoint: installing every shard", dist.all_gather, parts, mine)
        opt.engine.install_values(
            {(b, r): parts[r][: sh.numel] for r, sh in enumerate(lay.shards) if sh.numel > 0 and r != rank}
        )
