"""A membership epoch as a record: who trains together, how the buckets are cut among them, and the engine
that runs them; and what stays the same from one epoch to the next (:class:`Setup`).

The DistributedOptimizer holds its current :class:`Epoch`; construction (session/bootstrap.py) builds
epoch 0 and a membership change (session/membership.py, Note [Membership epochs]) takes one Epoch and
returns the next. Nothing here reads another object's private state: what an epoch change needs is a
field of one of the two records.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pyasync.engine import wire
from pyasync.engine.collective.engine import CollectiveEngine
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import BucketLayout, build_layout
from pyasync.engine.p2p.engine import Engine
from pyasync.policy import BSP, Policy
from pyasync.session import groups
from pyasync.transport.base import Transport
from pyasync.transport.tcp import TcpTransport

__all__ = ["Epoch", "Setup", "abandon", "destroy_group", "release_control", "start_epoch", "stop_engine"]

#: What a rank that goes away without close() tells its peers.
LEFT = "it left without close() (its DistributedOptimizer was dropped, or the interpreter exited)"


@dataclass(frozen=True)
class Setup:
    """What a DistributedOptimizer keeps from its construction to its close, whatever the membership."""

    params: list[torch.Tensor]  # the trained parameters, each once, in the engine's order
    names: list[str]  # their names (messages, checkpoint keys)
    groups: list[int]  # each parameter's param_group index
    assign: list[list[int]]  # the buckets: parameter indices per bucket (independent of the world size)
    param_groups: list[dict]  # the wrapped torch optimizer's param_groups (shared, live)
    rule: UpdateRule  # the owners' update rule
    compressor: object  # the pyasync.compression Compressor
    timeout: datetime.timedelta  # the longest any wait may take
    factory: Callable[[dist.ProcessGroup | None, datetime.timedelta], Transport] | None  # None: TCP
    on_nonfinite: str  # "skip" or "raise"
    num_appliers: int  # applier threads per rank (the point-to-point engine)
    max_grad_norm: float | None  # clipping inside the engine (None: none)
    grad_edits: str  # "detect" or "forbid"
    elastic: bool  # survive a dead worker (Note [Membership epochs])
    policy: Policy  # the engine's policy as asked (a later epoch's Quorum(k) is k again once members allow)

    def layouts(self, world: int) -> list[BucketLayout]:
        """The buckets cut into ``world`` shards."""
        return build_layout(self.assign, [p.numel() for p in self.params], self.groups, world)

    def transport(self, group: dist.ProcessGroup | None) -> Transport:
        """A new point-to-point transport over ``group`` (the user's factory, else TCP sockets)."""
        return (self.factory or TcpTransport)(group, self.timeout)


@dataclass
class Epoch:
    """One membership epoch of a DistributedOptimizer (epoch 0: every rank of its process group).

    ``control`` is set to None once the group is destroyed (close(), or an optimizer dropped without
    close(): :func:`abandon`); ``last_checkpoint`` by save_checkpoint. Everything else is fixed for the
    epoch's life: a membership change makes a new Epoch."""

    number: int  # the membership epoch (0 at construction)
    group: dist.ProcessGroup | None  # the ranks that train together (epoch 0: the user's; None: default)
    control: dist.ProcessGroup | None  # the optimizer's own gloo group of the members (None: one rank)
    members: list[int]  # global ranks of the members, in rank order
    rank: int  # this rank among the members
    world: int  # how many members
    layouts: list[BucketLayout]  # the buckets cut into ``world`` shards
    policy: Policy  # the policy of this epoch (Quorum(k) with k above the members: Quorum(world))
    engine: Engine | CollectiveEngine  # this rank's engine of the epoch
    clock0: int  # steps of the earlier epochs (``stats().clock`` counts from the start)
    key: str  # the job's prefix in the store (membership records; "" with one rank at construction)
    last_checkpoint: str | None = None  # directory of the last checkpoint saved in this epoch


def start_epoch(
    setup: Setup,
    *,
    number: int,
    group: dist.ProcessGroup | None,
    control: dist.ProcessGroup | None,
    members: list[int],
    rank: int,
    layouts: list[BucketLayout],
    policy: Policy,
    clock0: int,
    key: str,
    transport: Transport | None,
) -> Epoch:
    """The epoch with this rank's engine for its members, layouts and policy, over ``transport`` (at
    construction, and at every membership change). The engine choice: BSP on collectives
    (CollectiveEngine, Note [BSP on collectives]) or the point-to-point engine for every other policy."""
    world = len(members)
    spec = wire.WireSpec.for_compressor(
        setup.compressor,
        rank,
        world,
        shard_numels=[[s.numel for s in lay.shards] for lay in layouts],
        mask_lens=[[len(s.segments) for s in lay.shards] for lay in layouts],
    )
    common = dict(
        params=setup.params,
        layouts=layouts,
        policy=policy,
        compressor=setup.compressor,
        rule=setup.rule,
        transport=transport,
        rank=rank,
        world_size=world,
        timeout=setup.timeout,
        spec=spec,
        names=setup.names,
        on_nonfinite=setup.on_nonfinite,
        max_grad_norm=setup.max_grad_norm,
        control=control,
        grad_edits=setup.grad_edits,
    )
    if isinstance(policy, BSP) and not policy.p2p:
        engine = CollectiveEngine(**common)  # Note [BSP on collectives]
    else:
        engine = Engine(**common, num_appliers=setup.num_appliers, elastic=setup.elastic)
    return Epoch(
        number=number,
        group=group,
        control=control,
        members=list(members),
        rank=rank,
        world=world,
        layouts=layouts,
        policy=policy,
        engine=engine,
        clock0=clock0,
        key=key,
    )


def destroy_group(group) -> None:
    """Destroy one of the optimizer's gloo groups; a failure is a warning (nothing waits on it). A group of
    a later epoch is not registered with torch: dropping the references frees it (Note [Groups of later
    epochs] in session/groups.py)."""
    if not groups.is_registered(group):
        return
    try:
        dist.destroy_process_group(group)
    except Exception as e:
        warnings.warn(
            f"pyasync: could not destroy the optimizer's gloo group: {e}", RuntimeWarning, stacklevel=3
        )


def stop_engine(engine: Engine | CollectiveEngine, why: str) -> None:
    """Stop the engine's threads, telling the peers ``why`` (nothing when it is closed already)."""
    if not engine.closed:
        engine.closed = True
        engine.capture.remove()
        engine.abort(why)


def release_control(epoch: Epoch) -> None:
    """Destroy the epoch's own group and drop every reference to it (the engine's and the record's), so
    its gloo threads are joined now (See Note [A destroyed group that stays alive] in
    pyasync/teardown.py)."""
    control, epoch.control = epoch.control, None
    if control is None:
        return
    epoch.engine.control = None  # no reference may keep the group's threads and sockets alive
    destroy_group(control)


def abandon(epoch: Epoch, why: str = LEFT) -> None:
    """The optimizer went away (or the interpreter exits) without close(): stop the engine's threads;
    then destroy the epoch's own group ``control`` and drop the references to it (the engine's, and the
    record's, which the optimizer shares if it is still alive, as at exit), so its gloo threads are
    joined now and not left to the interpreter's teardown (See Note [A destroyed group that stays
    alive] in pyasync/teardown.py). A group no longer registered with torch is left alone."""
    stop_engine(epoch.engine, why)
    control = epoch.control
    if control is None:
        return
    if dist.is_available() and groups.is_registered(control):
        release_control(epoch)
    else:
        epoch.control = None
        epoch.engine.control = None
