"""Elastic membership: the survivors of a dead worker start a new membership epoch and keep training.

Note [Membership epochs]
    A DistributedOptimizer built with ``elastic=True`` (SSP, ASP, Quorum, ``bsp:p2p``) starts in epoch
    0 with every rank of its group. When a rank leaves (its connections end: it was killed, it crashed,
    it exited without close(); or a peer that gave up named it), every survivor's transport sees it
    within milliseconds and the engine *departs* it: the owners' rounds stop waiting for its pushes, the
    workers stop waiting for its shards' answers, nothing more is sent to it. The step in flight
    finishes with the survivors. Then, at the end of that ``step()`` (or in ``close()``), each survivor
    changes epoch (:func:`change_epoch`):

    1. **Drain.** It sends CLOSE to every live owner and waits (bounded) until every live owner has
       applied every push of every survivor and sent its final values, and installs them: no push of a
       survivor to a live owner is lost or applied twice. Its own shards are snapshotted (masters and
       optimizer state) and the old engine's threads stop.
    2. **Agree.** The members of epoch e+1 are the old members minus the ranks this survivor saw leave;
       the first survivor to write ``<job>/epoch<e+1>`` in the job's store decides, the others adopt it
       (``compare_set``). Only a majority may decide (half, with the lowest old rank), so a rank that
       was stopped (SIGSTOP) and dropped for its silence, and then finds every peer gone when it runs
       again, waits for the majority's decision and finds itself left out: it raises
       :class:`pyasync.PeerFailure` ("dropped from the job").
    3. **A fresh group.** gloo groups cannot shrink: a new gloo group of the members is built with
       ``new_group(..., use_local_synchronization=True)`` (only the members take part; it lives on a
       ``PrefixStore`` of the job's store named after its ranks) and a new TCP transport over it. The
       store must outlive every worker: under torchrun the agent hosts it; a store hosted by rank 0's
       process dies with rank 0.
    4. **The lost shards' values** come from the freshest replica among the survivors: the one that
       installed the newest version of that shard (among equal versions, the one reflecting the most
       pushes; then the lowest rank) broadcasts it, with the clocks it reflects. Every survivor kept
       its pushes to the dead owner that no answer it installed reflects; those the freshest replica
       does not reflect go to the first member, which replays them on it as the dead owner would have
       (Note [Replaying a dead owner's pushes] in engine/replay.py): no survivor's push is lost
       (``stats().pushes_resent``; ``pushes_lost`` counts any that could not be replayed: none).
    5. **Re-shard.** The buckets are cut into m shards for the m members (the checkpoints' re-sharding,
       Note [Re-sharding]); master values and optimizer state of the live owners move to their new
       owners exactly (an all-reduce of disjoint parts). The lost shards' optimizer state (momentum,
       Adam moments, step counts) comes from the last checkpoint saved in this epoch, else it is
       re-initialized; every worker's error-feedback residuals are reset: both are reported (log
       line, ``stats().epochs``).
    6. **Go on.** A new engine over the members starts from these values; means divide by m (SSP/ASP
       scale by 1/m; Quorum(k) with k > m waits for all m). Clocks restart at 0 in the new epoch
       (``stats().clock`` keeps counting).

    BSP on collectives does not recover: a dead rank makes every survivor raise PeerFailure naming it,
    bounded by the timeout (resume from the last checkpoint). Use ``bsp:p2p`` for a BSP that survives.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pyasync.engine.core.access import bucket_values
from pyasync.engine.p2p.replay import gather_frames, replay
from pyasync.errors import PeerFailure
from pyasync.ops import bucketing as ops_bucketing
from pyasync.policy import Quorum
from pyasync.session import meet
from pyasync.session.meet import agree_members, meet_members

if TYPE_CHECKING:
    from pyasync.optimizer import DistributedOptimizer

__all__ = ["EpochChange", "change_epoch"]

_log = logging.getLogger("pyasync")


@dataclass
class EpochChange:
    """One membership change as this rank saw it (``stats().epochs``)."""

    epoch: int  # the new epoch
    lost: list[int]  # global ranks that left
    members: list[int]  # global ranks of the new epoch
    seconds: float  # from the start of the change on this rank to the new engine running
    seen_at: float  # wall time (time.time()) this rank first saw a rank leave
    started_at: float  # wall time the change started on this rank (at the end of the step in flight)
    pushes_lost: int  # this worker's pushes to a lost owner that could not be replayed (none kept)
    pushes_resent: int = 0  # this worker's pushes to a lost owner replayed on the freshest replica
    pushes_replayed: int = 0  # pushes this rank replayed (the first member; every survivor's)
    reinitialized: list[str] = field(default_factory=list)  # what was not recovered

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _saved_state(opt: DistributedOptimizer, ranks: list[int]) -> dict | None:
    """{old rank: its shards} from the last checkpoint this optimizer saved in the current epoch (its
    files checked as a load checks them), or None when there is none or it cannot be read."""
    last = opt._last_checkpoint
    if last is None or last[1] != opt._epoch:
        return None
    from pyasync.checkpoint.validate import read_manifest, read_shard

    d = last[0]
    try:
        m = read_manifest(d)
        mpath = os.path.join(d, "manifest.json")
        out = {r: read_shard(d, mpath, m, r, opt, opt._world)["shards"] for r in ranks}
    except Exception as e:
        _log.warning("pyasync: the last checkpoint (%s) could not be read for the lost shards: %s", d, e)
        return None
    return out


def _unflat(params: list[torch.Tensor], lay, flat: torch.Tensor) -> None:
    with torch.no_grad():
        ops_bucketing.unflatten(flat, [params[p].data for p in lay.params], lay.offsets, begin=0)


@torch.no_grad()
def change_epoch(opt: DistributedOptimizer) -> EpochChange:
    """Move ``opt`` to the next membership epoch without the ranks its engine saw leave (Note
    [Membership epochs]). Every survivor calls it; bounded by the optimizer's timeout at every wait."""
    t0, started = time.monotonic(), time.time()
    old = opt._engine
    seen = old.lost_at or started
    old_globals = list(opt._globals)
    lost_old = sorted(old.lost)
    lost = [old_globals[r] for r in lost_old]
    me = old_globals[opt._rank]

    # 1. Drain: every live owner applies every survivor's push; final values installed.
    old.drain_epoch()
    snap = old.shards.snapshot()
    with old.cond:
        versions = dict(old.mailbox.installed_version)
        clocks = {k: list(v) for k, v in old.mailbox.installed_clocks.items()}
    pushed = old.clock  # this worker pushed clocks 0 .. pushed-1 to every owner
    old.stop_epoch()  # the threads stop; the transport stays open until the members met

    # 2. Agree on the members, and meet them in the store (a member that dies meanwhile: again without it).
    st = meet.store()
    if st is None:
        raise PeerFailure("pyasync: elastic membership needs the job's store (torch.distributed's)", lost)
    tp_old = old.transport
    gone = set(lost)
    epoch = opt._epoch
    meet.bound_store(st, opt._timeout)  # Note [A bounded store] in engine/meet.py
    try:
        while True:
            epoch += 1
            members = agree_members(
                st,
                f"{opt._job}/epoch{epoch}",
                [g for g in old_globals if g not in gone],
                old_globals,
                opt._timeout,
            )
            if me not in members:
                raise PeerFailure(
                    f"pyasync: rank {me} was dropped from the job in membership epoch {epoch} (the others "
                    "saw it leave or stall); it cannot rejoin this job: restart it, or resume from a "
                    "checkpoint",
                    [me],
                )
            died = meet_members(
                st, f"{opt._job}/epoch{epoch}/here", members, me, tp_old, old_globals, opt._timeout
            )
            if not died:
                break
            gone |= set(died)
        lost = [g for g in old_globals if g not in members]
        lost_old = [old_globals.index(g) for g in lost]

        # 3. A fresh group of the members (through the store too).
        group = dist.new_group(
            ranks=members, timeout=opt._timeout, backend="gloo", use_local_synchronization=True
        )
    except Exception as e:  # the store failed: name its host, and say where it must live
        err = meet.store_failure(e, f"the change to membership epoch {epoch}", opt._group, opt._timeout)
        if err is None:
            raise
        old._sticky(err)
        raise err from e
    finally:
        if tp_old is not None:
            tp_old.close()
    m = len(members)
    new_rank = members.index(me)

    # 4. The lost shards' values: the freshest replica among the survivors (the newest version; among
    #    equal versions, the one reflecting the most pushes), and the clocks it reflects.
    n_old = len(old_globals)
    keys = [(b, r) for b, lay in enumerate(opt._layouts) for r in lost_old if lay.shards[r].numel > 0]
    mine = torch.tensor(
        [x for k in keys for x in (versions.get(k, -1), sum(clocks.get(k, [-1] * n_old)))] or [0],
        dtype=torch.int64,
    )
    table = [torch.zeros_like(mine) for _ in range(m)]
    if m > 1:
        dist.all_gather(table, mine, group=group)
    else:
        table = [mine]
    flats = [bucket_values(opt._params, lay) for lay in opt._layouts]
    fresh: list[tuple[int, list[int]]] = []  # per key: (version, reflected clocks) of the freshest replica
    for i, (b, r) in enumerate(keys):
        col = [(int(t[2 * i]), int(t[2 * i + 1])) for t in table]
        src = col.index(max(col))
        sh = opt._layouts[b].shards[r]
        part = flats[b][sh.begin : sh.end].clone()
        inc = torch.tensor(clocks.get((b, r), [-1] * n_old), dtype=torch.int64)
        if m > 1:
            dist.broadcast(part, src=members[src], group=group)
            dist.broadcast(inc, src=members[src], group=group)
        flats[b][sh.begin : sh.end] = part
        fresh.append((col[src][0], inc.tolist()))
    for lay, flat in zip(opt._layouts, flats):
        _unflat(opt._params, lay, flat)

    # 4b. The pushes those replicas do not reflect: every survivor kept them (Note [Replaying a dead
    #     owner's pushes]); the first member replays them on the lost shards, from their saved state.
    frames, lost_pushes = [], 0
    for i, (b, r) in enumerate(keys):
        ref = fresh[i][1][opt._rank]
        kept = old.pusher.retain.after((b, r), ref) if old.pusher.retain is not None else []
        want = ref + 1
        for c, f in kept:
            if c != want:
                break
            frames.append((i, c, f))
            want += 1
        lost_pushes += max(0, pushed - want)  # none: every push is kept until reflected
    resent = len(frames)
    everyone = (
        gather_frames(frames, group=group, members=members, senders=[old_globals.index(g) for g in members])
        if m > 1
        else [(i, opt._rank, f) for i, _, f in frames]
    )
    ckpt = _saved_state(opt, lost_old) if new_rank == 0 and keys else None
    rebuilt: dict[tuple[int, int], Any] = {}
    replayed = 0
    if new_rank == 0:
        for i, (b, r) in enumerate(keys):
            sh = opt._layouts[b].shards[r]
            state = opt._rule.new_state(sh, flats[b][sh.begin : sh.end].clone())
            saved = (ckpt or {}).get(r, {}).get(str(b))
            if saved is not None:
                opt._rule.load_state_tensors(state, saved["optim"], f"checkpoint shard {r} bucket {b}")
            mine_i = [(s_, f) for k, s_, f in everyone if k == i]
            replayed += replay(
                rule=opt._rule,
                policy=old.policy,
                world_size=n_old,
                state=state,
                version=fresh[i][0],
                reflected=fresh[i][1],
                departed=lost_old,
                frames=mine_i,
                spec=old.spec,
            )
            rebuilt[(b, r)] = state
        if any(not 0 <= k < len(keys) for k, _, _ in everyone):
            raise ValueError("pyasync: a member sent pushes to replay for a shard that was not lost")

    # 5. Re-shard masters and optimizer state onto the members (disjoint parts, summed).
    new_layouts = opt._build_layouts(m)
    flag = torch.tensor([1 if ckpt else 0], dtype=torch.int64)
    if m > 1:
        dist.broadcast(flag, src=members[0], group=group)
    shards: dict[int, dict] = {}
    for b, lay in enumerate(opt._layouts):
        names = sorted(opt._rule.state_names())
        full = {n: torch.zeros(lay.numel, dtype=torch.float32) for n in ["master", *names]}
        offs = [0]
        for sh in lay.shards:
            offs.append(offs[-1] + len(sh.segments))
        steps = torch.zeros(offs[-1], dtype=torch.int64)
        own = lay.shards[opt._rank]
        if b in snap:
            d = snap[b]
            full["master"][own.begin : own.end] = d["master"].reshape(-1).cpu()
            for n in names:
                if n in d["optim"]:
                    full[n][own.begin : own.end] = d["optim"][n].reshape(-1).cpu()
            steps[offs[opt._rank] : offs[opt._rank + 1]] = d["optim"]["steps"].reshape(-1)
        for r in lost_old:  # the lost ranges, rebuilt on the first member (4b)
            st = rebuilt.get((b, r))
            if st is None:
                continue
            sh = lay.shards[r]
            full["master"][sh.begin : sh.end] = st.master.cpu()
            for n in names:
                if getattr(st, n) is not None:
                    full[n][sh.begin : sh.end] = getattr(st, n).cpu()
            steps[offs[r] : offs[r + 1]] = torch.tensor(st.steps, dtype=torch.int64)
        if m > 1:
            for n in ["master", *names]:
                dist.all_reduce(full[n], group=group)
            dist.all_reduce(steps, group=group)
        new = new_layouts[b].shards[new_rank]
        if new.numel == 0:
            continue
        spans = [
            (sh.begin + seg.begin, sh.begin + seg.end, int(steps[offs[r] + i]))
            for r, sh in enumerate(lay.shards)
            for i, seg in enumerate(sh.segments)
        ]
        seg_steps = [
            next(c for lo, hi, c in spans if lo <= new.begin + seg.begin < hi) for seg in new.segments
        ]
        dev = opt._params[0].device
        optim = {n: full[n][new.begin : new.end].clone().to(dev) for n in names}
        optim["steps"] = torch.tensor(seg_steps, dtype=torch.int64)
        shards[b] = {"master": full["master"][new.begin : new.end].clone().to(dev), "optim": optim}
    reinit = []
    if keys and int(flag) == 1:
        reinit.append(
            f"optimizer state of the shards of ranks {lost} (from the checkpoint {opt._last_checkpoint[0]})"
        )
    elif keys:
        reinit.append(f"optimizer state of the shards of ranks {lost} (re-initialized: no checkpoint)")
    if opt._comp.error_feedback:
        opt._comp.reset()
        reinit.append("error-feedback residuals of every worker (reset)")

    # 6. The new engine.
    policy = opt._policy
    if isinstance(policy, Quorum) and policy.k > m:
        policy = Quorum(m, late=policy.late)
    opt._start_epoch(group, members, new_layouts, policy, epoch, pushed)
    opt._engine.shards.load(shards)
    change = EpochChange(
        epoch=epoch,
        lost=lost,
        members=members,
        seconds=time.monotonic() - t0,
        seen_at=seen,
        started_at=started,
        pushes_lost=lost_pushes,
        pushes_resent=resent,
        pushes_replayed=replayed,
        reinitialized=reinit,
    )
    _log.warning(
        "pyasync: membership epoch %d: ranks %s left; %d ranks %s go on (rank %d is now %d of %d); "
        "recovered in %.3f s; %d of this worker's pushes to the lost owners re-sent (%d replayed here), "
        "%d lost; re-initialized: %s",
        epoch,
        lost,
        m,
        members,
        me,
        new_rank,
        m,
        change.seconds,
        resent,
        replayed,
        lost_pushes,
        "; ".join(reinit) or "nothing",
    )
    return change
