"""The shards this rank owns under BSP on collectives: their optimizer state and progress, updated by
the training thread inside step() (no applier thread), and handed to ShardAccess (engine/core/access.py)
as its ShardHolder."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pyasync.engine.core.rule import ShardState, UpdateRule
from pyasync.engine.core.shards import BucketLayout

__all__ = ["OwnedShard", "OwnedShards", "Progress"]


@dataclass
class Progress:
    """Versions and clocks of one owned shard (what checkpoints record)."""

    version: int  # updates applied
    processed: list[int]  # per worker rank: pushes processed (every worker's, at every step)


@dataclass
class OwnedShard:
    """One shard this rank owns: its progress and its optimizer state (fp32 master included)."""

    round: Progress
    state: ShardState


class OwnedShards:
    """This rank's shards of every bucket ({bucket: OwnedShard}; buckets with an empty shard of this
    rank are absent). The ShardHolder of ShardAccess: its calls run in the calling thread, which is the
    training thread between steps (there is no applier thread to hand them to)."""

    def __init__(
        self,
        rule: UpdateRule,
        layouts: list[BucketLayout],
        masters: dict[int, torch.Tensor],
        rank: int,
        world_size: int,
    ) -> None:
        self.rule, self.n = rule, world_size
        self.shards: dict[int, OwnedShard] = {
            b: OwnedShard(Progress(0, [0] * world_size), rule.new_state(layouts[b].shards[rank], masters[b]))
            for b in masters
        }

    def call(self, fn: Callable[[OwnedShards], object], timeout: datetime.timedelta) -> list:
        """ShardHolder.call: ``fn(self)`` at once, in this thread (one group of shards: all of them)."""
        return [fn(self)]

    def loaded(self, bucket: int) -> None:
        """Nothing to forget: the replica takes the values the load installs (Gatherer.touched)."""

    def version(self, b: int) -> int:
        """The version of this rank's shard of bucket ``b`` (0 when this rank owns none of it)."""
        own = self.shards.get(b)
        return own.round.version if own is not None else 0

    def versions(self) -> dict[int, int]:
        """{bucket: version} of every owned shard."""
        return {b: own.round.version for b, own in self.shards.items()}

    def apply(self, b: int, values: torch.Tensor, mask: list[bool], applied: int, t: int) -> bool:
        """Step ``t``'s mean gradient ``values`` of shard ``b``, its segments' has-grad ``mask`` and how
        many finite pushes it holds: apply it (when any push and segment counts) with the fused rule;
        every worker's step ``t`` is processed. True when an update was applied."""
        own = self.shards[b]
        done = bool(applied and any(mask))
        if done:
            self.rule.apply(own.state, dense=values, seg_mask=mask)
            own.round.version += 1
        own.round.processed = [t + 1] * self.n
        return done
