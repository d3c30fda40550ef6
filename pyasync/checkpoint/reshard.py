"""Re-sharding: a checkpoint saved by n ranks, loaded by m.

Note [Re-sharding]
A checkpoint saved by n ranks loads into m != n ranks when the optimizer uses a fused rule (SGD,
Adam, AdamW): bucket assignment does not depend on the world size, only the shard bounds do. Every
rank reads (and checks) all n shard files, concatenates each bucket's master values and optimizer
state tensors in rank order into the whole bucket, and cuts out its new shard; each new segment takes
the step count of the old segment that holds its first element (all segments of one parameter step
together). Error-feedback residuals are re-sharded too, see Note [Re-sharding residuals]. Versions
and clocks restart from zero as always.

Note [Re-sharding residuals]
A residual belongs to a worker: slot (b, r) of worker w is what w still owes for the slice of bucket b
that owner r holds, so w's slots concatenated over r give E_w, its residual for the whole bucket. An
owner scales a push by 1/d (d: the policy's divisor; n for BSP, SSP and ASP, k for Quorum(k)), so the
old run owes U = sum_w E_w / d_old per bucket. New worker v of m takes

    F_v = (d_new / d_old) * sum of E_w over the old workers w with w mod m == v   (zeros if none)

cut at the new shard bounds, so sum_v F_v / d_new = U: every old residual counts once and the scale
undoes the change of divisor (F_v is summed in float64 and rounded once to float32). A residual stays
whole on one worker rather than spread over all: it is one worker's compression-error state (for
top-k, its unsent coordinates), and for m == n the rule is the identity. docs/reliability.md
("Re-sharding") gives the caveats and what tests/checkpoint/test_checkpoint.py checks.
"""

from __future__ import annotations

import torch

from pyasync.checkpoint.common import CheckpointError, Target
from pyasync.checkpoint.validate import check_state, layouts_for, read_shard

__all__ = ["cut_shard", "recut_slots", "reshard", "segment_steps"]


def segment_steps(steps: list[list[int]], old, new) -> list[int]:
    """The step count of each segment of the new ShardLayout ``new``: that of the old segment (of the
    bucket's old BucketLayout ``old``, ``steps[r]`` per segment of old shard r) holding its first
    element."""
    spans = [
        (sh.begin + seg.begin, sh.begin + seg.end, int(steps[r][i]))
        for r, sh in enumerate(old.shards)
        for i, seg in enumerate(sh.segments)
    ]
    out = []
    for seg in new.segments:
        at = new.begin + seg.begin
        out.append(next(c for lo, hi, c in spans if lo <= at < hi))
    return out


def cut_shard(full: dict[str, torch.Tensor], steps: list[list[int]], old, new, device=None) -> dict:
    """One new shard cut out of a whole bucket: ``full`` holds the bucket's "master" values and each
    optimizer state tensor (``numel`` elements, bucket order), ``steps[r]`` the step count of each
    segment of old shard r of ``old`` (the bucket's old BucketLayout); ``new`` is the new ShardLayout.
    Returns {"master", "optim": {state names..., "steps"}}, copies (on ``device`` when given). Each
    new segment takes the step count of the old segment holding its first element (all segments of
    one parameter step together). See Note [Re-sharding]; membership changes cut step counts the same
    way (:func:`segment_steps`, Note [Re-splitting onto the members] in session/membership.py)."""
    seg_steps = segment_steps(steps, old, new)

    def piece(t: torch.Tensor) -> torch.Tensor:
        out = t[new.begin : new.end].clone()
        return out if device is None else out.to(device)

    optim = {k: piece(v) for k, v in full.items() if k != "master"}
    optim["steps"] = torch.tensor(seg_steps, dtype=torch.int64)
    return {"master": piece(full["master"]), "optim": optim}


def reshard(d: str, mpath: str, m: dict, t: Target) -> dict:
    """This rank's state dict assembled from every shard file of a checkpoint saved by another number
    of ranks. See Note [Re-sharding]."""
    old_world = m["world_size"]
    old_layouts = layouts_for(t.layouts, t.numels, old_world)
    sds = [read_shard(d, mpath, m, r, old_world, old_layouts, t.param_groups) for r in range(old_world)]
    out_shards = {}
    for b, lay in enumerate(t.layouts):
        new = lay.shards[t.rank]
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
        steps = [  # an empty shard has no segments
            sds[r]["shards"][str(b)]["optim"]["steps"].tolist() if sh.numel > 0 else []
            for r, sh in enumerate(old_layouts[b].shards)
        ]
        cut = cut_shard(full, steps, old_layouts[b], new)
        out_shards[str(b)] = {
            "master": cut["master"],
            "version": torch.tensor(0, dtype=torch.int64),
            "processed": torch.zeros(t.world, dtype=torch.int64),
            "optim": cut["optim"],
        }
    residuals = reshard_residuals(mpath, [sd["residuals"] for sd in sds], old_layouts, t)
    sd = dict(sds[0])
    sd.update(rank=t.rank, world_size=t.world, shards=out_shards, residuals=residuals)
    if any("velocities" in x for x in sds):  # momentum-corrected top-k: re-sharded as the residuals
        sd["velocities"] = reshard_residuals(mpath, [x.get("velocities", {}) for x in sds], old_layouts, t)
    if "local" in sd:  # Note [Checkpoints under local steps] in pyasync/local.py: no worker's progress
        theirs = sds[t.rank % old_world]["local"]
        sd["local"] = {"outer_steps": theirs.get("outer_steps"), "inner": theirs.get("inner")}
    check_state(mpath + " (re-sharded)", sd, t.param_groups, t.rank, t.world, t.layouts)
    return sd


def reshard_residuals(mpath: str, saved: list[dict], old_layouts: list, t: Target) -> dict:
    """This rank's error-feedback residuals from those of the ``len(saved)`` old workers (each already
    checked against ``old_layouts``): new worker v takes old workers v, v + m, ..., summed and scaled
    by divisor(m) / divisor(n). See Note [Re-sharding residuals]."""
    n, m, v = len(saved), t.world, t.rank
    scale = (t.policy.divisor(m), t.policy.divisor(n))
    out, bad = recut_slots([saved[w] for w in range(n) if w % m == v], old_layouts, t.layouts, scale)
    if bad:
        raise CheckpointError(
            f"{mpath}: bucket {bad[0]}'s error-feedback residual for rank {v} of {m} overflows float32 when "
            f"scaled by {scale[0]}/{scale[1]}"
        )
    return out


def recut_slots(
    slots: list[dict], old_layouts: list, new_layouts: list, scale: tuple[int, int]
) -> tuple[dict, list]:
    """Per-shard slots (error-feedback residuals or top-k velocities, keyed (bucket, shard) of
    ``old_layouts``) of one or more workers, each worker's slots of a bucket joined in shard order into
    the whole bucket, summed over the workers in float64, times num / den (``scale``), rounded to
    float32 and cut at the shard bounds of ``new_layouts`` (the same buckets cut otherwise). A bucket none of
    them holds a slot of stays without one (a fresh worker's zeros). Returns (the new slots, the buckets
    whose result overflowed float32: left out of the slots). Checkpoints re-shard by it (Note
    [Re-sharding residuals]) and so does a membership change, each worker its own (Note [Membership
    epochs] in session/membership.py)."""
    out: dict[tuple[int, int], torch.Tensor] = {}
    bad = []
    for b, (old, new) in enumerate(zip(old_layouts, new_layouts, strict=True)):
        total = None
        for res in slots:
            if not any((b, r) in res for r in range(len(old.shards))):
                continue  # this worker never compressed into bucket b: it owes nothing there
            pieces = []
            for r, sh in enumerate(old.shards):  # the worker's slots of bucket b, in shard order
                e = res.get((b, r))
                e = torch.zeros(sh.numel, dtype=torch.float64) if e is None else e.reshape(-1).double()
                pieces.append(e)
            full = torch.cat(pieces)
            total = full if total is None else total + full  # in the order given, in float64
        if total is None:
            continue
        f = (total * scale[0] / scale[1]).float()
        if not bool(torch.isfinite(f).all()):
            bad.append(b)
            continue
        for r, sh in enumerate(new.shards):
            if sh.numel > 0:
                out[(b, r)] = f[sh.begin : sh.end].clone()
    return out, bad
