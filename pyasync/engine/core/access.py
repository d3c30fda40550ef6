"""Access to the shards this rank owns, between steps: snapshots for ``state_dict()`` and checkpoints,
loads, and writing shard values into the local parameters. Every read and write of a shard runs where
its holder says it is safe (``ShardHolder.call``): in the point-to-point engine, in the shard's own
applier thread, between pushes (never torn, never racing an update); in the collective engine, in the
calling thread, between steps.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from pyasync.engine.core.rule import ShardState, UpdateRule
from pyasync.engine.core.shards import BucketLayout
from pyasync.ops import bucketing as ops_bucketing

__all__ = ["HeldShard", "ShardAccess", "ShardGroup", "ShardHolder", "ShardProgress", "bucket_values",
           "initial_masters"]


class ShardProgress(Protocol):
    """How far one owned shard has got (what checkpoints record)."""

    version: int  # updates applied to the shard
    processed: list[int]  # per worker rank: pushes of it the shard has processed


class HeldShard(Protocol):
    """One shard this rank owns, as ShardAccess reads and writes it."""

    @property
    def round(self) -> ShardProgress:
        """Its progress (the point-to-point engine's round machine, engine/core/round.py)."""
        ...

    @property
    def state(self) -> ShardState:
        """Its fp32 master values and optimizer state (engine/core/rule.py)."""
        ...


class ShardGroup(Protocol):
    """Some of the shards this rank owns, handed to a ``ShardHolder.call`` function where they may be
    read and written (the point-to-point engine: one applier thread's shards)."""

    @property
    def shards(self) -> Mapping[int, HeldShard]:
        """{bucket: its shard}."""
        ...

    def loaded(self, bucket: int) -> None:
        """Bucket ``bucket``'s shard was given loaded values (coded replies: the next one is exact)."""
        ...


class ShardHolder(Protocol):
    """What ShardAccess calls on whoever holds this rank's shards: the point-to-point engine's Owner
    (engine/p2p/owner.py), or the collective engine's OwnedShards (engine/collective/owned.py)."""

    def call(self, fn: Callable[[ShardGroup], Any], timeout: datetime.timedelta) -> list:
        """Run ``fn`` on every group of shards where they are safe to touch; its results, one per group
        (at most ``timeout`` each)."""
        ...


def bucket_values(params: list[torch.Tensor], lay: BucketLayout) -> torch.Tensor:
    """The current values of bucket ``lay``'s parameters, as one flat fp32 tensor."""
    flat = torch.empty(lay.numel, dtype=torch.float32, device=params[0].device)
    ops_bucketing.flatten([params[p].detach() for p in lay.params], flat, lay.offsets, numels=lay.numels)
    return flat


def initial_masters(
    params: list[torch.Tensor], layouts: list[BucketLayout], rank: int
) -> dict[int, torch.Tensor]:
    """The fp32 master values of this rank's shards, from the current (agreed, broadcast) parameters."""
    out = {}
    for b, lay in enumerate(layouts):
        sh = lay.shards[rank]
        if sh.numel > 0:
            out[b] = bucket_values(params, lay)[sh.begin : sh.end].clone()
    return out


class ShardAccess:
    """The narrow API of the engine for state (used by DistributedOptimizer and pyasync.checkpoint)."""

    def __init__(
        self,
        owner: ShardHolder,
        rule: UpdateRule,
        layouts: list[BucketLayout],
        params: list[torch.Tensor],
        rank: int,
        timeout: datetime.timedelta,
        require_open: Callable[[str], None],
    ) -> None:
        self.owner, self.rule, self.layouts, self.params = owner, rule, layouts, params
        self.rank, self.timeout, self.require_open = rank, timeout, require_open
        # install_values() gave the parameters these exact values (what this worker holds now).
        self.written: Callable[[dict[tuple[int, int], torch.Tensor]], None] = lambda values: None
        # Coded replies: bucket -> what the workers hold of our shard ([1 or n, numel]; None: unknown),
        # and its restore (bucket, rows, master); run in the shard's applier thread. None: not saved.
        # See Note [Checkpoints and held values] in pyasync/checkpoint/save.py.
        self.held_rows: Callable[[int], torch.Tensor | None] | None = None
        self.restore_rows: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    def snapshot(self) -> dict[int, dict]:
        """This rank's shards: {bucket: {master, version, processed, optim}} (copies), taken in their
        applier threads between pushes."""
        self.require_open("snapshot()")

        def grab(ap: ShardGroup) -> dict:
            out = {
                b: {
                    "master": sh.state.master.clone(),
                    "version": torch.tensor(sh.round.version, dtype=torch.int64),
                    "processed": torch.tensor(sh.round.processed, dtype=torch.int64),
                    "optim": {k: v.clone() for k, v in self.rule.state_tensors(sh.state).items()},
                }
                for b, sh in ap.shards.items()
            }
            for b, d in out.items():
                rows = self.held_rows(b) if self.held_rows is not None else None
                if rows is not None:
                    d["held"] = rows  # what the workers hold of this shard (coded replies)
            return out

        out: dict[int, dict] = {}
        for part in self.owner.call(grab, self.timeout):
            out.update(part)
        return out

    def load(self, shards: dict[int, dict]) -> None:
        """Load {bucket: {master, optim}} into this rank's shards (in their applier threads) and install
        them into the local parameters. Versions and clocks are this engine's own and stay."""
        self.require_open("load()")

        def put(ap: ShardGroup) -> None:
            for b, sh in ap.shards.items():
                d = shards[b]
                where = f"state_dict['shards']['{b}']"
                if d["master"].numel() != sh.state.master.numel():
                    raise ValueError(
                        f"{where}['master'] has {d['master'].numel()} elements, "
                        f"expected {sh.state.master.numel()}"
                    )
                self.rule.load_state_tensors(sh.state, d["optim"], where + "['optim']")
                sh.state.master.copy_(d["master"].reshape(-1))
                ap.loaded(b)  # coded replies: the next one to every worker is exact

        self.owner.call(put, self.timeout)
        self.install_values({(b, self.rank): d["master"] for b, d in shards.items()})

    def restore_held(self, rows: dict[int, torch.Tensor]) -> None:
        """After ``load``: {bucket: what the workers hold of this rank's shard, [1 or n, numel]} (from a
        checkpoint), so the next coded replies start from them instead of an exact reply. The workers'
        side is ``install_values`` of the same values (pyasync.checkpoint). See Note [Checkpoints and
        held values] in pyasync/checkpoint/save.py."""
        self.require_open("restore_held()")
        if self.restore_rows is None:
            return

        def put(ap: ShardGroup) -> None:
            for b, sh in ap.shards.items():
                if b in rows:
                    self.restore_rows(b, rows[b], sh.state.master)

        self.owner.call(put, self.timeout)

    def masters(self) -> dict[int, torch.Tensor]:
        """Copies of the master values of this rank's shards, {bucket: values}."""
        self.require_open("masters()")
        out: dict[int, torch.Tensor] = {}
        for part in self.owner.call(
            lambda ap: {b: sh.state.master.clone() for b, sh in ap.shards.items()}, self.timeout
        ):
            out.update(part)
        return out

    def install_values(self, values: dict[tuple[int, int], torch.Tensor]) -> None:
        """Write {(bucket, owner rank): shard values} into the local parameters (then ``written`` is told
        the exact values: what this worker holds of those shards now)."""
        with torch.no_grad():
            for (b, r), v in values.items():
                lay = self.layouts[b]
                ops_bucketing.unflatten(
                    v.reshape(-1).to(self.params[0].device),
                    [self.params[p].data for p in lay.params],
                    lay.offsets,
                    begin=lay.shards[r].begin,
                )
        self.written(values)
