"""Pure-torch twins of :mod:`pyasync.ops.bucketing`: the specification and the test oracle.

Same signatures and, NaN payloads aside, the same bits as the kernels (see Note [Bucket copies] in
csrc/cpu/flatten.cpp): widen to float32, multiply by ``scale`` in float32 unless it is 1, round once
to the destination dtype. Only the checks that torch would not make itself are repeated here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flatten", "unflatten"]


def flatten(
    tensors: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    offsets: Sequence[int],
    *,
    numels: Sequence[int] | None = None,
    scale: float = 1.0,
    nonfinite: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Reference :func:`pyasync.ops.bucketing.flatten`: ``out[o_i : o_i + n_i] = (t_i.float() * scale)``
    converted to ``out.dtype`` (zeros for ``None``); ``nonfinite`` set to 1 if a source holds NaN/Inf.
    ``num_threads`` is accepted and ignored. Offsets and sizes are in elements."""
    if len(tensors) != len(offsets):
        raise ValueError("tensors and offsets must have the same length")
    flat = out.view(-1)
    for i, (t, o) in enumerate(zip(tensors, offsets)):
        if t is None:
            if numels is None:
                raise ValueError(f"tensors[{i}] is None: numels is required")
            flat[o : o + numels[i]].zero_()
            continue
        v = t.reshape(-1).to(torch.float32)
        if nonfinite is not None and not bool(torch.isfinite(v).all()):
            nonfinite.fill_(1)
        if scale != 1.0:
            v = v * scale  # float32 tensor times a Python float: one float32 multiply per element
        flat[o : o + v.numel()].copy_(v)  # copy_ rounds to out.dtype (nearest, ties to even)
    return out


def unflatten(
    src: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    *,
    begin: int = 0,
    num_threads: int | None = None,
) -> None:
    """Reference :func:`pyasync.ops.bucketing.unflatten`: for every tensor overlapping bucket elements
    ``[begin, begin + src.numel())``, copy the overlapping part of ``src`` into it (converted to its
    dtype); elements outside that range are left as they are. ``num_threads`` is ignored."""
    if len(tensors) != len(offsets):
        raise ValueError("tensors and offsets must have the same length")
    flat_src = src.reshape(-1)
    end = begin + flat_src.numel()
    for t, o in zip(tensors, offsets):
        lo, hi = max(o, begin), min(o + t.numel(), end)
        if lo >= hi:
            continue
        t.view(-1)[lo - o : hi - o].copy_(flat_src[lo - begin : hi - begin])
