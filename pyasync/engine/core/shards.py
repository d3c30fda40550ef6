"""Shard layout: each bucket's flat fp32 space cut into n contiguous shards, one per owner rank.

Rank r owns shard r of every bucket: it keeps the fp32 master copy of that range and its optimizer
state. A shard is described by its element range in the bucket and by the *segments* it holds: the
pieces of parameters that overlap it, each with its parameter group, so that per-group hyperparameters
and per-parameter "has a gradient" masks apply to exactly the right elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BucketLayout", "Segment", "ShardLayout", "build_layout", "shard_bounds"]


def shard_bounds(numel: int, world_size: int) -> list[int]:
    """Element boundaries of the n shards of a bucket of ``numel`` elements: shard r is
    [b[r], b[r+1]). Balanced to within one element; shards are empty when numel < n."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    return [(numel * r) // world_size for r in range(world_size + 1)]


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that lies in one shard."""

    param: int  # index of the parameter in the optimizer's flat parameter list
    slot: int  # position of the parameter inside its bucket (index into the push's mask)
    group: int  # index of the parameter's param_group
    begin: int  # first element, relative to the shard start
    end: int  # one past the last element, relative to the shard start
    param_begin: int  # first element inside the parameter


@dataclass
class ShardLayout:
    bucket: int  # bucket index
    rank: int  # owner rank
    begin: int  # first bucket element of the shard
    end: int  # one past the last bucket element
    segments: list[Segment] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.end - self.begin

    @property
    def slots(self) -> list[int]:
        """Bucket slots (parameter positions in the bucket) overlapping the shard, ascending."""
        return [s.slot for s in self.segments]


@dataclass
class BucketLayout:
    index: int  # bucket index
    params: list[int]  # parameter indices in bucket order (gradient order)
    offsets: list[int]  # element offset of each parameter in the flat bucket
    numels: list[int]  # elements of each parameter
    numel: int  # total elements of the bucket
    shards: list[ShardLayout]  # one per rank

    def describe(self) -> str:
        return f"bucket {self.index}: params {self.params} numel {self.numel}"


def build_layout(
    buckets: Sequence[Sequence[int]],
    numels: Sequence[int],
    groups: Sequence[int],
    world_size: int,
) -> list[BucketLayout]:
    """Layouts of all buckets. buckets: parameter indices per bucket (from
    compute_bucket_assignment_by_size); numels: elements per parameter; groups: param_group index per
    parameter."""
    out = []
    for b, idx in enumerate(buckets):
        offsets, off = [], 0
        for p in idx:
            offsets.append(off)
            off += int(numels[p])
        bounds = shard_bounds(off, world_size)
        shards = []
        for r in range(world_size):
            lo, hi = bounds[r], bounds[r + 1]
            segs = []
            for slot, p in enumerate(idx):
                a, z = offsets[slot], offsets[slot] + int(numels[p])
                s, e = max(a, lo), min(z, hi)
                if s < e:
                    segs.append(
                        Segment(
                            param=p,
                            slot=slot,
                            group=int(groups[p]),
                            begin=s - lo,
                            end=e - lo,
                            param_begin=s - a,
                        )
                    )
            shards.append(ShardLayout(bucket=b, rank=r, begin=lo, end=hi, segments=segs))
        out.append(
            BucketLayout(
                index=b,
                params=list(idx),
                offsets=offsets,
                numels=[int(numels[p]) for p in idx],
                numel=off,
                shards=shards,
            )
        )
    return out
