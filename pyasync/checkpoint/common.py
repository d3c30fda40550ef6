"""Shared pieces of the checkpoint package: the format constants, the error type, argument checks and
atomic file writes.

Note [Checkpoint atomicity]
Every file is written to a temporary name in the same directory, fsync'ed, then os.replace'd into
place, and the directory is fsync'ed. Shard file names carry a fresh random save id, so a new save
never overwrites the shard files that the current manifest names: until rank 0 replaces the manifest
(after every rank reported its shard written, with its sha256), the previous checkpoint stays whole
and loadable. Only after the new manifest is in place does rank 0 delete shard files that no manifest
on disk names any more (Note [Checkpoint cleanup] in save.py). A crash at any point leaves either the
old or the new checkpoint, never a mix. Concurrent saves into one directory are excluded by a lock
(Note [Checkpoint directory lock] in lock.py); loads take no lock (Note [Loading while a save
commits] in load.py).

Note [Checkpoints take the pieces]
The checkpoint modules never import the optimizer (that made an import cycle: the optimizer's membership
changes read the last checkpoint). ``save_checkpoint`` and ``load_checkpoint`` take the optimizer, check
that it has the DistributedOptimizer's public face, and read what they use from it once, into a
:class:`Target`: the current epoch's rank, world size and layouts, the engine, the groups, the policy and
compressor, and its state_dict / load_state_dict / describe. Every other function takes the Target or
plain values (layouts, param_groups), so session/membership.py reads a checkpoint with the same
functions, passing the pieces it holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pyasync.session.meet import collective_failure

FORMAT = "pyasync-checkpoint"
FORMAT_VERSION = 2  # 2: a shard's entry may carry "held" (Note [Checkpoints and held values] in save.py)
READ_VERSIONS = (1, 2)  # what load_checkpoint reads (a version 1 checkpoint loads as before)
MANIFEST = "manifest.json"
SHARD_RE = re.compile(r"^shard-[0-9a-f]{16}-r\d+-of-\d+\.pt$")
TMP_PREFIX = ".pyasync-tmp-"
# A temporary file's name says who writes it: .pyasync-tmp-<host id>-<pid>-<random> (Note [Checkpoint
# cleanup] in save.py). Older pyasync wrote .pyasync-tmp-<random>; those only age out.
TMP_RE = re.compile(r"^\.pyasync-tmp-([0-9a-f]{8})-(\d+)-")
SAVE_ID_RE = re.compile(r"^[0-9a-f]{16}$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded (missing, truncated, corrupt, foreign, mismatched),
    or a save refused because another save is writing to the same directory."""


class CheckpointChanged(CheckpointError):
    """A concurrent save replaced the checkpoint while it was being loaded (a file the manifest named
    was removed, or the ranks read different manifests); nothing was loaded: retry the load."""


@dataclass(frozen=True)
class Target:
    """What a checkpoint reads and writes of a DistributedOptimizer, taken from its public face once per
    save or load (Note [Checkpoints take the pieces])."""

    rank: int  # this rank in the current membership epoch
    world: int  # ranks of the current epoch
    layouts: list  # the current epoch's bucket layouts (engine.core.shards.BucketLayout)
    numels: list[int]  # elements of each trained parameter, in the engine's order
    param_groups: list[dict]  # the wrapped optimizer's param_groups
    policy: Any  # pyasync.policy.Policy
    compressor: Any  # pyasync.compression Compressor
    fused: bool  # SGD / Adam / AdamW with the fused kernels (re-shardable state)
    engine: Any  # the optimizer's engine: pause/resume, drain, clock, shards, transport
    group: dist.ProcessGroup | None  # the process group it trains over (None: the default group)
    control: dist.ProcessGroup | None  # its own gloo group (None with one rank)
    epoch: Any  # session.epoch.Epoch: a save records itself there (``last_checkpoint``)
    describe: Callable[[], dict]  # what must match between a saving and a loading optimizer
    state_dict: Callable[[], dict]  # this rank's shard (DistributedOptimizer.state_dict)
    load_state_dict: Callable[[dict], None]  # DistributedOptimizer.load_state_dict
    load_local_state: Callable[[dict], None]  # DistributedOptimizer.load_local_state (local steps)
    local: Any  # pyasync.local.LocalSteps under local steps, else None


#: What an object must have to be checkpointed (the DistributedOptimizer's public face).
_FACE = ("epoch", "engine", "bucket_layouts", "named_params", "collective_group", "describe", "fused_rule")


def check_args(path: Any, opt: Any, what: str) -> tuple[str, Target]:
    """``path`` as a str and what the checkpoint reads of ``opt``; a clear error for a wrong argument or
    a closed optimizer."""
    if not isinstance(opt, torch.optim.Optimizer) or not all(hasattr(type(opt), a) for a in _FACE):
        raise TypeError(f"{what}: opt must be a pyasync.DistributedOptimizer, got {type(opt).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: path must be a str or os.PathLike directory, got {type(path).__name__}")
    if opt.closed:
        raise RuntimeError(
            f"{what}: the DistributedOptimizer is closed; save or load before close() (a closed "
            "optimizer's owner threads are stopped)"
        )
    target = Target(
        rank=opt.rank,
        world=opt.world_size,
        layouts=opt.bucket_layouts,
        numels=[p.numel() for _, p in opt.named_params],
        param_groups=opt.param_groups,
        policy=opt.policy,
        compressor=opt.compressor,
        fused=opt.fused_rule,
        engine=opt.engine,
        group=opt.process_group,
        control=opt.collective_group,
        epoch=opt.epoch,
        describe=opt.describe,
        state_dict=opt.state_dict,
        load_state_dict=opt.load_state_dict,
        load_local_state=opt.load_local_state,
        local=opt.local_steps,
    )
    return os.fspath(path), target


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


def host_id() -> str:
    """8 hex digits naming this host in temporary file names."""
    return hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def atomic_write(path: str, data: bytes) -> int:
    """Write ``data`` to ``path`` atomically: temporary file in the same directory, fsync, os.replace,
    fsync of the directory. See Note [Checkpoint atomicity]. Returns the file's modification time
    (ns) as written, before the rename."""
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{host_id()}-{os.getpid()}-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            mtime_ns = os.fstat(f.fileno()).st_mtime_ns
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(d)
    return mtime_ns


def manifest_names(d: str) -> tuple[str, set[str]] | None:
    """(save id, shard file names) of the manifest in ``d`` now, or None when there is none or it
    cannot be read as one (no validation beyond that: for cleanup and for telling a changed checkpoint
    from a broken one)."""
    try:
        with open(os.path.join(d, MANIFEST), "rb") as f:
            m = json.loads(f.read().decode("utf-8"))
        sid, shards = m["save_id"], m["shards"]
        names = {s["file"] for s in shards}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(sid, str) or not all(isinstance(n, str) for n in names):
        return None
    return sid, names


def shard_name(save_id: str, rank: int, world: int) -> str:
    return f"shard-{save_id}-r{rank}-of-{world}.pt"


def collective(t: Target, what: str, fn, *args, **kwargs):
    """Run collective ``fn`` on the optimizer's own group (bounded by its timeout); a failure is a
    CheckpointError that names the rank that died when the transport saw it."""
    try:
        return fn(*args, group=t.control, **kwargs)
    except Exception as e:
        err = collective_failure(e, t.engine.transport, what)
        raise CheckpointError(f"{what} failed: {err}; nothing was committed or loaded by this call") from err


