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
    3. **A fresh group.** gloo groups cannot shrink: a new gloo group of the members is built on a
       ``PrefixStore`` of the job's store named after the epoch (only the members take part; Note
       [Groups of later epochs] in session/groups.py) and a new TCP transport over it. The store must
       outlive every worker: under torchrun the agent hosts it; a store hosted by rank 0's process
       dies with rank 0. The members of an epoch may include workers that join (Note [Joining a
       running job] in session/joining.py): they take part in every step below with nothing of the
       old epoch, and receive their replica from the old owners (step 4c).
    4. **The lost shards' values** come from the freshest replica among the survivors: the one that
       installed the newest version of that shard (among equal versions, the one reflecting the most
       pushes; then the lowest rank) broadcasts it, with the clocks it reflects. Every survivor kept
       its pushes to the dead owner that no answer it installed reflects; those the freshest replica
       does not reflect go to the first member, which replays them on it as the dead owner would have
       (Note [Replaying a dead owner's pushes] in engine/p2p/replay.py): no survivor's push is lost
       (``stats().pushes_resent``; ``pushes_lost`` counts any that could not be replayed: none).
    5. **Re-split.** The buckets are cut into m shards for the m members (the checkpoints' re-sharding,
       Note [Re-sharding]); master values and optimizer state move to their new owners exactly, point
       to point, only the parts that change owner (Note [Re-splitting onto the members]). The lost
       shards' optimizer state (momentum, Adam moments, step counts) comes from the last checkpoint
       saved in this epoch, else it is re-initialized (reported: log line, ``stats().epochs``). Each
       member keeps its own error-feedback residuals (and top-k velocities): what it still owes is
       joined per bucket, cut at the new shard bounds and scaled by divisor(m) / divisor(n), so the
       update it owes is unchanged (the checkpoints' rule for m == n workers, Note [Re-sharding
       residuals]); a lost worker's residuals, like its unapplied pushes, are lost with it, and a
       joiner starts from zero, owing nothing.
    6. **Go on.** A new engine over the members starts from these values, and the members meet once
       more (a barrier) before any of them pushes: a push that reached an owner before its shards were
       loaded would be overwritten by the load (members end a change up to 0.2 s apart when one
       joins). Means divide by m (SSP/ASP scale by 1/m; Quorum(k) with k > m waits for all m). Clocks
       restart at 0 in the new epoch (``stats().clock`` keeps counting).

    BSP on collectives does not recover: a dead rank makes every survivor raise PeerFailure naming it,
    bounded by the timeout (resume from the last checkpoint). Use ``bsp:p2p`` for a BSP that survives.

Note [Re-splitting onto the members]
    Old shard r of a bucket is held, once drained, by its owner (or, when r was lost, by the first
    member, which rebuilt it in step 4b); new shard j goes to member j. For every pair whose ranges
    overlap, the holder sends the overlap to member j (masters and every optimizer state tensor in
    one message, point to point, all pairs at once) unless it is member j; the step counts per old
    segment (a few integers per bucket) are summed over the members. Only what changes owner moves:
    from m to m + 1 owners about half the state, and no member sends more than 1/(m + 1) of it nor
    receives more than its new shard, so the re-split's critical path shrinks as members are added
    (an all-reduce of the whole state, as before, made every member send about twice the state
    whatever m). A joiner holds nothing of the old layout: it receives its new shard's parts from
    the one or two old owners whose ranges overlap it, and its replica from every old owner (4c).
    ``stats().epochs[i]["bytes_sent"]`` and ``["bytes_received"]`` count what moved.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pyasync.checkpoint.reshard import recut_slots, segment_steps
from pyasync.checkpoint.validate import read_manifest, read_shard
from pyasync.engine.core.access import bucket_values
from pyasync.engine.p2p.replay import gather_frames, replay
from pyasync.errors import PeerFailure
from pyasync.ops import bucketing as ops_bucketing
from pyasync.policy import Quorum
from pyasync.session import groups, joining, meet
from pyasync.session.epoch import Epoch, Setup, abandon, start_epoch
from pyasync.session.joining import GONE, GRACE_S, Requests
from pyasync.session.meet import agree_members, meet_members

__all__ = ["EpochChange", "change_epoch", "join_epoch"]

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
    joined: list[int] = field(default_factory=list)  # global ids of workers that joined (Note [Joining a
    # running job] in session/joining.py)
    bytes_sent: int = 0  # state this rank sent point to point (a joiner's replica, the re-split)
    bytes_received: int = 0  # and received (the lost shards' broadcasts are not counted)
    cpu_seconds: float = 0.0  # this process's CPU time in the change (every thread): on dedicated
    # machines, about its ``seconds`` less the waits; on a shared one, what it competed for

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
    group: dist.ProcessGroup  # the members' new gloo group (Note [Groups of later epochs])
    lost: list[int]  # global ranks of the old epoch that are not members
    lost_old: list[int]  # the same, as ranks of the old epoch
    me: int  # this rank's global id
    key: str  # the job's prefix in the store
    joined: list[int] = field(default_factory=list)  # members new to the job (joiners)
    sent: int = 0  # state bytes this rank sent point to point in the change (replica, re-split)
    received: int = 0  # and received


@dataclass
class Past:
    """The epoch a change starts from, as the change reads it: a member's own, or (for a joiner, which
    was not in it: ``rank`` None, no engine) its members and layouts."""

    members: list[int]  # its global ranks
    rank: int | None  # this rank in it (None: a joiner)
    layouts: list  # its buckets cut into len(members) shards
    engine: Any = None  # its engine (a member's)
    last_checkpoint: str | None = None

    @property
    def world(self) -> int:
        return len(self.members)

    @staticmethod
    def of(epoch: Epoch) -> Past:
        return Past(epoch.members, epoch.rank, epoch.layouts, epoch.engine, epoch.last_checkpoint)


@dataclass
class Lost:
    """The lost shards (step 4 and 4b): their keys, values and what was rebuilt of them."""

    keys: list[tuple[int, int]]  # (bucket, old rank) of every non-empty lost shard
    flats: dict[int, torch.Tensor]  # the values of every bucket with a lost shard, those from the freshest
    fresh: list[tuple[int, list[int]]]  # per key: (version, reflected clocks) of the freshest replica
    rebuilt: dict[tuple[int, int], Any] = field(default_factory=dict)  # first member: ShardState per key
    from_checkpoint: bool = False  # the rebuilt optimizer state came from the last checkpoint
    resent: int = 0  # this worker's pushes to the lost owners sent for replay
    replayed: int = 0  # pushes replayed here (the first member)
    pushes_lost: int = 0  # this worker's pushes that could not be replayed (none: all are kept)


def _saved_state(epoch: Past, setup: Setup, ranks: list[int]) -> dict | None:
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


def _agree(
    epoch: Epoch, setup: Setup, lost: list[int], requests: Requests | None, after: int | None = None
) -> Members:
    """2. Agree on the members (the survivors and the waiting joiners), and meet them in the store (a
    member that dies meanwhile: again without it). 3. A fresh group of the members (through the store
    too: Note [Groups of later epochs]). ``after``: the epoch number tried last (a change that failed)."""
    old, old_globals, timeout = epoch.engine, epoch.members, setup.timeout
    me = old_globals[epoch.rank]
    st = meet.store()
    if st is None:
        raise PeerFailure("pyasync: elastic membership needs the job's store (torch.distributed's)", lost)
    tp_old = old.transport
    gone = set(lost)
    number = epoch.number if after is None else after
    meet.bound_store(st, timeout)  # Note [A bounded store] in session/meet.py
    try:
        while True:
            number += 1
            survivors = [g for g in old_globals if g not in gone]
            waiting = [j for j in requests.waiting(old_globals) if j not in gone] if requests else []
            members = agree_members(
                st, f"{epoch.key}/epoch{number}", survivors + waiting, old_globals, timeout
            )
            st.set(f"{epoch.key}/epoch{number}/base", str(epoch.number))  # what a joiner starts from
            if me not in members:
                raise PeerFailure(
                    f"pyasync: rank {me} was dropped from the job in membership epoch {number} (the others "
                    "saw it leave or stall); it cannot rejoin this job: restart it, or resume from a "
                    "checkpoint",
                    [me],
                )
            died = meet_members(
                st, f"{epoch.key}/epoch{number}/here", members, me, tp_old, old_globals, timeout, GRACE_S
            )
            if not died:
                break
            if requests is not None:
                requests.mark([g for g in died if g not in old_globals], GONE)
            gone |= set(died)
        lost = [g for g in old_globals if g not in members]
        joined = [g for g in members if g not in old_globals]
        group = groups.build(st, f"{epoch.key}/epoch{number}/group", members.index(me), len(members), timeout)
    except Exception as e:  # the store failed: name its host, and say where it must live
        err = meet.store_failure(e, f"the change to membership epoch {number}", epoch.group, timeout)
        if err is None:
            raise
        old.record_failure(err)
        raise err from e
    return Members(number, members, group, lost, [old_globals.index(g) for g in lost], me, epoch.key, joined)


def _freshest(epoch: Past, setup: Setup, mem: Members, dr: Drained) -> Lost:
    """4. The lost shards' values: the freshest replica among the survivors (the newest version; among
    equal versions, the one reflecting the most pushes), and the clocks it reflects."""
    group, m = mem.group, len(mem.members)
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
    flats = {b: bucket_values(setup.params, epoch.layouts[b]) for b in sorted({b for b, _ in keys})}
    fresh: list[tuple[int, list[int]]] = []  # per key: (version, reflected clocks) of the freshest replica
    for i, (b, r) in enumerate(keys):
        col = [(int(t[2 * i]), int(t[2 * i + 1])) for t in table]
        src = col.index(max(col))
        sh = epoch.layouts[b].shards[r]
        part = flats[b][sh.begin : sh.end].clone()
        inc = torch.tensor(dr.clocks.get((b, r), [-1] * n_old), dtype=torch.int64)
        if m > 1:
            dist.broadcast(part, group_src=src, group=group)
            dist.broadcast(inc, group_src=src, group=group)
        flats[b][sh.begin : sh.end] = part
        fresh.append((col[src][0], inc.tolist()))
    for b, flat in flats.items():
        _unflat(setup.params, epoch.layouts[b], flat)
    return Lost(keys, flats, fresh)


def _replay_lost(epoch: Past, setup: Setup, mem: Members, dr: Drained, lost: Lost) -> None:
    """4b. The pushes those replicas do not reflect: every survivor kept them (Note [Replaying a dead
    owner's pushes]); the first member replays them on the lost shards, from their saved state (the
    last checkpoint of this epoch, else re-initialized). Fills in ``lost``."""
    members, m, new_rank = mem.members, len(mem.members), mem.members.index(mem.me)
    keys, old = lost.keys, epoch.engine
    frames = []
    for i, (b, r) in enumerate(keys if epoch.rank is not None else []):  # a joiner pushed nothing
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
            frames,
            group=mem.group,
            members=members,
            senders=[epoch.members.index(g) if g in epoch.members else -1 for g in members],
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


def _holder(epoch: Past, mem: Members, r: int) -> int:
    """The member (new rank) holding old shard ``r``'s masters and optimizer state once drained: its
    owner, or for a lost shard the first member, which rebuilt it (4b)."""
    return 0 if r in mem.lost_old else mem.members.index(epoch.members[r])


def _old_state(dr: Drained, lost: Lost, b: int, r: int, names: list[str]) -> tuple[list, list[int]]:
    """Old shard ``r`` of bucket ``b`` as its holder keeps it: ([master, *state tensors] (None where the
    rule allocated none), the step count per segment)."""
    st = lost.rebuilt.get((b, r))
    if st is not None:
        return [st.master, *(getattr(st, n) for n in names)], list(st.steps)
    d = dr.snap[b]
    return [d["master"], *(d["optim"].get(n) for n in names)], d["optim"]["steps"].reshape(-1).tolist()


def _reshard(epoch: Past, setup: Setup, mem: Members, dr: Drained, lost: Lost) -> tuple[list, dict, bool]:
    """5. Re-split masters and optimizer state onto the members (Note [Re-splitting onto the members]).
    Returns (the new layouts, this rank's new shards, whether the first member rebuilt the lost
    optimizer state from the last checkpoint)."""
    members, group, m = mem.members, mem.group, len(mem.members)
    me = members.index(mem.me)
    new_layouts = setup.layouts(m)
    flag = torch.tensor([1 if lost.from_checkpoint else 0], dtype=torch.int64)
    names = sorted(setup.rule.state_names())
    # The step counts per old segment (a few per bucket): each holder writes its own, summed.
    offs = [0]
    for lay in epoch.layouts:
        for sh in lay.shards:
            offs.append(offs[-1] + len(sh.segments))
    per = len(epoch.layouts[0].shards) if epoch.layouts else 0
    steps = torch.zeros(offs[-1], dtype=torch.int64)
    for b, lay in enumerate(epoch.layouts):
        for r, sh in enumerate(lay.shards):
            if sh.segments and _holder(epoch, mem, r) == me:
                steps[offs[b * per + r] : offs[b * per + r + 1]] = torch.tensor(
                    _old_state(dr, lost, b, r, names)[1], dtype=torch.int64
                )
    if m > 1:
        dist.broadcast(flag, group_src=0, group=group)
        dist.all_reduce(steps, group=group)
    dev = setup.params[0].device
    works, keep, into = [], [], []  # keep: what is being sent, alive until sent
    mine: dict[int, torch.Tensor] = {}  # bucket -> [1 + len(names), numel] of this rank's new shard
    for b, lay in enumerate(epoch.layouts):
        new = new_layouts[b].shards
        if new[me].numel:
            mine[b] = torch.zeros(1 + len(names), new[me].numel, dtype=torch.float32)
        for r, sh in enumerate(lay.shards):
            src, tag = _holder(epoch, mem, r), (1 << 24) + b * epoch.world + r
            for j, nsh in enumerate(new):
                lo, hi = max(sh.begin, nsh.begin), min(sh.end, nsh.end)
                if lo >= hi or me not in (src, j):
                    continue
                if src == me:
                    parts = _old_state(dr, lost, b, r, names)[0]
                    piece = torch.zeros(1 + len(names), hi - lo, dtype=torch.float32)
                    for i, t in enumerate(parts):
                        if t is not None:
                            piece[i] = t.reshape(-1)[lo - sh.begin : hi - sh.begin].cpu()
                    if j == me:
                        mine[b][:, lo - nsh.begin : hi - nsh.begin] = piece
                    else:
                        works.append(group.send([piece], j, tag))
                        keep.append(piece)
                        mem.sent += piece.numel() * 4
                else:
                    piece = torch.empty(1 + len(names), hi - lo, dtype=torch.float32)
                    works.append(group.recv([piece], src, tag))
                    into.append((b, lo - nsh.begin, piece))
                    mem.received += piece.numel() * 4
    for w in works:
        w.wait()
    for b, at, piece in into:
        mine[b][:, at : at + piece.shape[1]] = piece
    shards: dict[int, dict] = {}
    for b, full in mine.items():
        lay = epoch.layouts[b]
        per_shard = [steps[offs[b * per + r] : offs[b * per + r + 1]].tolist() for r in range(per)]
        optim = {n: full[1 + i].to(dev) for i, n in enumerate(names)}
        optim["steps"] = torch.tensor(
            segment_steps(per_shard, lay, new_layouts[b].shards[me]), dtype=torch.int64
        )
        shards[b] = {"master": full[0].to(dev), "optim": optim}
    return new_layouts, shards, int(flag) == 1


def _values(params: list[torch.Tensor], lay, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of bucket ``lay``'s current values, as one flat fp32 tensor (only those read)."""
    out = torch.empty(hi - lo, dtype=torch.float32)
    for p, off in zip(lay.params, lay.offsets):
        v = params[p].detach().reshape(-1)
        a, b = max(lo, off), min(hi, off + v.numel())
        if a < b:
            out[a - lo : b - lo] = v[a - off : b - off].cpu()
    return out


def _give_replica(epoch: Past, setup: Setup, mem: Members) -> None:
    """4c. The joiners' replica: every old owner that is still a member sends its own shards' values (all
    survivors hold them equal once drained) to every joiner, point to point, all at once; the lost shards'
    values came with step 4."""
    members, group = mem.members, mem.group
    new_rank = members.index(mem.me)
    joiners = [members.index(j) for j in mem.joined]
    works, into = [], []
    for b, lay in enumerate(epoch.layouts):
        for r, sh in enumerate(lay.shards):
            if sh.numel == 0 or r in mem.lost_old:
                continue
            donor = members.index(epoch.members[r])
            tag = b * epoch.world + r
            if new_rank == donor:
                part = _values(setup.params, lay, sh.begin, sh.end)
                works += [group.send([part], j, tag) for j in joiners]
                into.append(part)  # kept alive until sent
                mem.sent += part.numel() * part.element_size() * len(joiners)
            elif new_rank in joiners:
                part = torch.empty(sh.numel, dtype=torch.float32)
                works.append(group.recv([part], donor, tag))
                into.append((lay, sh, part))
                mem.received += part.numel() * part.element_size()
    for w in works:
        w.wait()
    dev = setup.params[0].device
    with torch.no_grad():
        for item in into:
            if isinstance(item, tuple):
                lay, sh, part = item
                tensors = [setup.params[p].data for p in lay.params]
                ops_bucketing.unflatten(part.to(dev), tensors, lay.offsets, begin=sh.begin)


def _check_replicas(setup: Setup, layouts: list, mem: Members) -> None:
    """After a join: every member's replica must checksum the same, bucket by bucket (CRC-32 of its bytes:
    the joiner's transfer is checked end to end); a difference is an error naming the members and the
    buckets that differ."""
    mine = torch.tensor(
        [zlib.crc32(bucket_values(setup.params, lay).cpu().contiguous().numpy().data) for lay in layouts],
        dtype=torch.int64,
    )
    table = [torch.zeros_like(mine) for _ in mem.members]
    dist.all_gather(table, mine, group=mem.group)
    odd = {g: (t != table[0]).nonzero().reshape(-1).tolist() for g, t in zip(mem.members, table)}
    odd = {g: bs for g, bs in odd.items() if bs}
    if odd:
        raise RuntimeError(
            f"pyasync: after the join of {mem.joined}, the replicas of members {sorted(odd)} differ from "
            f"member {mem.members[0]}'s (buckets {sorted({b for bs in odd.values() for b in bs})}): the "
            "state transfer was corrupted; restart the joiner"
        )


def _who_died(mem: Members, tp_old, old_globals: list[int], timeout, err: BaseException) -> list[int]:
    """A change whose collectives failed: the members meet once more in the store; those that do not come
    (dead; a joiner after GRACE_S) are returned, and the caller starts the change again without them.
    Raises ``err`` when every member came (the failure was not a death)."""
    st = meet.store()
    prefix = f"{mem.key}/epoch{mem.number}/broken"
    try:
        died = meet_members(st, prefix, mem.members, mem.me, tp_old, old_globals, timeout, GRACE_S)
    except PeerFailure as e:
        raise e from err
    if not died:
        raise err
    _log.warning(
        "pyasync: membership epoch %d failed while its state moved (%s: %s); members %s are gone, the "
        "change starts again without them",
        mem.number,
        type(err).__name__,
        err,
        died,
    )
    return died


def _every_member_came(st, key: str, n: int, members: list[int], timeout) -> bool:
    """A joiner whose change failed: True when every member came to the members' meeting of _who_died
    (nobody died: the failure is an error, and theirs too), False when they started epoch n + 1 without
    someone (or nothing was decided within ``timeout``)."""
    keys, nxt = [f"{key}/epoch{n}/broken/{g}" for g in members], f"{key}/epoch{n + 1}"
    end = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < end:
        if st.check(keys):
            return True
        if st.check([nxt]):
            return False
        with contextlib.suppress(Exception):  # a bounded wait, then look again
            st.wait(keys, datetime.timedelta(seconds=0.1))
    return False


def _rebuild(epoch: Past, setup: Setup, mem: Members, dr: Drained) -> tuple[Lost, list, dict, list[str]]:
    """Steps 4-5 on every member, joiners included (the same collectives in the same order): the lost
    shards, their replayed pushes, the joiners' replica, the re-shard. Returns (the lost shards, the new
    layouts, this rank's new shards, what was re-initialized)."""
    gone = _freshest(epoch, setup, mem, dr)
    _replay_lost(epoch, setup, mem, dr, gone)
    if mem.joined:
        _give_replica(epoch, setup, mem)
        _check_replicas(setup, epoch.layouts, mem)
    new_layouts, shards, from_checkpoint = _reshard(epoch, setup, mem, dr, gone)
    reinit = []
    if gone.keys and from_checkpoint:
        reinit.append(
            f"optimizer state of the shards of ranks {mem.lost} (from the checkpoint {epoch.last_checkpoint})"
        )
    elif gone.keys:
        reinit.append(f"optimizer state of the shards of ranks {mem.lost} (re-initialized: no checkpoint)")
    return gone, new_layouts, shards, reinit


def _recut_feedback(setup: Setup, epoch: Epoch, mem: Members, new_layouts: list) -> list[str]:
    """Step 5 on this worker's own compression state, once the change succeeded (a change that failed
    and runs again starts from the old layout): its error-feedback residuals (and top-k velocities)
    are cut at the new shard bounds and scaled by divisor(m) / divisor(n) (Note [Membership epochs]).
    Returns what was lost of them."""
    comp = setup.compressor
    if not comp.error_feedback:
        return []
    scale = (setup.policy.divisor(len(mem.members)), setup.policy.divisor(len(epoch.members)))
    # TopK's momentum correction (Note [Momentum correction for top-k]) keeps velocities too
    velocities = comp.momentum is not None
    res, bad = recut_slots([comp.state_dict()], epoch.layouts, new_layouts, scale)
    vel, bad_v = {}, []
    if velocities:
        vel, bad_v = recut_slots([comp.velocity_state_dict()], epoch.layouts, new_layouts, scale)
    comp.load_state_dict(res)  # both re-cut before either is loaded: a failure leaves the old state whole
    if velocities:
        comp.load_velocity_state_dict(vel)
    what = " and top-k velocities" if velocities else ""
    out = [f"error-feedback residuals{what} of ranks {mem.lost} (lost with them)"] if mem.lost else []
    if bad or bad_v:
        out.append(f"this worker's error-feedback state of buckets {sorted(set(bad + bad_v))} (overflowed)")
    return out


def _start(setup: Setup, mem: Members, layouts: list, shards: dict, clock0: int, key: str) -> Epoch:
    """6. The new engine over the members, from the re-sharded values. Quorum(k) asks the k the user gave
    (at most the members)."""
    m = len(mem.members)
    policy = setup.policy
    if isinstance(policy, Quorum) and policy.k > m:
        policy = Quorum(m, late=policy.late)
    nxt = start_epoch(
        setup,
        number=mem.number,
        group=mem.group,
        control=mem.group if m > 1 else None,
        members=mem.members,
        rank=mem.members.index(mem.me),
        layouts=layouts,
        policy=policy,
        clock0=clock0,
        key=key,
        transport=setup.transport(mem.group) if m > 1 else None,
    )
    try:
        nxt.engine.shards.load(shards)
        if m > 1:  # no member pushes before every owner has loaded: a push applied before the load is lost
            groups.barrier(mem.group, setup.timeout)
    except BaseException as e:
        abandon(nxt, f"its membership change failed ({type(e).__name__}: {e})")
        raise
    return nxt


@torch.no_grad()
def change_epoch(epoch: Epoch, setup: Setup, requests: Requests | None = None) -> tuple[Epoch, EpochChange]:
    """The next membership epoch after ``epoch``, without the ranks its engine saw leave and with the
    joiners whose requests wait in ``requests`` (Note [Membership epochs], Note [Joining a running job]):
    its engine started on the re-sharded values. Every member calls it; bounded by the optimizer's timeout
    at every wait. ``epoch``'s engine is stopped (its group is the caller's to destroy)."""
    t0, started, c0 = time.monotonic(), time.time(), time.process_time()
    old = epoch.engine
    seen = old.lost_at or started
    me = epoch.members[epoch.rank]
    seen_lost = [epoch.members[r] for r in sorted(old.lost)]
    dr = _drain(old)
    tp_old, gone_now, after = old.transport, list(seen_lost), None
    try:  # the old connections stay open until the change is done: they tell who dies meanwhile
        while True:
            mem = _agree(epoch, setup, gone_now, requests, after)
            try:
                gone, new_layouts, shards, reinit = _rebuild(Past.of(epoch), setup, mem, dr)
                nxt = _start(setup, mem, new_layouts, shards, epoch.clock0 + dr.pushed, epoch.key)
                break
            except Exception as e:  # a member died inside the change's collectives: again without it
                died = _who_died(mem, tp_old, epoch.members, setup.timeout, e)
                if requests is not None:
                    requests.mark([g for g in died if g not in epoch.members], GONE)
                gone_now += [g for g in died if g in epoch.members]
                after = mem.number
    finally:
        if tp_old is not None:
            tp_old.close()
    reinit += _recut_feedback(setup, epoch, mem, new_layouts)
    m, lost = len(mem.members), mem.lost
    new_rank = mem.members.index(me)
    change = EpochChange(
        epoch=mem.number,
        lost=lost,
        members=mem.members,
        seconds=time.monotonic() - t0,
        cpu_seconds=time.process_time() - c0,
        seen_at=seen,
        started_at=started,
        pushes_lost=gone.pushes_lost,
        pushes_resent=gone.resent,
        pushes_replayed=gone.replayed,
        reinitialized=reinit,
        joined=mem.joined,
        bytes_sent=mem.sent,
        bytes_received=mem.received,
    )
    _log.warning(
        "pyasync: membership epoch %d: ranks %s left, %s joined; %d ranks %s go on (rank %d is now %d of "
        "%d); changed in %.3f s; %d of this worker's pushes to the lost owners re-sent (%d replayed here), "
        "%d lost; re-initialized: %s",
        mem.number,
        lost,
        mem.joined,
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


@torch.no_grad()
def join_epoch(setup: Setup, items: dict[str, list[str]]) -> tuple[Epoch, EpochChange]:
    """A new worker joins the running elastic job on this process's store (Note [Joining a running
    job]): refused when it does not belong, else admitted at the members' next epoch change, with its
    replica, its shards' masters and optimizer state; returns its first epoch (its engine running)."""
    t0, started, c0 = time.monotonic(), time.time(), time.process_time()
    timeout = setup.timeout
    st = meet.store()
    if st is None:
        raise PeerFailure("pyasync: joining a job needs torch.distributed initialised on the job's store", [])
    meet.bound_store(st, timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    key = joining.find_job(st, timeout.total_seconds())
    joining.check_belongs(st, key, items)
    me = joining.ask(st, key)
    n, dr = 1, Drained({}, {}, {}, 0, None)
    while True:
        n, members, before = joining.admitted(st, key, me, deadline, n)
        died = meet_members(st, f"{key}/epoch{n}/here", members, me, None, before, timeout, GRACE_S)
        if died:
            n += 1  # a member died while the others met: the next record, without it
            continue
        group = groups.build(st, f"{key}/epoch{n}/group", members.index(me), len(members), timeout)
        lost = [g for g in before if g not in members]
        joined = [g for g in members if g not in before]
        mem = Members(n, members, group, lost, [before.index(g) for g in lost], me, key, joined)
        past = Past(before, None, setup.layouts(len(before)))
        try:
            _, new_layouts, shards, reinit = _rebuild(past, setup, mem, dr)
            nxt = _start(setup, mem, new_layouts, shards, 0, key)
            break
        except Exception as e:  # a member died while the state moved: the members start again without
            st.set(f"{key}/epoch{n}/broken/{me}", "ok")  # it, and this joiner's mark tells them it lives
            if _every_member_came(st, key, n, members, timeout):
                raise  # not a death: the members fail with the same error (_who_died)
            _log.warning(
                "pyasync: joining epoch %d failed (%s: %s); waiting for the next", n, type(e).__name__, e
            )
            n += 1
    st.set(f"{key}/joiner/{me}", joining.MEMBER)
    change = EpochChange(
        epoch=n,
        lost=lost,
        members=members,
        seconds=time.monotonic() - t0,
        cpu_seconds=time.process_time() - c0,
        seen_at=started,
        started_at=started,
        pushes_lost=0,
        reinitialized=reinit,
        joined=mem.joined,
        bytes_sent=mem.sent,
        bytes_received=mem.received,
    )
    _log.warning(
        "pyasync: worker %d joined the job in membership epoch %d as rank %d of %d in %.3f s",
        me,
        n,
        mem.members.index(me),
        len(members),
        change.seconds,
    )
    return nxt, change
