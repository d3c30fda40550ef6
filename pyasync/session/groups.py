"""The gloo groups of membership epochs after the first, built on the job's store under a name of pyasync's
own, so that a worker that was not in the job's first process group can be a member.

Note [Groups of later epochs]
    Epoch 0 runs on the user's process group and the optimizer's own group of the same ranks
    (``dist.new_group``). A membership change builds the next epoch's group itself:
    ``ProcessGroupGloo(PrefixStore(f"{job}/epoch{n}/group", store), rank, size, timeout)``, ranked by
    the members' order. ``dist.new_group`` cannot serve there: it numbers ranks in the default group,
    which a worker that joins later (Note [Joining a running job] in session/joining.py) is not part of
    (its own default group has one rank), and its name is a hash of the ranks, so the group of the same
    ranks formed again after a death and a join would meet the first one's stale rendezvous keys in the
    store. A group built so is not registered with torch: ``dist.all_reduce``, ``all_gather``,
    ``broadcast(group_src=...)`` and ``barrier`` take it, while ``get_rank``, ``send``/``recv``,
    ``monitored_barrier`` and ``all_to_all_single`` look it up in torch's registry and refuse it; the
    helpers below call the group's own methods for those, on either kind of group. Nothing destroys such
    a group: it is freed (its gloo threads joined) when the last reference goes, which the epoch records
    drop at every change and at close().
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["all_to_all_single", "barrier", "build", "is_registered", "rank_of", "recv", "send"]


def build(store, prefix: str, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group of ``size`` ranks on ``store`` under ``prefix`` (every member passes the same), this
    process being ``rank``; its collectives wait at most ``timeout``."""
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)


def is_registered(group) -> bool:
    """Whether torch knows ``group`` (epoch 0's groups); later epochs' are not (Note [Groups of later
    epochs])."""
    return group is None or any(g is group for g in dist.distributed_c10d._world.pg_map)


def rank_of(group) -> int:
    """This process's rank in ``group`` (None: the default group)."""
    return dist.get_rank() if group is None else group.rank()


def send(t: torch.Tensor, dst: int, group, tag: int = 0) -> None:
    """Send ``t`` to rank ``dst`` of ``group`` (blocking, bounded by the group's timeout)."""
    group.send([t], dst, tag).wait()


def recv(t: torch.Tensor, src: int, group, tag: int = 0) -> None:
    """Receive into ``t`` from rank ``src`` of ``group`` (blocking, bounded by the group's timeout)."""
    group.recv([t], src, tag).wait()


def barrier(group, timeout: datetime.timedelta) -> None:
    """gloo's monitored barrier on ``group``: it names the ranks that did not arrive within ``timeout``."""
    if is_registered(group):
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    else:
        group.monitored_barrier(timeout, wait_all_ranks=True)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """``dist.all_to_all_single`` with equal splits, on either kind of group."""
    if is_registered(group):
        return dist.all_to_all_single(out, inp, group=group, async_op=async_op)
    work = group.alltoall_base(out, inp, [], [], dist.AllToAllOptions())
    if async_op:
        return work
    work.wait()
    return None
