"""Pure-torch codecs: the specification of :mod:`pyasync.ops.codecs` and its test oracle.

Readable eager torch, one IEEE operation per step, in the order the kernels round (see the Notes in
csrc/include/pyasync/math/{int8,sign,topk,feedback}.h):

  v      = grad + residual                         (residual None: v = grad, no error feedback)
  codes  = the codec's encoding of v
  d      = decode(codes)                           (what the receiver reconstructs)
  bad    = ~(isfinite(v) & isfinite(d))            (NaN/Inf gradient, or a code that overflowed)
  new residual = where(bad, residual, v - d);  payload.finite = not bad.any()

Decode: out = alpha * d, or out + alpha * d with accumulate (the product rounded, then the sum).
"""

from __future__ import annotations

import torch

from pyasync.ops._common import Payload

__all__ = ["decode", "encode"]

_CODECS = ("none", "fp16", "bf16", "int8", "sign", "topk")


def _blocks(v: torch.Tensor, block: int) -> torch.Tensor:
    """v as a (ceil(n/block), block) matrix, the short last block padded with zeros."""
    n = v.numel()
    nblocks = -(-n // block)
    padded = torch.zeros(nblocks * block, dtype=v.dtype, device=v.device)
    padded[:n] = v
    return padded.view(nblocks, block)


def _block_counts(n: int, block: int, device: torch.device) -> torch.Tensor:
    """Elements in each block (all `block` but the last), as fp32."""
    nblocks = -(-n // block)
    counts = torch.full((nblocks,), float(block), dtype=torch.float32, device=device)
    counts[-1] = float(n - (nblocks - 1) * block)
    return counts


def _expand(scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Per-block scales repeated to one per element."""
    return scales.repeat_interleave(block)[:n]


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool[n] -> uint8[ceil(n/8)], element i in bit i % 8 of byte i // 8 (LSB first), padding 0."""
    n = bits.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.int32, device=bits.device)
    padded[:n] = bits.to(torch.int32)
    weights = 2 ** torch.arange(8, dtype=torch.int32, device=bits.device)
    return (padded.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def _unpack_bits(codes: torch.Tensor, n: int) -> torch.Tensor:
    """uint8[ceil(n/8)] -> bool[n], the inverse of _pack_bits."""
    shifts = torch.arange(8, dtype=torch.int32, device=codes.device)
    return ((codes.to(torch.int32).unsqueeze(1) >> shifts) & 1).flatten()[:n].bool()


def _decoded(p: Payload) -> torch.Tensor:
    """The dense fp32 values a payload stands for (top-k: zeros elsewhere)."""
    if p.codec == "none":
        return p.codes.clone()
    if p.codec in ("fp16", "bf16"):
        return p.codes.float()
    if p.codec == "int8":
        return p.codes.float() * _expand(p.scales, p.n, p.block)
    if p.codec == "sign":
        s = _expand(p.scales, p.n, p.block)
        return torch.where(_unpack_bits(p.codes, p.n), s, -s)
    d = torch.zeros(p.n, dtype=torch.float32, device=p.codes.device)
    d[p.indices.long()] = p.codes
    return d


def encode(
    codec: str,
    grad: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    block: int = 256,
    k: int = 0,
) -> tuple[Payload, torch.Tensor | None]:
    """Encode ``v = grad + residual`` (1-D fp32, n elements); returns (payload, new residual), the
    new residual None when `residual` is None. block: elements per scale (int8, sign); k: elements
    kept (topk)."""
    if codec not in _CODECS:
        raise ValueError(f"codec must be one of {list(_CODECS)}, got {codec!r}")
    if codec == "topk":
        from pyasync.reference.topk import topk_encode

        return topk_encode(grad, residual, k)
    n = grad.numel()
    v = grad + residual if residual is not None else grad.clone()
    if codec == "none":
        p = Payload(codec="none", n=n, codes=v.clone())
    elif codec == "fp16":
        p = Payload(codec="fp16", n=n, codes=v.half())
    elif codec == "bf16":
        p = Payload(codec="bf16", n=n, codes=v.bfloat16())
    elif codec == "int8":
        vb = _blocks(v, block)
        finite = torch.isfinite(vb)
        absmax = torch.where(finite, vb.abs(), torch.zeros_like(vb)).amax(dim=1)
        scale = absmax / 127.0
        s = scale.unsqueeze(1)
        q = torch.clamp(torch.round(vb / s), -127.0, 127.0)  # torch.round: half to even, as rint
        q = torch.where(finite & (s > 0), q, torch.zeros_like(q))
        codes = q.to(torch.int8).flatten()[:n].clone()
        p = Payload(codec="int8", n=n, codes=codes, scales=scale, block=block)
    else:  # sign
        vb = _blocks(v, block)
        abs_sum = torch.where(torch.isfinite(vb), vb.abs(), torch.zeros_like(vb)).sum(dim=1)
        scale = abs_sum / _block_counts(n, block, v.device)
        bits = ~(v < 0) | ~torch.isfinite(v)
        p = Payload(codec="sign", n=n, codes=_pack_bits(bits), scales=scale, block=block)
    d = _decoded(p)
    bad = ~(torch.isfinite(v) & torch.isfinite(d))
    p.finite = not bool(bad.any())
    if residual is None:
        return p, None
    return p, torch.where(bad, residual, v - d)


def decode(
    payload: Payload,
    *,
    out: torch.Tensor | None = None,
    alpha: float = 1.0,
    accumulate: bool = False,
) -> torch.Tensor:
    """``out = (out if accumulate else 0) + alpha * decode(payload)``; returns out (n fp32, written in
    place when given). Top-k touches only its indices when accumulating."""
    n = payload.n
    if out is None:
        out = torch.zeros(n, dtype=torch.float32, device=payload.codes.device)
    if payload.codec == "topk":
        idx = payload.indices.long()
        x = payload.codes * alpha
        if accumulate:
            out[idx] = out[idx] + x
        else:
            out.zero_()
            out[idx] = x
        return out
    x = _decoded(payload) * alpha
    out.copy_(out + x if accumulate else x)
    return out
