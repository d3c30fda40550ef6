"""The startup handshake of a DistributedOptimizer: meet the other ranks (bounded, naming who is missing),
build the optimizer's own gloo group and transport, agree on the job, broadcast rank 0's parameters, and
meet once more, failed or not (Note [Failing together at construction] in session/meet.py). Then
epoch 0 starts (session/epoch.py).

Collectives run in the training thread, before any engine thread starts.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

from pyasync._construct import check_elastic_transport, describe_group
from pyasync.engine.core.shards import BucketLayout
from pyasync.policy import Policy
from pyasync.session.agree import AgreementError, check_agreement
from pyasync.session.epoch import Setup, destroy_group
from pyasync.session.meet import collective_failure, control_group, gave_up, join, membership_prefix, settle
from pyasync.transport.base import Transport

__all__ = [
    "WHAT",
    "agreement_items",
    "broadcast_initial",
    "handshake",
    "public_items",
    "stop_transport",
    "tell_peers",
]

#: How the construction is named in messages.
WHAT = "the construction of the DistributedOptimizer"


def stop_transport(tp, err: BaseException) -> None:
    """A construction that fails: close the transport, telling the peers why and whom it names."""
    if isinstance(tp, Transport):
        tp.abort(f"{type(err).__name__}: {err}", list(getattr(err, "ranks", ()) or ()))


def tell_peers(process_group, timeout, e: BaseException) -> None:
    """This rank's construction failed before the meeting: tell the other ranks (best effort)."""
    with contextlib.suppress(Exception):
        if (
            isinstance(timeout, datetime.timedelta)
            and dist.is_initialized()
            and dist.get_rank(process_group) >= 0
            and dist.get_world_size(process_group) > 1
        ):
            join(process_group, timeout, WHAT, failed=e)


def agreement_items(setup: Setup, policy: Policy, layouts: list[BucketLayout]) -> dict[str, list[str]]:
    """What every rank must describe identically (see session/agree.py). The requires_grad flags come
    first: a parameter frozen on one rank only would otherwise show as a shape difference (the
    trainable lists shift)."""
    return {
        "requires_grad flags": [
            f"param_groups[{gi}][{j}] shape={tuple(p.shape)} requires_grad={p.requires_grad}"
            for gi, g in enumerate(setup.param_groups)
            for j, p in enumerate(g["params"])
        ],
        "parameters": [
            f"{i} {setup.names[i]} shape={tuple(p.shape)} dtype={p.dtype} group={setup.groups[i]}"
            for i, p in enumerate(setup.params)
        ],
        "policy": [policy.spec()],
        "compression": [setup.compressor.spec()],
        "optimizer": setup.rule.describe(),
        "bucket layout": [lay.describe() for lay in layouts],
        "device type": [setup.params[0].device.type],
        "hyperparameters": [describe_group(i, g) for i, g in enumerate(setup.param_groups)],
        "max_grad_norm": [repr(setup.max_grad_norm)],
        "grad_edits": [setup.grad_edits],
        "elastic": [repr(setup.elastic)],
    }


def public_items(setup: Setup, policy: Policy) -> dict[str, list[str]]:
    """The agreement items a worker that joins later must match (Note [Joining a running job]): all but the
    bucket layout, which depends on the number of ranks."""
    items = agreement_items(setup, policy, setup.layouts(1))
    del items["bucket layout"]
    return items


@torch.no_grad()
def broadcast_initial(params: list[torch.Tensor], layouts: list[BucketLayout], group, control) -> None:
    """Same starting point everywhere (as DDP): rank 0's parameters, bucket by bucket, over ``control``
    (the optimizer's own group of the ranks of ``group``)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for lay in layouts:
        ps = [params[p] for p in lay.params]
        flat = torch.cat([p.detach().reshape(-1) for p in ps])
        host = flat.cpu()  # gloo: host memory (a no-op copy on the CPU)
        dist.broadcast(host, src=src, group=control)
        flat.copy_(host)
        for p, o, n in zip(ps, lay.offsets, lay.numels):
            p.copy_(flat[o : o + n].view_as(p))


def handshake(
    setup: Setup, group, policy: Policy, layouts: list[BucketLayout]
) -> tuple[dist.ProcessGroup | None, Transport | None, str]:
    """Meet the ranks of ``group`` (more than one), then the optimizer's own group, transport,
    agreement and rank 0's values; then every rank meets once more, failed or not (Note [Failing
    together at construction]). Returns (the own gloo group, the transport, the job's prefix in the
    store for membership records); raises the same error on every rank when any rank failed."""
    timeout = setup.timeout
    keys = join(group, timeout, WHAT)
    key = membership_prefix(keys)
    control, tp = None, None
    failed: BaseException | None = None
    try:
        try:
            control = control_group(group, timeout)
        except Exception as e:  # the others may have given up just as this rank met them
            raise (gave_up(keys, WHAT) or e) from e
        tp = setup.transport(control)
        if not isinstance(tp, Transport):
            raise TypeError(f"the transport factory returned a {type(tp).__name__}, not a Transport")
        if setup.elastic:
            check_elastic_transport(tp)
        check_agreement(agreement_items(setup, policy, layouts), control)
        broadcast_initial(setup.params, layouts, group, control)
    except AgreementError as e:
        failed = e
    except Exception as e:
        failed = collective_failure(e, tp if isinstance(tp, Transport) else None, WHAT, wait=1.0)
        if failed is not e and failed.__cause__ is None:
            failed.__cause__ = e
    except BaseException as e:  # KeyboardInterrupt: tell the others, then stop
        failed = e
    if failed is not None:  # stop first: a peer blocked in a collective with this rank fails now
        if control is not None:
            destroy_group(control)
            control = None
        if getattr(failed, "ranks", None):  # peers hear whom this rank stopped for (not for itself)
            stop_transport(tp, failed)
    err = settle(group, timeout, WHAT, tp if failed is None else None, failed)
    if err is not None:
        stop_transport(tp, err)
        if control is not None:
            destroy_group(control)
        if err is failed:
            raise err
        raise err from (failed or err.__cause__)
    return control, tp, key
