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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import tempfile
from typing import Any

import torch.distributed as dist

from pyasync.optimizer import DistributedOptimizer
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


def check_args(path: Any, opt: Any, what: str) -> str:
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


def global_src(opt: DistributedOptimizer) -> int:
    return dist.get_global_rank(opt.process_group, 0) if opt.process_group is not None else 0


def collective(opt: DistributedOptimizer, what: str, fn, *args, **kwargs):
    """Run collective ``fn`` on the optimizer's own group (bounded by its timeout); a failure is a
    CheckpointError that names the rank that died when the transport saw it."""
    try:
        return fn(*args, group=opt.collective_group, **kwargs)
    except Exception as e:
        err = collective_failure(e, opt.engine.transport, what)
        raise CheckpointError(f"{what} failed: {err}; nothing was committed or loaded by this call") from err


