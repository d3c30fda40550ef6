"""save_checkpoint: drain, write each rank's shard file, commit with rank 0's manifest.

See Note [Checkpoint atomicity] in checkpoint/common.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets

import torch
import torch.distributed as dist

from pyasync.checkpoint.common import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SHARD_RE,
    TMP_PREFIX,
    CheckpointError,
    atomic_write,
    check_args,
    collective,
    global_src,
    shard_name,
)
from pyasync.optimizer import DistributedOptimizer

__all__ = ["save_checkpoint"]


def drain(opt: DistributedOptimizer) -> None:
    """Wait until every push made before this save (by any rank) has been processed by the shards this
    rank owns: processed[w] == clock of worker w for every owned shard. See Note [Checkpoint drain].

    Note [Checkpoint drain]
    Every rank's clock (completed steps; each step pushes every bucket once) is exchanged with an
    all_gather, then each rank waits (Owner.wait_processed: a condition its applier threads notify
    after every push, bounded by the optimizer's timeout) until each owned shard has processed that
    many pushes from every worker, pushes still on the network included. Under BSP this returns at once: a step
    only returns once every owner applied that clock. Under SSP/ASP a processed push is an applied
    push, so the checkpoint holds every push made before the save. Under Quorum(k < n) a processed
    late push may be dropped by policy or, with late="fold", wait in the next aggregate, which is not
    saved.

    Note [Quorum and save]
    Under Quorum(k < n) a rank can still be inside step() when the others enter the save: its push
    opened a round (a newer version) that needs k pushes, and the others, already in the save, will
    not push again until it joins them. So a save is a pause (Note [Barriers and quorums] in
    pyasync/optimizer.py): each rank sends PAUSE before its first collective, so owners stop waiting
    for its pushes and apply the stranded round with the pushes that are in; RESUME follows once its
    state is taken, and the save's final gather is the second meeting. Under BSP no rank can be left
    behind this way (a step returns only when every rank's push of that clock is applied), so the
    pause changes nothing there.
    """
    eng = opt.engine
    world = opt.world_size
    mine = torch.tensor([eng.clock], dtype=torch.int64)
    clocks = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        collective(opt, "save_checkpoint: exchanging clocks", dist.all_gather, clocks, mine)
    else:
        clocks = [mine]
    eng.drain([int(c.item()) for c in clocks])



def save_checkpoint(path: str | os.PathLike, opt: DistributedOptimizer) -> None:
    """Save ``opt`` (every rank's shard: fp32 master values, optimizer state, error-feedback residuals,
    clocks and versions) into the directory ``path``. Collective: call on every rank of the
    optimizer's process group, between steps (after ``step()`` returned, before the next backward).

    The save first drains (waits at most the optimizer's timeout, in seconds of wall time): every push
    any rank made before the save is processed by its owner. Under BSP, Quorum(n), SSP and ASP every
    such push is then applied and in the checkpoint; under Quorum(k < n) a late push may be dropped by
    policy or wait, folded, in an aggregate that is not saved. See Note [Checkpoint drain] and
    docs/reliability.md.

    Raises CheckpointError on every rank when any rank failed to write its file (the previous
    checkpoint in ``path``, if any, is then left as it was).
    """
    d = check_args(path, opt, "save_checkpoint")
    rank, world = opt.rank, opt.world_size
    eng = opt.engine

    # See Note [Quorum and save]: from here until this rank's state is taken, rounds do not wait for
    # this rank's pushes (it sends none while it saves).
    err = ""
    eng.pause()
    try:
        # A fresh save id (rank 0's, broadcast as a tensor: nothing from the network is unpickled).
        sid = torch.tensor([secrets.randbits(63) if rank == 0 else 0], dtype=torch.int64)
        if world > 1:
            collective(opt, "save_checkpoint: agreeing on a save id", dist.broadcast, sid, src=global_src(opt))
        save_id = f"{int(sid.item()):016x}"
        fname = shard_name(save_id, rank, world)

        digest, size = b"\0" * 32, 0
        clock = eng.clock
        try:
            drain(opt)  # its all_gather comes first, so a rank that fails here still reaches the next one
            sd = opt.state_dict()
            os.makedirs(d, exist_ok=True)
            buf = io.BytesIO()
            torch.save(sd, buf)
            data = buf.getvalue()
            digest, size = hashlib.sha256(data).digest(), len(data)
            atomic_write(os.path.join(d, fname), data)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = f"rank {rank} could not write {os.path.join(d, fname)}: {type(e).__name__}: {e}"
    finally:
        # RESUME, and wait until this rank's owner has every rank's RESUME; the gather below is then
        # the second meeting of Note [Barriers and quorums] (pyasync/optimizer.py).
        try:
            eng.resume()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = err or f"rank {rank}: {type(e).__name__}: {e}"

    # Gather (ok, size, clock, sha256) from every rank. This also makes the save a barrier: no rank
    # pushes for its next step before every owner has taken its state.
    mine = torch.zeros(7, dtype=torch.int64)
    mine[0], mine[1], mine[2] = int(not err), size, clock
    mine[3:] = torch.frombuffer(bytearray(digest), dtype=torch.int64)
    table = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        collective(opt, "save_checkpoint: gathering every rank's result", dist.all_gather, table, mine)
    else:
        table = [mine]
    failed = [r for r in range(world) if int(table[r][0]) != 1]
    if failed:
        if not err:  # this rank's file is an orphan now: the manifest will not name it
            try:
                os.unlink(os.path.join(d, fname))
            except OSError:
                pass
        raise CheckpointError(
            err or f"save_checkpoint({d!r}): rank(s) {failed} could not write their shard file (see their "
            "error); the previous checkpoint in this directory, if any, is unchanged"
        )

    # Rank 0 commits with the manifest; the others learn whether it worked.
    commit_err = ""
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "world_size": world,
            "save_id": save_id,
            "policy": opt.policy.spec(),
            "compression": opt.compressor.spec(),
            "torch_version": torch.__version__,
            "clocks": [int(t[2]) for t in table],
            **opt.describe(),
            "shards": [
                {
                    "rank": r,
                    "file": shard_name(save_id, r, world),
                    "bytes": int(table[r][1]),
                    "sha256": table[r][3:].numpy().tobytes().hex(),
                }
                for r in range(world)
            ],
        }
        try:
            atomic_write(os.path.join(d, MANIFEST), json.dumps(manifest, indent=1).encode())
        except Exception as e:  # noqa: BLE001
            commit_err = f"rank 0 could not write {os.path.join(d, MANIFEST)}: {type(e).__name__}: {e}"
    flag = torch.tensor([int(not commit_err)], dtype=torch.int64)
    if world > 1:
        collective(opt, "save_checkpoint: the commit", dist.broadcast, flag, src=global_src(opt))
    if int(flag.item()) != 1:
        # The new shard files are orphans; the old manifest (if any) still names the old, intact ones.
        try:
            os.unlink(os.path.join(d, fname))
        except OSError:
            pass
        raise CheckpointError(
            (commit_err or f"save_checkpoint: rank 0 could not write {os.path.join(d, MANIFEST)}")
            + "; the previous checkpoint in this directory, if any, is unchanged"
        )
    if rank == 0:  # committed: remove what the manifest no longer names (best effort)
        keep = {shard_name(save_id, r, world) for r in range(world)}
        for f in os.listdir(d):
            # Shard files of older or failed saves, temporary files of crashed ones.
            if (SHARD_RE.match(f) and f not in keep) or f.startswith(TMP_PREFIX):
                try:
                    os.unlink(os.path.join(d, f))
                except OSError:
                    pass


