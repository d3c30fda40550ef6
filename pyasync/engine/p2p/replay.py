"""The pushes a dead owner took with it, kept by their senders and replayed on the freshest replica
(elastic membership, pyasync/session/membership.py).

Note [Replaying a dead owner's pushes]
    Every survivor holds a replica of a dead owner's shards: the last values that owner sent it, with
    the clocks they reflect (Note [Reflected clocks] in engine/core/round.py). The freshest replica (the
    newest version; among equal versions, the one reflecting the most pushes) lacks exactly the pushes
    whose clocks it does not reflect. Under ``elastic=True`` each worker therefore keeps a copy of every
    frame it pushes to another owner (:class:`Retention`) until an answer it installed reflects it, and
    at an epoch change sends the ones the freshest replica does not reflect to the member that
    rebuilds the lost shards. That member runs them through a fresh round of the old epoch's policy
    (:func:`replay`), positioned at the replica's version and reflected clocks, in (clock, worker)
    order, and closes every survivor: the actions are the ones the dead owner would have taken, carried
    out with the applier's own code (a push alone under SSP/ASP with its staleness factor, the
    aggregates of BSP and Quorum in rank order, late pushes dropped or folded). The dead worker's own
    unsent pushes are gone with it; no survivor's push is lost or applied twice.

    What a worker keeps: the encoded frames its answers do not reflect yet, at most what the policy
    lets it run ahead (SSP(s): about s+1 steps of pushes; ASP and Quorum: what is in flight, bounded by
    the frame rings and the owners' intake, Note [Bounded intake]), in host memory.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from pyasync.engine import wire
from pyasync.engine.core import round as rnd
from pyasync.engine.core.rule import ShardState, UpdateRule
from pyasync.engine.p2p.applier import OwnedShard, add_to_aggregate, apply_aggregate, apply_push
from pyasync.engine.p2p.messages import Push

__all__ = ["Retention", "replay"]


class Retention:
    """The frames a worker pushed to each remote shard that no answer it installed reflects yet.
    Touched by the push thread only (``keep``), and read after it stopped (``after``)."""

    def __init__(self, reflected: Callable[[tuple[int, int]], int]) -> None:
        self.reflected = reflected  # (bucket, owner) -> the highest own clock installed answers reflect
        self.kept: dict[tuple[int, int], collections.deque] = {}
        self.bytes = 0
        self.peak_bytes = 0

    def keep(self, key: tuple[int, int], clock: int, frame: torch.Tensor) -> None:
        """Keep a copy of ``frame`` (header and body, as sent) of the push of ``clock`` to ``key``;
        forget those an installed answer reflects."""
        kept = self.kept.setdefault(key, collections.deque())
        done = self.reflected(key)
        while kept and kept[0][0] <= done:
            self.bytes -= kept.popleft()[1].numel()
        kept.append((clock, frame.to("cpu", copy=True)))
        self.bytes += frame.numel()
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def after(self, key: tuple[int, int], clock: int) -> list[tuple[int, torch.Tensor]]:
        """The kept (clock, frame) of ``key`` with a clock above ``clock``, oldest first."""
        return [(c, f) for c, f in self.kept.get(key, ()) if c > clock]


def replay(
    *,
    rule: UpdateRule,
    policy,
    world_size: int,
    state: ShardState,
    version: int,
    reflected: list[int],
    departed: list[int],
    frames: list[tuple[int, torch.Tensor]],
    spec: wire.WireSpec,
) -> int:
    """Apply the pushes in ``frames`` ((sender, frame) of the old epoch) to ``state`` (a shard of the
    old layout, at ``version``, reflecting ``reflected`` clocks) as its dead owner would have; returns
    the pushes replayed. Frames are validated as the owner's receiver validates them."""
    shard = state.layout
    rnd_ = policy.round(world_size, len(shard.segments), shard.bucket)
    rnd_.version = version
    rnd_.processed = [c + 1 for c in reflected]
    sh = OwnedShard(rnd_, state)
    divisor = policy.divisor(world_size)
    pushes = []
    for src, frame in frames:
        h = wire.frame_header(frame, src)
        spec.check_push(h, shard.rank)
        if h.bucket != shard.bucket:
            raise wire.WireError(
                f"a replayed push of rank {src} is for bucket {h.bucket}, not {shard.bucket}"
            )
        payload, mask = wire.unpack_push(wire.frame_body(frame, h), h)
        mask_t = tuple(bool(m) for m in mask.tolist())
        pushes.append(Push(h.bucket, src, h.clock, h.version, payload, mask_t))
    pushes.sort(key=lambda p: (p.clock, p.worker))

    def do(actions: list) -> None:
        for a in actions:
            if isinstance(a, rnd.Apply):
                apply_push(rule, sh, a.item, world_size, a.lr_factor, a.implicit, a.per_round)
            elif isinstance(a, rnd.Sum):
                add_to_aggregate(sh, a.item, divisor)
            elif isinstance(a, rnd.Update):
                apply_aggregate(rule, sh, a.mask, a.scale)
            elif not isinstance(a, (rnd.Release, rnd.Answer)):
                raise TypeError(f"replaying pushes: unexpected round action {a!r}")

    for w in departed:
        do(rnd_.depart(w))
    for p in pushes:
        do(rnd_.push(p.worker, p.clock, p.version, p.payload.finite, p.mask, p))
    for w in range(world_size):
        if not rnd_.closed[w]:
            do(rnd_.close(w))
    return len(pushes)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def gather_frames(
    frames: list[tuple[int, int, torch.Tensor]], *, group, members: list[int], senders: list[int]
) -> list[tuple[int, int, torch.Tensor]]:
    """Send this member's ``frames`` ((key index, clock, frame)) to the first member of ``group``
    (global ranks ``members``, whose old ranks are ``senders``); there, every member's frames as (key
    index, sender, frame). Tensors only (nothing is unpickled): a count per member, then each member's
    index rows and bytes, point to point."""
    import torch.distributed as dist

    from pyasync.session import groups

    rows = torch.tensor([[k, f.numel()] for k, _, f in frames] or [[0, 0]], dtype=torch.int64)
    blob = torch.zeros(sum(_pad8(f.numel()) for _, _, f in frames) or 8, dtype=torch.uint8)
    off = 0
    for _, _, f in frames:
        blob[off : off + f.numel()] = f
        off += _pad8(f.numel())
    me = groups.rank_of(group)
    counts = [torch.zeros(2, dtype=torch.int64) for _ in members]
    dist.all_gather(counts, torch.tensor([len(frames), blob.numel()], dtype=torch.int64), group=group)
    if me != 0:
        if frames:
            groups.send(rows, 0, group)
            groups.send(blob, 0, group)
        return []
    out = [(k, senders[0], f) for k, _, f in frames]
    for i, (g, s, (n, nbytes)) in enumerate(zip(members[1:], senders[1:], counts[1:]), start=1):
        n, nbytes = int(n), int(nbytes)
        if n == 0:
            continue
        their_rows = torch.empty(n, 2, dtype=torch.int64)
        their_blob = torch.empty(nbytes, dtype=torch.uint8)
        groups.recv(their_rows, i, group)
        groups.recv(their_blob, i, group)
        off = 0
        for k, length in their_rows.tolist():
            if length < wire.HEADER_BYTES or off + length > nbytes:
                raise wire.WireError(f"rank {g} sent a malformed list of pushes to replay")
            out.append((k, s, their_blob[off : off + length].clone()))
            off += _pad8(length)
    return out
