"""load_checkpoint: every rank validates its part, the ranks agree, then every rank loads.

Note [Loading while a save commits]
Loads take no lock: a reader never waits for a writer, and a writer never waits for a reader. Each
rank reads the manifest, then the files it names. Shard file names carry the save id and files are
never rewritten in place, so a file that can be read is the one the manifest named (its size and
sha256 are checked anyway). Two things can happen when a save commits into the directory during the
load: (1) the save's cleanup removes a file this rank is about to read: read_shard then finds the
manifest on disk changed and raises CheckpointChanged (a missing file under an unchanged manifest
stays a plain CheckpointError: a broken checkpoint); (2) the ranks read different manifests, each
whole: the "ok" all_gather carries every rank's save id, and unless all are equal every rank raises
CheckpointChanged. Either way nothing is loaded, never a mix of two checkpoints, and the same call
can simply be retried.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from pyasync.checkpoint.common import (
    MANIFEST,
    CheckpointChanged,
    CheckpointError,
    Target,
    check_args,
    collective,
)
from pyasync.checkpoint.reshard import reshard
from pyasync.checkpoint.validate import check_local, compare, read_manifest, read_shard
from pyasync.session import groups

__all__ = ["load_checkpoint"]

OK, INVALID, CHANGED = 1, 0, 2  # a rank's validation outcome, as sent in the all_gather


def _validate(d: str, t: Target) -> tuple[dict, str]:
    """This rank's state dict from checkpoint ``d``, fully checked, and the save id of the manifest it
    came from; CheckpointError otherwise."""
    m = read_manifest(d)
    mpath = os.path.join(d, MANIFEST)
    compare(mpath, m, t)
    if m["world_size"] == t.world:
        sd = read_shard(d, mpath, m, t.rank, t.world, t.layouts, t.param_groups)
    else:
        sd = reshard(d, mpath, m, t)
    if t.local is not None:
        check_local(mpath, sd, t)
    return sd, m["save_id"]


def _sid_int(save_id: str) -> int:
    """A save id (16 hex digits) as a signed int64, for the all_gather."""
    return int.from_bytes(bytes.fromhex(save_id), "big", signed=True)


def load_checkpoint(path: str | os.PathLike, opt: Any) -> None:
    """Load the checkpoint directory ``path`` into ``opt``, a DistributedOptimizer built for the same
    model, optimizer, policy, compression, bucket_cap_mb and world size (or another world size for
    SGD, Adam and AdamW: see Note [Re-sharding]). Collective: call on every rank, between steps
    (typically right after constructing ``opt``).

    Every rank validates its part first; unless every rank succeeded, nothing is modified and every
    rank raises CheckpointError (naming the file and the problem on the ranks that found it). On
    success the masters, optimizer state, error-feedback residuals and hyperparameters are restored
    and every rank's parameters are set to the saved master values, or, with compressed replies under
    BSP and the same world size, to the values each rank held at the save (which the owners' coded
    replies go on from: the resumed run is bit-identical to one that never stopped; see Note
    [Checkpoints and held values] in save.py). Clocks and versions restart from zero in the new
    engine (the saved ones stay in the files for inspection).

    Takes no lock: when a concurrent save replaces the checkpoint during the load, every rank raises
    CheckpointChanged (a CheckpointError) and nothing is loaded; retry. See Note [Loading while a save
    commits].
    """
    d, t = check_args(path, opt, "load_checkpoint")
    world = t.world
    sd, sid, err, status = None, "", "", OK
    try:
        sd, sid = _validate(d, t)
    except CheckpointChanged as e:
        err, status = str(e), CHANGED
    except CheckpointError as e:
        err, status = str(e), INVALID
    except Exception as e:  # any surprise still must not leave other ranks waiting
        err, status = f"{d}: unexpected {type(e).__name__} while validating: {e}", INVALID
    held = _held_of(sd) if sd is not None else None
    mine = torch.tensor([status, _sid_int(sid) if sid else 0, int(held is not None)], dtype=torch.int64)
    flags = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        collective(
            t, "load_checkpoint: agreeing that every rank's part is valid", dist.all_gather, flags, mine
        )
    else:
        flags = [mine]
    bad = [r for r in range(world) if int(flags[r][0]) != OK]
    changed = [r for r in range(world) if int(flags[r][0]) == CHANGED]
    if err:
        raise (CheckpointChanged if status == CHANGED else CheckpointError)(
            f"load_checkpoint: {err}; nothing was loaded"
        )
    if changed:
        raise CheckpointChanged(
            f"load_checkpoint({d!r}): rank(s) {changed} saw the checkpoint change while loading (a "
            "concurrent save replaced it; see their error); nothing was loaded; retry the load"
        )
    if bad:
        raise CheckpointError(
            f"load_checkpoint({d!r}): rank(s) {bad} found the checkpoint invalid (see their error); "
            "nothing was loaded"
        )
    sids = sorted({f"{int(f[1]) & (2**64 - 1):016x}" for f in flags})
    if len(sids) > 1:
        raise CheckpointChanged(
            f"load_checkpoint({d!r}): the checkpoint changed while loading: the ranks read different "
            f"manifests (save ids {', '.join(sids)}; a concurrent save committed in between); nothing "
            "was loaded; retry the load"
        )
    assert sd is not None
    t.load_state_dict(sd)  # the owners forget what the workers hold: exact replies from here ...
    # ... unless every rank's file says so (Note [Checkpoints and held values] in save.py)
    if all(int(f[2]) == 1 for f in flags):
        assert held is not None
        t.engine.shards.restore_held(held)
        _install_held(t, held)
    else:
        _install_all(t)
    t.load_local_state(sd)  # local steps: each worker's replica on top (Note [Checkpoints under local steps])


def _held_of(sd: dict) -> dict[int, torch.Tensor] | None:
    """{bucket: what the workers held of this rank's shard at the save} when the (validated) state dict
    carries it for every shard this rank owns; None otherwise (an older checkpoint, exact replies, a
    policy other than BSP, or re-sharded)."""
    out = {}
    for b, d in sd["shards"].items():
        if "held" not in d:
            return None
        out[int(b)] = d["held"]
    return out


def _install_held(t: Target, held: dict[int, torch.Tensor]) -> None:
    """Give every rank's parameters what it held of every shard at the save: owner r sends worker w row
    w of its held values (one all_to_all over every bucket); every rank installs them (its worker's
    replica takes them too). See Note [Checkpoints and held values] in save.py."""
    world = t.world
    layouts = t.layouts
    widths = [max(s.numel for s in lay.shards) for lay in layouts]
    offs = [sum(widths[:b]) for b in range(len(layouts))]
    total = sum(widths)
    send = torch.zeros(world * total, dtype=torch.float32)
    for b, rows in held.items():
        for w in range(world):
            row = rows[w if rows.shape[0] > 1 else 0]
            send[w * total + offs[b] : w * total + offs[b] + row.numel()].copy_(row)
    recv = send
    if world > 1:
        recv = torch.empty_like(send)
        collective(
            t, "load_checkpoint: installing what every rank held", groups.all_to_all_single, recv, send
        )
    t.engine.shards.install_values(
        {
            (b, r): recv[r * total + offs[b] : r * total + offs[b] + sh.numel]
            for b, lay in enumerate(layouts)
            for r, sh in enumerate(lay.shards)
            if sh.numel > 0
        }
    )


def _install_all(t: Target) -> None:
    """Give every rank's parameters the loaded master values of every shard (all_gather per bucket)."""
    rank, world = t.rank, t.world
    if world == 1:
        return  # load_state_dict already installed this rank's (= every) shard
    masters = t.engine.shards.masters()
    for b, lay in enumerate(t.layouts):
        width = max(s.numel for s in lay.shards)
        if width == 0:
            continue
        mine = torch.zeros(width, dtype=torch.float32)
        if lay.shards[rank].numel > 0:
            mine[: lay.shards[rank].numel].copy_(masters[b].cpu())
        parts = [torch.empty_like(mine) for _ in range(world)]
        collective(t, "load_checkpoint: installing every shard", dist.all_gather, parts, mine)
        t.engine.shards.install_values(
            {(b, r): parts[r][: sh.numel] for r, sh in enumerate(lay.shards) if sh.numel > 0 and r != rank}
        )
