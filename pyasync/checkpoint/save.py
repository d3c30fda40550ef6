"""save_checkpoint: lock the directory, drain, write each rank's shard file, commit with rank 0's
manifest, clean up.

See Note [Checkpoint atomicity] in checkpoint/common.py, Note [Checkpoint directory lock] in
checkpoint/lock.py and Note [Checkpoint cleanup] below.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import time
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pyasync.checkpoint import lock as dirlock
from pyasync.checkpoint.common import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SHARD_RE,
    TMP_PREFIX,
    TMP_RE,
    CheckpointError,
    Target,
    atomic_write,
    check_args,
    collective,
    host_id,
    manifest_names,
    shard_name,
)

__all__ = ["cleanup", "save_checkpoint"]

TMP_STALE_S = 3600.0  # a temporary file untouched this long (seconds) belongs to no live save
HEAD = 3 + dirlock.HOST_BYTES // 8  # int64s of rank 0's first broadcast: save id, lock, holder pid, host


def drain(t: Target) -> None:
    """Wait until every push made before this save (by any rank) has been processed by the shards this
    rank owns: processed[w] == clock of worker w for every owned shard. See Note [Checkpoint drain].

    Note [Checkpoint drain]
    Every rank's clock (completed steps; each step pushes every bucket once) is exchanged with an
    all_gather, then each rank waits (Owner.wait_processed: a condition its applier threads notify
    after every push, bounded by the optimizer's timeout) until each owned shard has processed that
    many pushes from every worker, pushes still on the network included. Under BSP this returns at
    once: a step only returns once every owner applied that clock. Under SSP/ASP a processed push is
    an applied push, so the checkpoint holds every push made before the save. Under Quorum(k < n) a
    processed late push may be dropped by policy or, with late="fold", wait in the next aggregate,
    which is not saved.

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
    eng = t.engine
    world = t.world
    mine = torch.tensor([eng.clock], dtype=torch.int64)
    clocks = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        collective(t, "save_checkpoint: exchanging clocks", dist.all_gather, clocks, mine)
    else:
        clocks = [mine]
    eng.drain([int(c.item()) for c in clocks])


# Note [Checkpoints and held values]
# With compressed replies (a lossy codec, ``replies=True``: the default), a worker's parameters are not
# the masters but the values it holds: what it decoded of the owners' coded changes, which trail the
# masters by what the codec has not delivered yet (Note [Compressed replies on the point-to-point path]
# in engine/core/replies.py, Note [Compressed replies] in engine/collective/gather.py). The next reply encodes
# master - held, so a bit-identical resume needs both sides of ``held`` back, exactly:
#
# * saving changes nothing: the save drains and snapshots, it never replaces what the workers hold with
#   the masters (that would send, in effect, an exact reply the run that never saved does not send);
# * each owned shard's entry in the shard file carries ``held``: float32 [1, numel] when every worker
#   holds the same values of the shard (always under BSP, on collectives and on bsp:p2p), [n, numel]
#   otherwise (row w: worker w's). Only under BSP: under SSP/ASP/Quorum a reply may be in flight when
#   a load restores ``held``, and those runs are not deterministic anyway, so they save none;
# * a load into the same world size, when every rank's file carries it (agreed in the validation's
#   all_gather), restores ``held`` on the owners (``shards.restore_held``) and gives every worker row w
#   of every shard (one all_to_all: the parameters, the p2p worker's held values and the collective
#   engine's replica, bit for bit). The next coded reply is then the one the uninterrupted run sends.
#
# Otherwise (a checkpoint without ``held``: format version 1 or another policy; exact replies; a load
# into another world size, Note [Re-sharding] in reshard.py, where no worker of the new layout held
# anything of the new shards), the load does what it always did: every rank's parameters take the
# masters, the owners forget what the workers hold and the first reply after the load is exact. That
# run is correct but not bit-identical to an uninterrupted one (it jumps to the masters one reply early).
# The price of ``held`` is one more fp32 copy of each shard in its file under BSP.


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists, owned by someone else
        return True
    return True


def cleanup(d: str, keep: set[str], before_ns: int, replaced: set[str] | None, locked: bool) -> list[str]:
    """After a commit, delete from ``d`` what no checkpoint needs; returns the names deleted.

    Note [Checkpoint cleanup]
    A shard file is deleted only if (1) this save's manifest does not name it (``keep``), (2) the
    manifest on disk, re-read right here, does not name it either (a newer save's), and (3) it was
    last modified strictly before this save's manifest was written (``before_ns``): a file written
    after that belongs to a save that started later. Under the lock (``locked``), every other shard
    file is a candidate: older or failed saves, crashed ones. Unlocked (no flock, see Note
    [Checkpoint directory lock]) another save may be writing right now, so only the files of the
    manifest this save replaced (``replaced``, read just before the commit) are candidates: a manifest
    that has been replaced never becomes current again, so this never deletes a file that a current or
    future manifest names, even with concurrent saves; orphans of failed saves then stay until a
    locked save sweeps them. A temporary file (``.pyasync-tmp-<host id>-<pid>-*``) is deleted only if
    it was written on this host by a process that is gone, or is untouched for TMP_STALE_S: a
    concurrent writer's temporary files are never removed (were one removed anyway, e.g. by a writer
    in another pid namespace, its rename fails and that save raises; nothing dangles). Mtime ties on
    coarse-grained file systems keep a file until the next save: an orphan, never a dangling name.
    """
    now = manifest_names(d)
    named = now[1] if now is not None else None
    me = host_id()
    deleted = []
    for f in sorted(os.listdir(d)):
        p = os.path.join(d, f)
        try:
            st = os.stat(p)
        except OSError:
            continue
        if SHARD_RE.match(f):
            candidate = locked or (replaced is not None and f in replaced)
            ok = candidate and named is not None and f not in keep and f not in named
            if not ok or st.st_mtime_ns >= before_ns:
                continue
        elif f.startswith(TMP_PREFIX):
            m = TMP_RE.match(f)
            gone = m is not None and m.group(1) == me and not _pid_alive(int(m.group(2)))
            if not gone and time.time_ns() - st.st_mtime_ns < TMP_STALE_S * 1e9:
                continue
        else:
            continue
        try:
            os.unlink(p)
            deleted.append(f)
        except OSError:
            pass
    return deleted


def _lock_head(lk: dirlock.DirLock, save_id: int) -> torch.Tensor:
    """Rank 0's first broadcast: [save id, lock outcome, holder pid, holder host (bytes)]."""
    head = torch.zeros(HEAD, dtype=torch.int64)
    head[0] = save_id
    try:
        head[1] = lk.acquire()
    except Exception as e:  # never skip the broadcast: the other ranks wait in it
        lk.error, head[1] = f"cannot lock {lk.path}: {type(e).__name__}: {e}", dirlock.ERROR
    pid, host = lk.holder
    head[2] = pid or 0
    raw = (host or "").encode("utf-8", "replace")[: dirlock.HOST_BYTES].ljust(dirlock.HOST_BYTES, b"\0")
    head[3:] = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    return head


def _lock_error(d: str, head: torch.Tensor, rank: int, lk: dirlock.DirLock | None) -> str:
    """'' when the save may go on (lock held, or no flock here); the error every rank raises if not."""
    state = int(head[1])
    if state in (dirlock.HELD, dirlock.UNLOCKED):
        return ""
    if state == dirlock.BUSY:
        pid = int(head[2]) or None
        host = head[3:].numpy().tobytes().rstrip(b"\0").decode("utf-8", "replace") or None
        return (
            f"save_checkpoint: another save is writing to {d} ({dirlock.describe_holder(pid, host)}); "
            "this save wrote nothing and the checkpoint there is unchanged. Save into another "
            "directory, or wait for that save to finish"
        )
    if rank == 0 and lk is not None:
        return f"save_checkpoint({d!r}): {lk.error}; nothing was written"
    return f"save_checkpoint({d!r}): rank 0 could not lock the directory (see its error); nothing was written"


def save_checkpoint(path: str | os.PathLike, opt: Any) -> None:
    """Save ``opt`` (every rank's shard: fp32 master values, optimizer state, error-feedback residuals,
    clocks and versions, and with compressed replies what the workers hold of it: Note [Checkpoints and
    held values]) into the directory ``path``. Saving does not change the run. Collective: call on
    every rank of the optimizer's process group, between steps (after ``step()`` returned, before the
    next backward).

    The save first drains (waits at most the optimizer's timeout, in seconds of wall time): every push
    any rank made before the save is processed by its owner. Under BSP, Quorum(n), SSP and ASP every
    such push is then applied and in the checkpoint; under Quorum(k < n) a late push may be dropped by
    policy or wait, folded, in an aggregate that is not saved. See Note [Checkpoint drain] and
    docs/reliability.md.

    One save at a time per directory: rank 0 holds ``path/.pyasync-lock`` (fcntl.flock) from before
    the first file is written until the commit and cleanup are done. See Note [Checkpoint directory
    lock] in checkpoint/lock.py.

    Raises CheckpointError on every rank when any rank failed to write its file, or when another save
    holds the directory lock ("another save is writing to ... (lock held by pid N on HOST)"); the
    previous checkpoint in ``path``, if any, is then left as it was.
    """
    d, t = check_args(path, opt, "save_checkpoint")
    lk = dirlock.DirLock(d) if t.rank == 0 else None
    try:
        _save(d, t, lk)
        t.epoch.last_checkpoint = d  # elastic: the lost shards' optimizer state comes from here
    finally:
        if lk is not None:
            lk.release()


class Written(NamedTuple):
    """What this rank's part of a save produced (``_write``)."""

    save_id: str  # 16 hex digits, rank 0's draw
    fname: str  # this rank's shard file name
    locked: bool  # rank 0 holds the directory lock (False: no flock here, or refused)
    err: str  # why this rank's part failed ("" when it did not)
    digest: bytes  # sha256 of the shard file (zeros when not written)
    size: int  # bytes of the shard file (0 when not written)
    clock: int  # this rank's clock at the save


def _save(d: str, t: Target, lk: dirlock.DirLock | None) -> None:
    """Write every rank's shard file, check that every rank did, and commit with rank 0's manifest."""
    w = _write(d, t, lk)
    table = _gather(d, t, w)
    _commit(d, t, w, table)


def _write(d: str, t: Target, lk: dirlock.DirLock | None) -> Written:
    """Agree on a save id and the lock, drain, and write this rank's shard file, paused (Note [Quorum
    and save]); a failure is returned in ``err`` (every rank reports it after the gather)."""
    rank, world = t.rank, t.world
    eng = t.engine

    # See Note [Quorum and save]: from here until this rank's state is taken, rounds do not wait for
    # this rank's pushes (it sends none while it saves).
    err = ""
    eng.pause()
    try:
        # Rank 0 locks the directory and draws a fresh save id; both go out in one broadcast (a
        # tensor: nothing from the network is unpickled), so every rank knows whether to write.
        if lk is not None:
            head = _lock_head(lk, secrets.randbits(63))
        else:
            head = torch.zeros(HEAD, dtype=torch.int64)
        if world > 1:
            collective(t, "save_checkpoint: agreeing on a save id and the lock", dist.broadcast, head,
                       group_src=0)
        err = _lock_error(d, head, rank, lk)
        if rank == 0 and int(head[1]) == dirlock.UNLOCKED:
            warnings.warn(
                f"save_checkpoint({d!r}): {lk.error if lk else 'no flock'}; saving without the directory "
                "lock (concurrent saves into this directory are not refused; see docs/reliability.md)",
                RuntimeWarning,
                stacklevel=4,
            )
        locked = int(head[1]) == dirlock.HELD
        save_id = f"{int(head[0]):016x}"
        fname = shard_name(save_id, rank, world)

        digest, size = b"\0" * 32, 0
        clock = eng.clock
        try:
            # The drain's all_gather runs even when the lock was refused: it is the first meeting of
            # Note [Barriers and quorums], and a rank that fails here still reaches the next one.
            drain(t)
            if not err:
                sd = t.state_dict()
                os.makedirs(d, exist_ok=True)
                buf = io.BytesIO()
                torch.save(sd, buf)
                data = buf.getvalue()
                digest, size = hashlib.sha256(data).digest(), len(data)
                atomic_write(os.path.join(d, fname), data)
        except Exception as e:  # reported on every rank below
            err = err or f"rank {rank} could not write {os.path.join(d, fname)}: {type(e).__name__}: {e}"
    finally:
        # RESUME, and wait until this rank's owner has every rank's RESUME; the gather below is then
        # the second meeting of Note [Barriers and quorums] (pyasync/optimizer.py).
        try:
            eng.resume()
        except Exception as e:  # reported on every rank below
            err = err or f"rank {rank}: {type(e).__name__}: {e}"
    return Written(save_id, fname, locked, err, digest, size, clock)


def _gather(d: str, t: Target, w: Written) -> list[torch.Tensor]:
    """Every rank's (ok, size, clock, sha256); CheckpointError on every rank when any rank failed."""
    world = t.world
    # Gather (ok, size, clock, sha256) from every rank. This also makes the save a barrier: no rank
    # pushes for its next step before every owner has taken its state.
    mine = torch.zeros(7, dtype=torch.int64)
    mine[0], mine[1], mine[2] = int(not w.err), w.size, w.clock
    mine[3:] = torch.frombuffer(bytearray(w.digest), dtype=torch.int64)
    table = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        collective(t, "save_checkpoint: gathering every rank's result", dist.all_gather, table, mine)
    else:
        table = [mine]
    failed = [r for r in range(world) if int(table[r][0]) != 1]
    if failed:
        if not w.err:  # this rank's file is an orphan now: the manifest will not name it
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d, w.fname))
        raise CheckpointError(
            w.err or f"save_checkpoint({d!r}): rank(s) {failed} could not write their shard file (see "
            "their error); the previous checkpoint in this directory, if any, is unchanged"
        )
    return table


def _commit(d: str, t: Target, w: Written, table: list[torch.Tensor]) -> None:
    """Rank 0 commits with the manifest; the others learn whether it worked. Then rank 0 cleans up."""
    rank, world, save_id = t.rank, t.world, w.save_id
    commit_err = ""
    keep = {shard_name(save_id, r, world) for r in range(world)}
    before_ns, replaced = 0, None
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "world_size": world,
            "save_id": save_id,
            "policy": t.policy.spec(),
            "compression": t.compressor.spec(),
            "torch_version": torch.__version__,
            "clocks": [int(x[2]) for x in table],
            **t.describe(),
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
        prev = manifest_names(d)  # the manifest this commit replaces (Note [Checkpoint cleanup])
        replaced = prev[1] if prev is not None else None
        try:
            before_ns = atomic_write(os.path.join(d, MANIFEST), json.dumps(manifest, indent=1).encode())
        except Exception as e:
            commit_err = f"rank 0 could not write {os.path.join(d, MANIFEST)}: {type(e).__name__}: {e}"
    flag = torch.tensor([int(not commit_err)], dtype=torch.int64)
    if world > 1:
        collective(t, "save_checkpoint: the commit", dist.broadcast, flag, group_src=0)
    if int(flag.item()) != 1:
        # The new shard files are orphans; the old manifest (if any) still names the old, intact ones.
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(d, w.fname))
        raise CheckpointError(
            (commit_err or f"save_checkpoint: rank 0 could not write {os.path.join(d, MANIFEST)}")
            + "; the previous checkpoint in this directory, if any, is unchanged"
        )
    if rank == 0:  # committed: remove what no manifest names any more (best effort), still locked
        cleanup(d, keep, before_ns, replaced, w.locked)
