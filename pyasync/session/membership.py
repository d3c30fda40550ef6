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
       (Note [Replaying a dead owner's pushes] in engine/p2p/replay.py): no survivor's push is lost
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
from typing import Any

import torch
import torch.distributed as dist

from pyasync.checkpoint.reshard import cut_shard
from pyasync.checkpoint.validate import read_manifest, read_shard
from pyasync.engine.core.access import bucket_values
from pyasync.engine.p2p.replay import gather_frames, replay
from pyasync.errors import PeerFailure
from pyasync.ops import bucketing as ops_bucketing
from pyasync.policy import Quorum
from pyasync.session import meet
from pyasync.session.epoch import Epoch, Setup, abandon, start_epoch
from pyasync.session.meet import agree_members, meet_members

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


@dataclass
class Drained:
    """What the old engine left once drained and stopped (step 1)."""

    snap: dict[int, dict]  # this rank's shards of the old layout: masters and optimizer state
    versions: dict[tuple[int, int], int]  # (bucket, shard): the version of it this rank installed
    clocks: dict[tuple[int, int], list[int]]  # (bucket, shard): the clocks per worker it reflects
    pushed: int  # this worker pushed clocks 0 .. pushed-1 to every owner
    retain: Any  # the pushes kept until an answer reflects them (engine/p2p/replay.py), or None


@dataclass
class Members:
    """The members of the next epoch and their fresh group (steps 2 and 3)."""

    number: int  # the next epoch
    members: list[int]  # its global ranks
    group: dist.ProcessGroup  # the members' new gloo group
    lost: list[int]  # global ranks of the old epoch that are not members
    lost_old: list[int]  # the same, as ranks of the old epoch


@dataclass
class Lost:
    """The lost shards (step 4 and 4b): their keys, values and what was rebuilt of them."""

    keys: list[tuple[int, int]]  # (bucket, old rank) of every non-empty lost shard
    flats: list[torch.Tensor]  # every bucket's values, the lost shards' from the freshest replica
    fresh: list[tuple[int, list[int]]]  # per key: (version, reflected clocks) of the freshest replica
    rebuilt: dict[tuple[int, int], Any] = field(default_factory=dict)  # first member: ShardState per key
    from_checkpoint: bool = False  # the rebuilt optimizer state came from the last checkpoint
    resent: int = 0  # this worker's pushes to the lost owners sent for replay
    replayed: int = 0  # pushes replayed here (the first member)
    pushes_lost: int = 0  # this worker's pushes that could not be replayed (none: all are kept)


def _saved_state(epoch: Epoch, setup: Setup, ranks: list[int]) -> dict | None:
    """{old rank: its shards} from the last checkpoint saved in ``epoch`` (its files checked as a load
    checks them), or None when there is none or it cannot be read."""
    d = epoch.last_checkpoint
    if d is None:
        return None
    try:
        m = read_manifest(d)
        mpath = os.path.join(d, "manifest.json")
        out = {
            r: read_shard(d, mpath, m, r, epoch.world, epoch.layouts, setup.param_groups)["shards"]
            for r in ranks
        }
    except Exception as e:
        _log.warning("pyasync: the last checkpoint (%s) could not be read for the lost shards: %s", d, e)
        return None
    return out


def _unflat(params: list[torch.Tensor], lay, flat: torch.Tensor) -> None:
    with torch.no_grad():
        ops_bucketing.unflatten(flat, [params[p].data for p in lay.params], lay.offsets, begin=0)


def _drain(old) -> Drained:
    """1. Drain: every live owner applies every survivor's push; final values installed. Then the old
    engine's threads stop (its transport stays open until the members met)."""
    old.drain_epoch()
    snap = old.shards.snapshot()
    with old.cond:
        versions = dict(old.mailbox.installed_version)
        clocks = {k: list(v) for k, v in old.mailbox.installed_clocks.items()}
    pushed = old.clock  # this worker pushed clocks 0 .. pushed-1 to every owner
    old.stop_epoch()  # the threads stop; the transport stays open until the members met
    return Drained(snap, versions, clocks, pushed, old.pusher.retain)


def _agree(epoch: Epoch, setup: Setup, lost: list[int]) -> Members:
    """2. Agree on the members, and meet them in the store (a member that dies meanwhile: again without
    it). 3. A fresh group of the members (through the store too)."""
    old, old_globals, timeout = epoch.engine, epoch.members, setup.timeout
    me = old_globals[epoch.rank]
    st = meet.store()
    if st is None:
        raise PeerFailure("pyasync: elastic membership needs the job's store (torch.distributed's)", lost)
    tp_old = old.transport
    gone = set(lost)
    number = epoch.number
    meet.bound_store(st, timeout)  # Note [A bounded store] in session/meet.py
    try:
        while True:
            number += 1
            members = agree_members(
                st,
                f"{epoch.key}/epoch{number}",
                [g for g in old_globals if g not in gone],
                old_globals,
                timeout,
            )
            if me not in members:
                raise PeerFailure(
                    f"pyasync: rank {me} was dropped from the job in membership epoch {number} (the others "
                    "saw it leave or stall); it cannot rejoin this job: restart it, or resume from a "
                    "checkpoint",
                    [me],
                )
            died = meet_members(
                st, f"{epoch.key}/epoch{number}/here", members, me, tp_old, old_globals, timeout
            )
            if not died:
                break
            gone |= set(died)
        lost = [g for g in old_globals if g not in members]
        group = dist.new_group(ranks=members, timeout=timeout, backend="gloo", use_local_synchronization=True)
    except Exception as e:  # the store failed: name its host, and say where it must live
        err = meet.store_failure(e, f"the change to membership epoch {number}", epoch.group, timeout)
        if err is None:
            raise
        old.record_failure(err)
        raise err from e
    finally:
        if tp_old is not None:
            tp_old.close()
    return Members(number, members, group, lost, [old_globals.index(g) for g in lost])


def _freshest(epoch: Epoch, setup: Setup, mem: Members, dr: Drained) -> Lost:
    """4. The lost shards' values: the freshest replica among the survivors (the newest version; among
    equal versions, the one reflecting the most pushes), and the clocks it reflects."""
    members, group, m = mem.members, mem.group, len(mem.members)
    n_old = len(epoch.members)
    keys = [(b, r) for b, lay in enumerate(epoch.layouts) for r in mem.lost_old if lay.shards[r].numel > 0]
    mine = torch.tensor(
        [x for k in keys for x in (dr.versions.get(k, -1), sum(dr.clocks.get(k, [-1] * n_old)))] or [0],
        dtype=torch.int64,
    )
    table = [torch.zeros_like(mine) for _ in range(m)]
    if m > 1:
        dist.all_gather(table, mine, group=group)
    else:
        table = [mine]
    flats = [bucket_values(setup.params, lay) for lay in epoch.layouts]
    fresh: list[tuple[int, list[int]]] = []  # per key: (version, reflected clocks) of the freshest replica
    for i, (b, r) in enumerate(keys):
        col = [(int(t[2 * i]), int(t[2 * i + 1])) for t in table]
        src = col.index(max(col))
        sh = epoch.layouts[b].shards[r]
        part = flats[b][sh.begin : sh.end].clone()
        inc = torch.tensor(dr.clocks.get((b, r), [-1] * n_old), dtype=torch.int64)
        if m > 1:
            dist.broadcast(part, src=members[src], group=group)
            dist.broadcast(inc, src=members[src], group=group)
        flats[b][sh.begin : sh.end] = part
        fresh.append((col[src][0], inc.tolist()))
    for lay, flat in zip(epoch.layouts, flats):
        _unflat(setup.params, lay, flat)
    return Lost(keys, flats, fresh)


def _replay_lost(epoch: Epoch, setup: Setup, mem: Members, dr: Drained, lost: Lost) -> None:
    """4b. The pushes those replicas do not reflect: every survivor kept them (Note [Replaying a dead
    owner's pushes]); the first member replays them on the lost shards, from their saved state (the
    last checkpoint of this epoch, else re-initialized). Fills in ``lost``."""
    members, m, new_rank = mem.members, len(mem.members), mem.members.index(epoch.members[epoch.rank])
    keys, old = lost.keys, epoch.engine
    frames = []
    for i, (b, r) in enumerate(keys):
        ref = lost.fresh[i][1][epoch.rank]
        kept = dr.retain.after((b, r), ref) if dr.retain is not None else []
        want = ref + 1
        for c, f in kept:
            if c != want:
                break
            frames.append((i, c, f))
            want += 1
        lost.pushes_lost += max(0, dr.pushed - want)  # none: every push is kept until reflected
    lost.resent = len(frames)
    everyone = (
        gather_frames(
            frames, group=mem.group, members=members, senders=[epoch.members.index(g) for g in members]
        )
        if m > 1
        else [(i, epoch.rank, f) for i, _, f in frames]
    )
    ckpt = _saved_state(epoch, setup, mem.lost_old) if new_rank == 0 and keys else None
    lost.from_checkpoint = bool(ckpt)
    if new_rank != 0:
        return
    rule = setup.rule
    for i, (b, r) in enumerate(keys):
        sh = epoch.layouts[b].shards[r]
        state = rule.new_state(sh, lost.flats[b][sh.begin : sh.end].clone())
        saved = (ckpt or {}).get(r, {}).get(str(b))
        if saved is not None:
            rule.load_state_tensors(state, saved["optim"], f"checkpoint shard {r} bucket {b}")
        mine_i = [(s_, f) for k, s_, f in everyone if k == i]
        lost.replayed += replay(
            rule=rule,
            policy=old.policy,
            world_size=len(epoch.members),
            state=state,
            version=lost.fresh[i][0],
            reflected=lost.fresh[i][1],
            departed=mem.lost_old,
            frames=mine_i,
            spec=old.spec,
        )
        lost.rebuilt[(b, r)] = state
    if any(not 0 <= k < len(keys) for k, _, _ in everyone):
        raise ValueError("pyasync: a member sent pushes to replay for a shard that was not lost")


def _reshard(epoch: Epoch, setup: Setup, mem: Members, dr: Drained, lost: Lost) -> tuple[list, dict, bool]:
    """5. Re-shard masters and optimizer state onto the members (disjoint parts, summed; each new shard
    cut as a checkpoint's: Note [Re-sharding]). Returns (the new layouts, this rank's new shards,
    whether the first member rebuilt the lost optimizer state from the last checkpoint)."""
    members, group, m = mem.members, mem.group, len(mem.members)
    new_rank = members.index(epoch.members[epoch.rank])
    new_layouts = setup.layouts(m)
    flag = torch.tensor([1 if lost.from_checkpoint else 0], dtype=torch.int64)
    if m > 1:
        dist.broadcast(flag, src=members[0], group=group)
    names = sorted(setup.rule.state_names())
    dev = setup.params[0].device
    shards: dict[int, dict] = {}
    for b, lay in enumerate(epoch.layouts):
        full = {n: torch.zeros(lay.numel, dtype=torch.float32) for n in ["master", *names]}
        offs = [0]
        for sh in lay.shards:
            offs.append(offs[-1] + len(sh.segments))
        steps = torch.zeros(offs[-1], dtype=torch.int64)
        own = lay.shards[epoch.rank]
        if b in dr.snap:
            d = dr.snap[b]
            full["master"][own.begin : own.end] = d["master"].reshape(-1).cpu()
            for n in names:
                if n in d["optim"]:
                    full[n][own.begin : own.end] = d["optim"][n].reshape(-1).cpu()
            steps[offs[epoch.rank] : offs[epoch.rank + 1]] = d["optim"]["steps"].reshape(-1)
        for r in mem.lost_old:  # the lost ranges, rebuilt on the first member (4b)
            st = lost.rebuilt.get((b, r))
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
        per_shard = [steps[offs[r] : offs[r + 1]].tolist() for r in range(len(lay.shards))]
        shards[b] = cut_shard(full, per_shard, lay, new, device=dev)
    return new_layouts, shards, int(flag) == 1


@torch.no_grad()
def change_epoch(epoch: Epoch, setup: Setup) -> tuple[Epoch, EpochChange]:
    """The next membership epoch after ``epoch``, without the ranks its engine saw leave (Note
    [Membership epochs]): its engine started on the re-sharded values. Every survivor calls it; bounded
    by the optimizer's timeout at every wait. ``epoch``'s engine is stopped (its group is the caller's
    to destroy)."""
    t0, started = time.monotonic(), time.time()
    old = epoch.engine
    seen = old.lost_at or started
    me = epoch.members[epoch.rank]
    seen_lost = [epoch.members[r] for r in sorted(old.lost)]
    dr = _drain(old)
    mem = _agree(epoch, setup, seen_lost)
    m, lost = len(mem.members), mem.lost
    new_rank = mem.members.index(me)
    gone = _freshest(epoch, setup, mem, dr)
    _replay_lost(epoch, setup, mem, dr, gone)
    new_layouts, shards, from_checkpoint = _reshard(epoch, setup, mem, dr, gone)
    reinit = []
    if gone.keys and from_checkpoint:
        reinit.append(
            f"optimizer state of the shards of ranks {lost} (from the checkpoint {epoch.last_checkpoint})"
        )
    elif gone.keys:
        reinit.append(f"optimizer state of the shards of ranks {lost} (re-initialized: no checkpoint)")
    if setup.compressor.error_feedback:
        corrected = setup.compressor.momentum is not None  # TopK's velocities too
        setup.compressor.reset()
        reinit.append("error-feedback residuals" + (" and top-k velocities" if corrected else "")
                      + " of every worker (reset)")

    # 6. The new engine.
    policy = epoch.policy
    if isinstance(policy, Quorum) and policy.k > m:
        policy = Quorum(m, late=policy.late)
    nxt = start_epoch(
        setup,
        number=mem.number,
        group=mem.group,
        control=mem.group if m > 1 else None,
        members=mem.members,
        rank=new_rank,
        layouts=new_layouts,
        policy=policy,
        clock0=epoch.clock0 + dr.pushed,
        key=epoch.key,
        transport=setup.transport(mem.group) if m > 1 else None,
    )
    try:
        nxt.engine.shards.load(shards)
    except BaseException as e:
        abandon(nxt, f"its membership change failed ({type(e).__name__}: {e})")
        raise
    change = EpochChange(
        epoch=mem.number,
        lost=lost,
        members=mem.members,
        seconds=time.monotonic() - t0,
        seen_at=seen,
        started_at=started,
        pushes_lost=gone.pushes_lost,
        pushes_resent=gone.resent,
        pushes_replayed=gone.replayed,
        reinitialized=reinit,
    )
    _log.warning(
        "pyasync: membership epoch %d: ranks %s left; %d ranks %s go on (rank %d is now %d of %d); "
        "recovered in %.3f s; %d of this worker's pushes to the lost owners re-sent (%d replayed here), "
        "%d lost; re-initialized: %s",
        mem.number,
        lost,
        m,
        mem.members,
        me,
        new_rank,
        m,
        change.seconds,
        gone.resent,
        gone.replayed,
        gone.pushes_lost,
        "; ".join(reinit) or "nothing",
    )
    return nxt, change
