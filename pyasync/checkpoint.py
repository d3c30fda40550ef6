"""Sharded checkpoints: one file per rank (its shard) plus a JSON manifest that commits them.

    pyasync.save_checkpoint("ckpt/step1000", opt)     # every rank, between steps
    pyasync.load_checkpoint("ckpt/step1000", opt)     # every rank, on a fresh optimizer of the same model

Directory layout (see docs/reliability.md, "Checkpoints"):

    manifest.json                          written last by rank 0; its presence commits the checkpoint
    shard-<save id>-r<rank>-of-<n>.pt      rank r's DistributedOptimizer.state_dict() (torch.save)

Note [Checkpoint atomicity]
Every file is written to a temporary name in the same directory, fsync'ed, then os.replace'd into
place, and the directory is fsync'ed. Shard file names carry a fresh random save id, so a new save
never overwrites the shard files that the current manifest names: until rank 0 replaces the manifest
(after every rank reported its shard written, with its sha256), the previous checkpoint stays whole
and loadable. Only after the new manifest is in place does rank 0 delete shard files it no longer
names. A crash at any point leaves either the old or the new checkpoint, never a mix.

Note [Checkpoint validation]
Loading never unpickles: the manifest is JSON, shard files go through torch.load(weights_only=True)
from the very bytes whose sha256 was checked. Each rank validates everything it will load (manifest
format, world size, parameter names/shapes/dtypes, bucket layout, policy, compression, optimizer,
checksum, shard structure and sizes) before touching the optimizer; the ranks then exchange an "ok"
flag (all_gather on the optimizer's process group) and nothing is loaded unless every rank is ok.

Note [Re-sharding]
A checkpoint saved by n ranks loads into m != n ranks when the optimizer uses a fused rule (SGD,
Adam, AdamW): bucket assignment does not depend on the world size, only the shard bounds do. Every
rank reads (and checks) all n shard files, concatenates each bucket's master values and optimizer
state tensors in rank order into the whole bucket, and cuts out its new shard; each new segment takes
the step count of the old segment that holds its first element (all segments of one parameter step
together). Error-feedback residuals are re-sharded too, see Note [Re-sharding residuals]. Versions
and clocks restart from zero as always.

Note [Re-sharding residuals]
A residual belongs to a worker, not to an owner: compressor slot (b, r) of worker w holds what w
still owes for the slice [bounds[r], bounds[r+1]) of bucket b that goes to owner r, so concatenating
w's slots over r (a missing slot is zeros: nothing was compressed there yet) gives E_w, w's residual
for the whole bucket. It is an update owed: whenever w sends it, the owners scale the push by 1/d,
d = policy.divisor(world) (n for BSP, SSP and ASP; k for Quorum(k)). The n old workers thus owe
U = sum_w E_w / d_old for bucket b. The m new workers get

    F_v = (d_new / d_old) * sum_{w < n, w mod m == v} E_w        (zeros when no w maps to v)

so that sum_v F_v / d_new = sum_w E_w / d_old = U: the owed update is preserved exactly in exact
arithmetic (every E_w is counted once, and the scale undoes the change of divisor). F_v is then cut
by the new shard bounds into the slots (b, r') of new worker v. m > n: old worker w's residual goes
to new worker w, times m/n; workers n..m-1 start from zero. m < n: new worker v sums the residuals of
old workers v, v + m, v + 2m, ..., times m/n. m == n: the identity (the same-world load). For
Quorum(k) the divisor is k in both runs and the scale is 1.
Why whole residuals on one worker each, and not every residual spread over all new workers (which
would preserve U as well): a residual is the state of one worker's error-feedback stream; kept whole
it stays one coherent compression error (e.g. top-k's unsent coordinates), it stays with the same
rank number where it can, the rule reduces to the identity for m == n, and new workers that get
nothing start exactly as a fresh worker does.
Floating point: F_v is computed in float64 (sum over w in ascending order, times d_new, divided by
d_old) and rounded once to float32, so sum_v F_v / d_new equals U up to that one rounding per
element; a result that is not finite is a CheckpointError. The caveats are those of the old run:
with lr_scale="inverse" the owed update is further divided by the staleness it is eventually sent
with, with Adam it is owed gradient (fed to Adam), not a parameter change, and under Quorum(k < n)
a push carrying part of it may be dropped by policy.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from pyasync.optimizer import DistributedOptimizer

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

FORMAT = "pyasync-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_SHARD_RE = re.compile(r"^shard-[0-9a-f]{16}-r\d+-of-\d+\.pt$")
_TMP_PREFIX = ".pyasync-tmp-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded (missing, truncated, corrupt, foreign, mismatched)."""


# -- helpers ------------------------------------------------------------------------------------------
def _check_args(path: Any, opt: Any, what: str) -> str:
    if not isinstance(opt, DistributedOptimizer):
        raise TypeError(f"{what}: opt must be a pyasync.DistributedOptimizer, got {type(opt).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: path must be a str or os.PathLike directory, got {type(path).__name__}")
    if opt.closed:
        raise RuntimeError(
            f"{what}: the DistributedOptimizer is closed; save or load before close() (a closed "
            "optimizer's owner threads are stopped)"
        )
    return os.fspath(path)


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds: the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temporary file in the same directory, fsync, os.replace,
    fsync of the directory. See Note [Checkpoint atomicity]."""
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(d)


def _layout(opt: DistributedOptimizer) -> dict[str, Any]:
    """What must match between the saving and the loading optimizer (JSON-able)."""
    return {
        "parameters": [
            {"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
            for n, p in zip(opt._names, opt._params)
        ],
        "buckets": [
            {
                "params": list(lay.params),
                "numel": lay.numel,
                "shard_bounds": [s.begin for s in lay.shards] + [lay.numel],
            }
            for lay in opt.bucket_layouts
        ],
        "optimizer": list(opt._rule.describe()),
    }


def _shard_name(save_id: str, rank: int, world: int) -> str:
    return f"shard-{save_id}-r{rank}-of-{world}.pt"


def _global_src(opt: DistributedOptimizer) -> int:
    return dist.get_global_rank(opt._group, 0) if opt._group is not None else 0


def _drain(opt: DistributedOptimizer) -> None:
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
    eng = opt._require_engine()
    world = opt.world_size
    mine = torch.tensor([eng.clock], dtype=torch.int64)
    clocks = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(clocks, mine, group=opt._group)
    else:
        clocks = [mine]
    want = [int(c.item()) for c in clocks]

    eng.owner.wait_processed(want, opt._timeout, eng._err)


# -- save -----------------------------------------------------------------------------------------------
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
    d = _check_args(path, opt, "save_checkpoint")
    rank, world, group = opt.rank, opt.world_size, opt._group
    eng = opt._require_engine()

    # See Note [Quorum and save]: from here until this rank's state is taken, rounds do not wait for
    # this rank's pushes (it sends none while it saves).
    err = ""
    eng.pause(True)
    try:
        # A fresh save id (rank 0's, broadcast as a tensor: nothing from the network is unpickled).
        sid = torch.tensor([secrets.randbits(63) if rank == 0 else 0], dtype=torch.int64)
        if world > 1:
            dist.broadcast(sid, src=_global_src(opt), group=group)
        save_id = f"{int(sid.item()):016x}"
        fname = _shard_name(save_id, rank, world)

        digest, size = b"\0" * 32, 0
        clock = eng.clock
        try:
            _drain(opt)  # its all_gather comes first, so a rank that fails here still reaches the next one
            sd = opt.state_dict()
            os.makedirs(d, exist_ok=True)
            buf = io.BytesIO()
            torch.save(sd, buf)
            data = buf.getvalue()
            digest, size = hashlib.sha256(data).digest(), len(data)
            _atomic_write(os.path.join(d, fname), data)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = f"rank {rank} could not write {os.path.join(d, fname)}: {type(e).__name__}: {e}"
    finally:
        # RESUME, and wait until this rank's owner has every rank's RESUME; the gather below is then
        # the second meeting of Note [Barriers and quorums] (pyasync/optimizer.py).
        try:
            opt._resume()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = err or f"rank {rank}: {type(e).__name__}: {e}"

    # Gather (ok, size, clock, sha256) from every rank. This also makes the save a barrier: no rank
    # pushes for its next step before every owner has taken its state.
    mine = torch.zeros(7, dtype=torch.int64)
    mine[0], mine[1], mine[2] = int(not err), size, clock
    mine[3:] = torch.frombuffer(bytearray(digest), dtype=torch.int64)
    table = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(table, mine, group=group)
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
            **_layout(opt),
            "shards": [
                {
                    "rank": r,
                    "file": _shard_name(save_id, r, world),
                    "bytes": int(table[r][1]),
                    "sha256": table[r][3:].numpy().tobytes().hex(),
                }
                for r in range(world)
            ],
        }
        try:
            _atomic_write(os.path.join(d, MANIFEST), json.dumps(manifest, indent=1).encode())
        except Exception as e:  # noqa: BLE001
            commit_err = f"rank 0 could not write {os.path.join(d, MANIFEST)}: {type(e).__name__}: {e}"
    flag = torch.tensor([int(not commit_err)], dtype=torch.int64)
    if world > 1:
        dist.broadcast(flag, src=_global_src(opt), group=group)
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
        keep = {_shard_name(save_id, r, world) for r in range(world)}
        for f in os.listdir(d):
            # Shard files of older or failed saves, temporary files of crashed ones.
            if (_SHARD_RE.match(f) and f not in keep) or f.startswith(_TMP_PREFIX):
                try:
                    os.unlink(os.path.join(d, f))
                except OSError:
                    pass


# -- load -----------------------------------------------------------------------------------------------
def _read_manifest(d: str) -> dict[str, Any]:
    mpath = os.path.join(d, MANIFEST)
    if not os.path.isdir(d):
        raise CheckpointError(f"{d}: no such checkpoint directory")
    if not os.path.isfile(mpath):
        raise CheckpointError(
            f"{mpath}: missing; {d} is not a (committed) pyasync checkpoint (the manifest is written last)"
        )
    try:
        with open(mpath, "rb") as f:
            m = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath}: not valid JSON (truncated or not a pyasync manifest): {e}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not a pyasync checkpoint manifest (no \"format\": \"{FORMAT}\")")
    if m.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{mpath}: format version {m.get('format_version')!r}, this pyasync reads {FORMAT_VERSION}"
        )
    for key, typ in (("world_size", int), ("shards", list), ("parameters", list), ("buckets", list)):
        if not isinstance(m.get(key), typ):
            raise CheckpointError(f"{mpath}: field {key!r} missing or not a {typ.__name__}")
    return m


def _strip_bounds(b: Any) -> Any:
    return {k: v for k, v in b.items() if k != "shard_bounds"} if isinstance(b, dict) else b


def _compare(mpath: str, m: dict[str, Any], opt: DistributedOptimizer) -> None:
    mine = _layout(opt)
    if m["world_size"] != opt.world_size:
        if not opt._rule.fused:
            raise CheckpointError(
                f"{mpath}: saved by {m['world_size']} ranks, this run has {opt.world_size}; re-sharding to "
                "another world size is supported for SGD, Adam and AdamW only (this optimizer runs "
                "the generic rule)"
            )
        if not isinstance(m["world_size"], int) or m["world_size"] < 1:
            raise CheckpointError(f"{mpath}: world_size {m['world_size']!r} is not a positive int")
        # Re-sharding: the shard bounds differ by construction; the buckets themselves must not.
        m = dict(m, buckets=[_strip_bounds(b) for b in m["buckets"]])
        mine["buckets"] = [_strip_bounds(b) for b in mine["buckets"]]
    for key in ("parameters", "buckets", "optimizer"):
        a, b = m.get(key), mine[key]
        if a != b:
            where = ""
            if isinstance(a, list):
                i = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
                where = (
                    f" at entry {i}: checkpoint has {a[i] if i < len(a) else '(nothing)'}, this optimizer "
                    f"has {b[i] if i < len(b) else '(nothing)'}"
                )
            raise CheckpointError(
                f"{mpath}: the {key} differ from this optimizer's{where}; build the same model, optimizer "
                "and bucket_cap_mb as when saving"
            )
    for key, have in (("policy", opt.policy.spec()), ("compression", opt.compressor.spec())):
        if m.get(key) != have:
            raise CheckpointError(
                f"{mpath}: saved with {key} {m.get(key)!r}, this optimizer uses {have!r}; use the same {key}"
            )


def _check_tensor(fpath: str, where: str, t: Any, numel: int | None, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.is_sparse:
        got = getattr(t, "dtype", type(t).__name__)
        raise CheckpointError(f"{fpath}: {where} must be a dense {dtype} tensor, got {got}")
    if numel is not None and t.numel() != numel:
        raise CheckpointError(f"{fpath}: {where} has {t.numel()} elements, expected {numel}")


def _check_state(fpath: str, sd: Any, opt: DistributedOptimizer, rank: int, world: int, layouts) -> None:
    """Everything DistributedOptimizer.load_state_dict will read (for shard ``rank`` of ``world`` of
    ``layouts``), checked before it runs."""
    if not isinstance(sd, dict) or not isinstance(sd.get("shards"), dict):
        raise CheckpointError(f"{fpath}: not a pyasync shard (no 'shards' dict)")
    if sd.get("rank") != rank or sd.get("world_size") != world:
        raise CheckpointError(
            f"{fpath}: holds rank {sd.get('rank')} of {sd.get('world_size')}, expected rank {rank} of {world}"
        )
    owned = {str(b): lay.shards[rank] for b, lay in enumerate(layouts) if lay.shards[rank].numel > 0}
    if set(sd["shards"]) != set(owned):
        raise CheckpointError(
            f"{fpath}: holds buckets {sorted(sd['shards'])}, this rank owns {sorted(owned)}"
        )
    for b, sh in owned.items():
        d = sd["shards"][b]
        w = f"shards[{b}]"
        if not isinstance(d, dict) or not isinstance(d.get("optim"), dict):
            raise CheckpointError(f"{fpath}: {w} is not a shard dict")
        _check_tensor(fpath, f"{w}['master']", d.get("master"), sh.numel, torch.float32)
        o = d["optim"]
        _check_tensor(fpath, f"{w}['optim']['steps']", o.get("steps"), len(sh.segments), torch.int64)
        for k, t in o.items():
            if k in ("state1", "state2"):
                _check_tensor(fpath, f"{w}['optim'][{k!r}]", t, sh.numel, torch.float32)
            elif k != "steps" and not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{fpath}: {w}['optim'][{k!r}] is not a tensor")
    res = sd.get("residuals", {})
    if not isinstance(res, dict):
        raise CheckpointError(f"{fpath}: 'residuals' is not a dict")
    for k, t in res.items():
        ok = (
            isinstance(k, tuple)
            and len(k) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in k)
            and 0 <= k[0] < len(layouts)
            and 0 <= k[1] < world
        )
        if not ok:
            raise CheckpointError(
                f"{fpath}: residual key {k!r} is not a (bucket, shard) of this layout "
                f"({len(layouts)} buckets, {world} shards each)"
            )
        _check_tensor(fpath, f"residuals[{k}]", t, layouts[k[0]].shards[k[1]].numel, torch.float32)
        if not bool(torch.isfinite(t).all()):  # a compressor never keeps one (see compression.py)
            raise CheckpointError(f"{fpath}: residuals[{k}] holds NaN or Inf")
    groups = sd.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        raise CheckpointError(f"{fpath}: expected {len(opt.param_groups)} param_groups")
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or set(g) != {k for k in opt.param_groups[i] if k != "params"}:
            raise CheckpointError(f"{fpath}: param_groups[{i}] has different keys than this optimizer's")


def _validate(d: str, opt: DistributedOptimizer) -> dict:
    """This rank's state dict from checkpoint ``d``, fully checked; CheckpointError otherwise."""
    m = _read_manifest(d)
    mpath = os.path.join(d, MANIFEST)
    _compare(mpath, m, opt)
    if m["world_size"] == opt.world_size:
        return _read_shard(d, mpath, m, opt.rank, opt, opt.world_size)
    return _reshard(d, mpath, m, opt)


def _read_shard(d: str, mpath: str, m: dict, rank: int, opt: DistributedOptimizer, world: int) -> dict:
    """Rank ``rank``'s (of ``world``) shard file: size, sha256, weights_only load, structure."""
    entry = next((s for s in m["shards"] if isinstance(s, dict) and s.get("rank") == rank), None)
    if entry is None or not isinstance(entry.get("file"), str) or not _SHARD_RE.match(entry["file"]):
        raise CheckpointError(f"{mpath}: no valid shard entry for rank {rank}")
    fpath = os.path.join(d, entry["file"])
    try:
        with open(fpath, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{fpath}: cannot read the shard file named by the manifest: {e}") from e
    if len(data) != entry.get("bytes"):
        raise CheckpointError(
            f"{fpath}: {len(data)} bytes, the manifest says {entry.get('bytes')} (truncated or replaced)"
        )
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise CheckpointError(f"{fpath}: sha256 checksum mismatch (the file is corrupt)")
    try:
        sd = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refuses anything but plain data
        raise CheckpointError(f"{fpath}: cannot be loaded with weights_only=True: {e}") from e
    layouts = opt.bucket_layouts if world == opt.world_size else _layouts_for(opt, world)
    _check_state(fpath, sd, opt, rank, world, layouts)
    return sd


def _layouts_for(opt: DistributedOptimizer, world: int) -> list:
    """This optimizer's buckets cut into ``world`` shards (the saving run's layout when re-sharding)."""
    from pyasync.engine.shards import build_layout

    numels = [p.numel() for p in opt._params]
    groups = [0] * len(numels)
    for lay in opt.bucket_layouts:
        for sh in lay.shards:
            for seg in sh.segments:
                groups[seg.param] = seg.group
    return build_layout([lay.params for lay in opt.bucket_layouts], numels, groups, world)


def _reshard(d: str, mpath: str, m: dict, opt: DistributedOptimizer) -> dict:
    """This rank's state dict assembled from every shard file of a checkpoint saved by another number
    of ranks. See Note [Re-sharding]."""
    old_world = m["world_size"]
    old_layouts = _layouts_for(opt, old_world)
    sds = [_read_shard(d, mpath, m, r, opt, old_world) for r in range(old_world)]
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
    residuals = _reshard_residuals(mpath, [sd["residuals"] for sd in sds], old_layouts, opt)
    sd = dict(sds[0])
    sd.update(rank=opt.rank, world_size=opt.world_size, shards=out_shards, residuals=residuals)
    _check_state(mpath + " (re-sharded)", sd, opt, opt.rank, opt.world_size, opt.bucket_layouts)
    return sd


def _reshard_residuals(mpath: str, saved: list[dict], old_layouts: list, opt: DistributedOptimizer) -> dict:
    """This rank's error-feedback residuals from those of the ``len(saved)`` old workers (each already
    checked against ``old_layouts``): new worker v takes old workers v, v + m, ..., summed and scaled
    by divisor(m) / divisor(n). See Note [Re-sharding residuals]."""
    n, m, v = len(saved), opt.world_size, opt.rank
    d_old, d_new = opt.policy.divisor(n), opt.policy.divisor(m)
    mine = [w for w in range(n) if w % m == v]
    out: dict[tuple[int, int], torch.Tensor] = {}
    for b, (old, new) in enumerate(zip(old_layouts, opt.bucket_layouts)):
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
    d = _check_args(path, opt, "load_checkpoint")
    rank, world, group = opt.rank, opt.world_size, opt._group
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
        dist.all_gather(flags, mine, group=group)
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
    from pyasync.ops import bucketing as ops_bucketing

    rank, world, group = opt.rank, opt.world_size, opt._group
    if world == 1:
        return  # load_state_dict already installed this rank's (= every) shard
    shards = opt._require_engine().owner.shards()
    with torch.no_grad():
        for b, lay in enumerate(opt.bucket_layouts):
            width = max(s.numel for s in lay.shards)
            if width == 0:
                continue
            mine = torch.zeros(width, dtype=torch.float32)
            if lay.shards[rank].numel > 0:
                mine[: lay.shards[rank].numel].copy_(shards[b].master.cpu())
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine, group=group)
            params = [opt._params[p].data for p in lay.params]
            dev = params[0].device
            for r, sh in enumerate(lay.shards):
                if sh.numel > 0 and r != rank:
                    ops_bucketing.unflatten(
                        parts[r][: sh.numel].to(dev), params, lay.offsets, begin=sh.begin
                    )
