"""Checks and descriptions the DistributedOptimizer makes when it is built (kept out of optimizer.py)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from pyasync._validate import check_int, check_real
from pyasync.engine.core.buckets import compute_bucket_assignment_by_size

__all__ = [
    "assign_buckets",
    "check_clipping_owners",
    "check_elastic",
    "check_elastic_transport",
    "check_grad_edits",
    "check_options",
    "describe_group",
    "trainable_params",
]

_FP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_options(
    bucket_cap_mb, timeout, num_appliers, on_nonfinite, transport, process_group, max_grad_norm
) -> None:
    """Raise a clear error for a bad constructor argument (before anything is built)."""
    if max_grad_norm is not None:
        check_real("max_grad_norm", max_grad_norm, lo=0.0, lo_open=True)
    check_real("bucket_cap_mb", bucket_cap_mb, lo=0.0, lo_open=True)
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise TypeError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    check_int("num_appliers", num_appliers, lo=1)
    if on_nonfinite not in ("skip", "raise"):
        raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
    if transport is not None and not callable(transport):
        raise TypeError(
            "transport must be a factory transport(process_group, timeout) -> Transport, or None, got "
            f"{type(transport).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(backend 'gloo') on every rank before creating a DistributedOptimizer"
        )
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )


def check_grad_edits(grad_edits, policy, max_grad_norm) -> str:
    """``grad_edits`` itself, or a clear error (a bad value; "forbid" where a push must be clipped)."""
    if grad_edits not in ("detect", "forbid"):
        raise ValueError(f"grad_edits must be 'detect' or 'forbid', got {grad_edits!r}")
    if grad_edits == "forbid" and max_grad_norm is not None and not policy.clips_mean:
        raise ValueError(
            f"max_grad_norm under {policy.spec()} clips each push before it is sent, which "
            "grad_edits='forbid' (send while backward runs) cannot do; use grad_edits='detect'"
        )
    return grad_edits


def check_elastic(elastic, policy, max_grad_norm, optimizer, transport=None) -> bool:
    """``elastic`` as a bool, or a clear error where a membership change cannot be survived."""
    if not isinstance(elastic, bool):
        raise TypeError(f"elastic must be True or False, got {elastic!r}")
    if not elastic:
        return False
    from pyasync.policy import BSP

    if isinstance(policy, BSP) and not policy.p2p:
        raise ValueError(
            "elastic=True needs the point-to-point engine: BSP on collectives cannot go on without a dead "
            "rank (every rank raises PeerFailure naming it; resume from a checkpoint). Use policy='bsp:p2p' "
            "for a BSP that survives, or SSP, ASP or Quorum"
        )
    if max_grad_norm is not None and policy.clips_mean:
        raise ValueError(
            f"elastic=True with max_grad_norm under {policy.spec()} is not supported: clipping the mean "
            "gradient is a collective of every rank; clip each push instead (SSP, ASP or Quorum)"
        )
    from pyasync.optim import DelayedNesterov

    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, DelayedNesterov):
        raise ValueError(
            f"elastic=True re-shards the optimizer state, which needs SGD, Adam or AdamW (fused rules), "
            f"got {type(optimizer).__name__}"
        )
    if isinstance(transport, type):
        check_elastic_transport(transport)
    return True


def check_elastic_transport(tp) -> None:
    """A transport (or its class) that can serve elastic membership: it reports departed peers and
    sends heartbeats (Note [Heartbeats] in pyasync/transport/heartbeats.py), or a clear error."""
    if not getattr(tp, "probes_liveness", False):
        name = tp.__name__ if isinstance(tp, type) else type(tp).__name__
        raise ValueError(
            f"elastic=True needs a transport that notices a stalled peer (heartbeats); {name} has none. "
            "Use the default TCP transport (transport=None)"
        )


def trainable_params(param_groups, named_parameters) -> tuple[list[torch.Tensor], list[int], list[str]]:
    """(parameters, their param_group index, their names): the trainable ones, each once (tied
    parameters are one tensor), in group order; a clear error for what pyasync cannot train."""
    names: dict[int, str] = {}
    if named_parameters is not None:
        for item in named_parameters:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(
                    "named_parameters must yield (name, parameter) pairs, e.g. model.named_parameters()"
                )
            names.setdefault(id(item[1]), item[0])
    params: list[torch.Tensor] = []
    groups: list[int] = []
    seen: set[int] = set()
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param_groups[{gi}] holds a {type(p).__name__}, expected tensors")
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = names.get(id(p), f"param{len(params)}")
            if p.dtype not in _FP_DTYPES:
                raise TypeError(
                    f"parameter {name} has dtype {p.dtype}; pyasync supports float32, float16 and bfloat16 "
                    "parameters"
                )
            if p.layout != torch.strided:
                raise TypeError(
                    f"parameter {name} is a {p.layout} tensor; pyasync trains dense (strided) parameters "
                    "(sparse gradients of dense parameters are fine)"
                )
            if not p.is_contiguous():
                raise ValueError(
                    f"parameter {name} is not contiguous; make it contiguous (p.data = p.data.contiguous()) "
                    "before wrapping the optimizer"
                )
            params.append(p)
            groups.append(gi)
    if not params:
        raise ValueError("the optimizer has no parameter with requires_grad=True: nothing to train")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    return params, groups, [names.get(id(p), f"param{i}") for i, p in enumerate(params)]


def assign_buckets(params: list[torch.Tensor], bucket_cap_mb: float) -> list[list[int]]:
    """The buckets (parameter indices per bucket) of at most ``bucket_cap_mb`` MiB of parameter data."""
    cap = max(1, int(bucket_cap_mb * (1 << 20)))
    return compute_bucket_assignment_by_size(
        [p.numel() * p.element_size() for p in params],
        [str(p.dtype) for p in params],
        [str(p.device) for p in params],
        cap,
    )


def check_clipping_owners(max_grad_norm, policy, world: int, layouts) -> None:
    """Clipping the mean gradient (BSP) needs every rank to own part of the parameters."""
    if max_grad_norm is not None and policy.clips_mean and world > 1:
        empty = [r for r in range(world) if not any(lay.shards[r].numel for lay in layouts)]
        if empty:
            raise ValueError(
                f"max_grad_norm under {policy.spec()} needs every rank to own part of the "
                "parameters, "
                f"but ranks {empty} own none (the model has fewer elements per bucket than ranks)"
            )


def describe_group(i: int, g: dict) -> str:
    """A param group's hyperparameters as one line (ranks must agree on them)."""
    items = []
    for k, v in sorted(g.items()):
        if k == "params":
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        items.append(f"{k}={v!r}")
    return f"param_groups[{i}]: " + ", ".join(items)
