"""Reading and checking a checkpoint before anything is loaded.

Note [Checkpoint validation]
Loading never unpickles: the manifest is JSON, shard files go through torch.load(weights_only=True)
from the very bytes whose sha256 was checked. Each rank validates everything it will load (manifest
format, world size, parameter names/shapes/dtypes, bucket layout, policy, compression, optimizer,
checksum, shard structure and sizes) before touching the optimizer; the ranks then exchange an "ok"
flag (all_gather on the optimizer's process group) and nothing is loaded unless every rank is ok.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any

import torch

from pyasync.checkpoint.common import (
    FORMAT,
    MANIFEST,
    READ_VERSIONS,
    SAVE_ID_RE,
    SHARD_RE,
    CheckpointChanged,
    CheckpointError,
    Target,
    manifest_names,
)
from pyasync.engine.core.shards import build_layout


def read_manifest(d: str) -> dict[str, Any]:
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
    if m.get("format_version") not in READ_VERSIONS:
        raise CheckpointError(
            f"{mpath}: format version {m.get('format_version')!r}, this pyasync reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}: load it with the pyasync that saved it"
        )
    for key, typ in (("world_size", int), ("shards", list), ("parameters", list), ("buckets", list)):
        if not isinstance(m.get(key), typ):
            raise CheckpointError(f"{mpath}: field {key!r} missing or not a {typ.__name__}")
    if not isinstance(m.get("save_id"), str) or not SAVE_ID_RE.match(m["save_id"]):
        raise CheckpointError(f"{mpath}: field 'save_id' missing or not 16 lowercase hex digits")
    return m


def _strip_bounds(b: Any) -> Any:
    return {k: v for k, v in b.items() if k != "shard_bounds"} if isinstance(b, dict) else b


def compare(mpath: str, m: dict[str, Any], t: Target) -> None:
    """The manifest ``m`` describes this optimizer (another world size only with a fused rule)."""
    mine = t.describe()
    if m["world_size"] != t.world:
        if not t.fused:
            raise CheckpointError(
                f"{mpath}: saved by {m['world_size']} ranks, this run has {t.world}; re-sharding to "
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
    for key, have in (("policy", t.policy.spec()), ("compression", t.compressor.spec())):
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


def _check_slots(fpath: str, name: str, one: str, res: object, world: int, layouts: list) -> None:
    """A compressor's per-(bucket, shard) fp32 slots: keys of this layout, sizes, finite values."""
    if not isinstance(res, dict):
        raise CheckpointError(f"{fpath}: {name!r} is not a dict")
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
                f"{fpath}: {one} key {k!r} is not a (bucket, shard) of this layout "
                f"({len(layouts)} buckets, {world} shards each)"
            )
        _check_tensor(fpath, f"{name}[{k}]", t, layouts[k[0]].shards[k[1]].numel, torch.float32)
        if not bool(torch.isfinite(t).all()):  # a compressor never keeps one (see compression.py)
            raise CheckpointError(f"{fpath}: {name}[{k}] holds NaN or Inf")


def check_state(fpath: str, sd: Any, param_groups: list[dict], rank: int, world: int, layouts) -> None:
    """Everything DistributedOptimizer.load_state_dict will read (for shard ``rank`` of ``world`` of
    ``layouts``, and an optimizer of these ``param_groups``), checked before it runs."""
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
        if "held" in d:  # Note [Checkpoints and held values] in save.py
            h = d["held"]
            _check_tensor(fpath, f"{w}['held']", h, None, torch.float32)
            if h.dim() != 2 or h.shape[0] not in (1, world) or h.shape[1] != sh.numel:
                raise CheckpointError(
                    f"{fpath}: {w}['held'] has shape {tuple(h.shape)}, expected (1 or {world}, {sh.numel})"
                )
            if not bool(torch.isfinite(h).all()):
                raise CheckpointError(f"{fpath}: {w}['held'] holds NaN or Inf")
        o = d["optim"]
        _check_tensor(fpath, f"{w}['optim']['steps']", o.get("steps"), len(sh.segments), torch.int64)
        for k, t in o.items():
            if k in ("state1", "state2", "gap_step"):
                _check_tensor(fpath, f"{w}['optim'][{k!r}]", t, sh.numel, torch.float32)
            elif k != "steps" and not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{fpath}: {w}['optim'][{k!r}] is not a tensor")
    for name, one in (("residuals", "residual"), ("velocities", "velocity")):  # velocities: compression.TopK
        _check_slots(fpath, name, one, sd.get(name, {}), world, layouts)
    groups = sd.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise CheckpointError(f"{fpath}: expected {len(param_groups)} param_groups")
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or set(g) != {k for k in param_groups[i] if k != "params"}:
            raise CheckpointError(f"{fpath}: param_groups[{i}] has different keys than this optimizer's")


def _check_count(fpath: str, where: str, t: Any) -> None:
    _check_tensor(fpath, where, t, 1, torch.int64)
    if int(t) < 0:
        raise CheckpointError(f"{fpath}: {where} is negative ({int(t)})")


def _check_inner(fpath: str, inner: Any, param_groups: list[dict]) -> None:
    """The inner optimizer's state_dict(): its groups hold as many parameters as this optimizer's."""
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or not isinstance(inner.get("state"), dict):
        raise CheckpointError(f"{fpath}: local['inner'] is not an optimizer state_dict()")
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups]
    mine = [len(g["params"]) for g in param_groups]
    if sizes != mine:
        raise CheckpointError(
            f"{fpath}: local['inner'] holds param groups of {sizes} parameters, this optimizer's have {mine}"
        )


def check_local(mpath: str, sd: dict, t: Target) -> None:
    """Under local steps: the worker's side of the state dict (Note [Checkpoints under local steps] in
    pyasync/local.py), checked before anything is loaded. ``replica`` and ``anchor`` are absent when
    re-sharded."""
    fpath = f"{mpath} (rank {t.rank})"
    loc = sd.get("local")
    if not isinstance(loc, dict):
        raise CheckpointError(f"{fpath}: holds no local-steps state (no 'local' dict)")
    _check_count(fpath, "local['outer_steps']", loc.get("outer_steps"))
    _check_inner(fpath, loc.get("inner"), t.param_groups)
    if "replica" not in loc:
        return
    for name in ("inner_steps", "since", "target"):
        _check_count(fpath, f"local[{name!r}]", loc.get(name))
    for name in ("replica", "anchor"):
        vals = loc.get(name)
        if not isinstance(vals, list) or len(vals) != len(t.numels):
            raise CheckpointError(f"{fpath}: local[{name!r}] must be a list of {len(t.numels)} tensors")
        for i, (v, p) in enumerate(zip(vals, t.local.params, strict=True)):
            _check_tensor(fpath, f"local[{name!r}][{i}]", v, p.numel(), p.dtype)
            if tuple(v.shape) != tuple(p.shape) or not bool(torch.isfinite(v).all()):
                raise CheckpointError(f"{fpath}: local[{name!r}][{i}] has another shape or holds NaN or Inf")


def read_shard(
    d: str, mpath: str, m: dict, rank: int, world: int, layouts: list, param_groups: list[dict]
) -> dict:
    """Rank ``rank``'s (of ``world``) shard file of a checkpoint saved with ``layouts``: size, sha256,
    weights_only load, structure (for an optimizer of these ``param_groups``)."""
    entry = next((s for s in m["shards"] if isinstance(s, dict) and s.get("rank") == rank), None)
    if entry is None or not isinstance(entry.get("file"), str) or not SHARD_RE.match(entry["file"]):
        raise CheckpointError(f"{mpath}: no valid shard entry for rank {rank}")
    fpath = os.path.join(d, entry["file"])
    try:
        with open(fpath, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        # A concurrent save that committed after this rank read the manifest removes the files it
        # named (Note [Loading while a save commits] in load.py); a file missing under a manifest
        # that is still the one read is a broken checkpoint.
        now = manifest_names(d)
        if now is None or now[0] != m["save_id"]:
            raise CheckpointChanged(
                f"{d}: the checkpoint changed while loading: {entry['file']}, named by manifest save id "
                f"{m['save_id']}, was removed, and the manifest is now "
                f"{'save id ' + now[0] if now else 'gone or unreadable'} (a concurrent save replaced the "
                "checkpoint); retry the load"
            ) from e
        raise CheckpointError(f"{fpath}: cannot read the shard file named by the manifest: {e}") from e
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
    except Exception as e:  # weights_only refuses anything but plain data
        raise CheckpointError(f"{fpath}: cannot be loaded with weights_only=True: {e}") from e
    check_state(fpath, sd, param_groups, rank, world, layouts)
    return sd


def layouts_for(layouts: list, numels: list[int], world: int) -> list:
    """The buckets of ``layouts`` (of parameters of ``numels`` elements) cut into ``world`` shards (the
    saving run's layout when re-sharding)."""
    groups = [0] * len(numels)
    for lay in layouts:
        for sh in lay.shards:
            for seg in sh.segments:
                groups[seg.param] = seg.group
    return build_layout([lay.params for lay in layouts], numels, groups, world)


