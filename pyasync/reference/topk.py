"""Pure-torch top-k by magnitude with error feedback: the oracle of the top-k kernels.

See Note [Top-k selection] in csrc/include/pyasync/math/topk.h. Readable eager torch, CPU or CUDA.
"""

from __future__ import annotations

import torch

from pyasync.ops._common import Payload

__all__ = ["dgc_encode", "dgc_velocity", "topk_encode", "topk_key"]


def topk_key(v: torch.Tensor) -> torch.Tensor:
    """The ordering key of each element as int64: the bits of |v| (monotone in |v|), 0 where v is
    NaN or +-Inf (``math::topk_key``)."""
    bits = v.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    return torch.where(torch.isfinite(v), bits, torch.zeros_like(bits))


def topk_encode(
    grad: torch.Tensor, residual: torch.Tensor | None, k: int
) -> tuple[Payload, torch.Tensor | None]:
    """Keep the `k` elements of largest ``|v|``, ``v = grad + residual`` (``v = grad`` without one).

    grad: 1-D fp32 (n elements); residual: n fp32 or None (no error feedback); k: kept elements,
    1 <= k <= n. Ties at the k-th largest key go to the lowest indices. Returns the payload (codec
    "topk": ``indices`` int32 ascending, ``codes`` fp32 v at them, ``finite`` False when v holds
    NaN/Inf) and the new residual (v with kept entries zeroed, the old residual where v is not
    finite), or None without a residual.
    """
    if not isinstance(grad, torch.Tensor) or grad.dtype != torch.float32 or grad.dim() != 1:
        raise TypeError("grad must be a 1-D float32 tensor")
    n = grad.numel()
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if residual is not None and (residual.dtype != torch.float32 or residual.shape != grad.shape):
        raise ValueError("residual must be a float32 tensor shaped like grad")
    v = grad + residual if residual is not None else grad.clone()
    bad = ~torch.isfinite(v)
    key = topk_key(v)
    # The k-th largest key (torch.topk: kthvalue's quickselect degrades to quadratic on sorted input).
    threshold = torch.topk(key, k, sorted=False).values.min()
    above = key > threshold
    ties = key == threshold
    quota = k - int(above.sum())  # ties kept, first ones by index
    tie_rank = torch.cumsum(ties.to(torch.int64), 0) - 1
    keep = above | (ties & (tie_rank < quota))
    indices = keep.nonzero().flatten()
    payload = Payload(
        codec="topk",
        n=n,
        codes=v[indices],
        indices=indices.to(torch.int32),
        k=k,
        finite=not bool(bad.any()),
    )
    new_residual = None
    if residual is not None:
        new_residual = torch.where(bad, residual, torch.where(keep, torch.zeros_like(v), v))
    return payload, new_residual


def dgc_velocity(
    grad: torch.Tensor, u: torch.Tensor, momentum: float, nesterov: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The worker's momentum step of a momentum-corrected top-k (Note [Momentum correction for top-k]
    in csrc/include/pyasync/math/topk.h): returns the new velocity ``u' = momentum * u + grad`` and
    what error feedback accumulates, ``u'`` or, with Nesterov, ``grad + momentum * u'`` (each
    product and sum rounded on its own, as the kernels do)."""
    u_new = (u * momentum) + grad
    x = grad + (u_new * momentum) if nesterov else u_new
    return u_new, x


def dgc_encode(
    grad: torch.Tensor, u: torch.Tensor, residual: torch.Tensor, k: int, momentum: float,
    nesterov: bool = False, mask: bool = True,
) -> tuple[Payload, torch.Tensor, torch.Tensor]:
    """One step of momentum-corrected top-k: the velocity step, top-k of ``x + residual`` with error
    feedback, then (``mask``: factor masking) the new velocity zeroed where an element was sent.
    Returns (payload, new velocity, new residual); where the payload is not finite the caller keeps
    the old velocity and residual."""
    u_new, x = dgc_velocity(grad, u, momentum, nesterov)
    payload, new_residual = topk_encode(x, residual, k)
    if not mask:
        return payload, u_new, new_residual
    idx = payload.indices.to(torch.int64)
    sent = torch.isfinite(payload.codes)
    u_new = u_new.clone()
    u_new[idx[sent]] = 0.0
    return payload, u_new, new_residual
