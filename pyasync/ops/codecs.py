"""Gradient codecs: encode with error feedback, decode with scale and accumulate.

Torch-facing wrappers of ``encode_{cpu,cuda}`` / ``decode_{cpu,cuda}`` in the core: they validate
every argument (a payload may come from the network, so a malformed one is a clear error, never an
out-of-bounds access), allocate what the caller did not pass, and launch on the tensors' device (on
CUDA: on the current stream). The pure-torch twin is :mod:`pyasync.reference.codecs`.

Codecs (see ``Codec`` in csrc/include/pyasync/common.h and the Notes in csrc/include/pyasync/math):
  "none"  fp32 copy (plus the non-finite check)        4 bytes / element
  "fp16"  fp16 cast, round to nearest even              2 bytes / element
  "bf16"  bf16 cast, round to nearest even              2 bytes / element
  "int8"  blockwise absmax int8, fp32 scale per block   1 byte / element + 4 bytes / block
  "sign"  1 bit per element, fp32 mean|v| per block     1/8 byte / element + 4 bytes / block
  "topk"  k largest |v|: int32 indices + fp32 values    8 bytes / kept element
"""

from __future__ import annotations

import math

import torch

from pyasync._validate import check_bool, check_int, check_real, overlaps
from pyasync.ops._common import (
    BLOCK_CODECS,
    CODEC_IDS,
    Payload,
    addr,
    check_num_threads,
    check_tensor,
    launch,
    payload_parts,
)

__all__ = [
    "CODECS",
    "MAX_BLOCK",
    "check_payload",
    "decode",
    "dgc_velocity",
    "empty_payload",
    "encode",
    "payload_nbytes",
    "topk_count",
]

CODECS = tuple(CODEC_IDS)  # valid codec names, in id order
MAX_BLOCK = 1 << 20  # largest block (elements) accepted: one scale per at most 1 Mi elements
MAX_ELEMENTS = (1 << 31) - 1  # top-k indices are int32; other codecs take any int64 size


DeviceLike = torch.device | str | int | None


def _check_codec(codec: str) -> str:
    if not isinstance(codec, str):
        raise TypeError(f"codec must be a str, one of {list(CODECS)}; got {type(codec).__name__}")
    if codec not in CODEC_IDS:
        raise ValueError(f"codec must be one of {list(CODECS)}, got {codec!r}")
    return codec


def _check_block(block: object) -> int:
    return check_int("block", block, lo=1, hi=MAX_BLOCK, what="elements")


def _check_k(k: object, n: int) -> int:
    k = check_int("k", k)
    if n < 1:
        raise ValueError("top-k needs a non-empty tensor (n >= 1)")
    if n > MAX_ELEMENTS:
        raise ValueError(f"top-k indices are int32: n must be <= {MAX_ELEMENTS}, got {n}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}] for codec 'topk', got {k} (see topk_count(n, ratio))")
    return k


def topk_count(n: int, ratio: float) -> int:
    """Elements top-k keeps of `n`: ``min(n, max(1, ceil(ratio * n)))``, for ``0 < ratio <= 1``."""
    n = check_int("n", n)
    if n < 1:
        raise ValueError(f"n must be >= 1 elements, got {n}")
    ratio = check_real("ratio", ratio)
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    return min(n, max(1, math.ceil(ratio * n)))


def payload_nbytes(codec: str, n: int, *, block: int = 256, k: int = 0) -> int:
    """Bytes of the payload tensors for `n` elements (what goes on the wire, headers aside)."""
    codec = _check_codec(codec)
    n = check_int("n", n)
    if n < 0:
        raise ValueError(f"n must be >= 0 elements, got {n}")
    block = _check_block(block) if codec in BLOCK_CODECS else 0
    k = _check_k(k, n) if codec == "topk" else 0
    return sum(numel * dt.itemsize for _, dt, numel in payload_parts(codec, n, block, k))


def empty_payload(codec: str, n: int, *, device: DeviceLike = "cpu", block: int = 256, k: int = 0) -> Payload:
    """An uninitialised payload for `n` elements on `device` (block: elements per scale for int8/sign;
    k: kept elements for topk)."""
    codec = _check_codec(codec)
    n = check_int("n", n)
    if n < 0:
        raise ValueError(f"n must be >= 0 elements, got {n}")
    device = torch.device("cpu" if device is None else device)
    block = _check_block(block) if codec in BLOCK_CODECS else 0
    k = _check_k(k, n) if codec == "topk" else 0
    t = {
        name: torch.empty(numel, dtype=dt, device=device)
        for name, dt, numel in payload_parts(codec, n, block, k)
    }
    return Payload(codec=codec, n=n, k=k, block=block, **t)


def check_payload(
    payload: Payload,
    *,
    name: str = "payload",
    codec: str | None = None,
    n: int | None = None,
    device: torch.device | None = None,
) -> None:
    """Raise TypeError/ValueError unless `payload` is well formed: a known codec, tensors of the right
    dtype, device, contiguity and size for its n / block / k (and, when given, the expected codec,
    element count and device). Top-k index values are checked by :func:`decode`."""
    if not isinstance(payload, Payload):
        raise TypeError(f"{name} must be a pyasync Payload, got {type(payload).__name__}")
    c = payload.codec
    if not isinstance(c, str) or c not in CODEC_IDS:
        raise ValueError(f"{name}.codec must be one of {list(CODECS)}, got {c!r}")
    if codec is not None and c != codec:
        raise ValueError(f"{name} has codec {c!r} but {codec!r} was expected")
    pn = payload.n
    if not isinstance(pn, int) or isinstance(pn, bool) or pn < 0:
        raise ValueError(f"{name}.n must be an int >= 0, got {pn!r}")
    if n is not None and pn != n:
        raise ValueError(f"{name} holds {pn} elements but {n} were expected")
    if c in BLOCK_CODECS:
        b = payload.block
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= MAX_BLOCK:
            raise ValueError(f"{name}.block must be an int in [1, {MAX_BLOCK}] for codec {c!r}, got {b!r}")
    if c == "topk":
        pk = payload.k
        if not isinstance(pk, int) or isinstance(pk, bool) or not 1 <= pk <= pn or pn > MAX_ELEMENTS:
            raise ValueError(f"{name}.k must be an int in [1, n={pn}] for codec 'topk', got {pk!r}")
    block = payload.block if c in BLOCK_CODECS else 0
    k = payload.k if c == "topk" else 0
    dev = device
    for field, dt, numel in payload_parts(c, pn, block, k):
        t = getattr(payload, field)
        if t is None:
            raise ValueError(f"{name}.{field} is missing: codec {c!r} needs {numel} {dt} elements there")
        check_tensor(f"{name}.{field}", t, dtype=dt, device=dev, numel=numel)
        dev = t.device


def _check_mask_out(mask_out: torch.Tensor, codec: str, grad: torch.Tensor, residual_out) -> None:
    if codec != "topk":
        raise ValueError(f"mask_out is for the 'topk' codec only, got codec {codec!r}")
    check_tensor("mask_out", mask_out, dtype=torch.float32, device=grad.device, numel=grad.numel())
    same = mask_out.data_ptr() == grad.data_ptr()  # each element is read before it is masked
    if grad.numel() > 0 and ((overlaps(mask_out, grad) and not same) or (
            residual_out is not None and overlaps(mask_out, residual_out))):
        raise ValueError("mask_out must be grad itself or overlap neither grad nor residual_out")


def encode(
    codec: str,
    grad: torch.Tensor,
    *,
    residual_in: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    block: int = 256,
    k: int = 0,
    out: Payload | None = None,
    nonfinite: torch.Tensor | None = None,
    num_threads: int | None = None,
    mask_out: torch.Tensor | None = None,
) -> Payload:
    """Encode ``v = grad + residual_in`` with `codec`; with error feedback write
    ``residual_out = v - decode(payload)``.

    grad: contiguous 1-D fp32 (n elements). residual_in: n fp32, or None for no error feedback.
    residual_out: n fp32 (may be residual_in itself, for in-place), None to not write a residual.
    block: elements per scale (int8, sign). k: kept elements (topk; see :func:`topk_count`).
    out: a payload to fill (from :func:`empty_payload`), else one is allocated.
    nonfinite: an int32 flag tensor the kernel sets to 1 when grad holds NaN/Inf (it is never
    cleared: pass a zeroed one); else a fresh flag is used. Where an element is non-finite, its
    residual keeps residual_in. ``payload.finite`` is read from the flag (one small host sync on
    CUDA). num_threads: CPU threads (None: the default).
    mask_out (top-k only): n fp32 zeroed at every element sent whose v is finite: the factor masking
    of a momentum-corrected top-k (:func:`dgc_velocity`; Note [Momentum correction for top-k] in
    csrc/include/pyasync/math/topk.h). It may be grad itself: every element is read before it is masked.
    """
    codec = _check_codec(codec)
    check_tensor("grad", grad, dtype=torch.float32)
    if grad.dim() != 1:
        raise ValueError(f"grad must be 1-D (flatten it first), got shape {tuple(grad.shape)}")
    n = grad.numel()
    device = grad.device
    if residual_in is not None:
        check_tensor("residual_in", residual_in, dtype=torch.float32, device=device, numel=n)
    if residual_out is not None:
        if residual_in is None:
            raise ValueError("residual_out needs residual_in (error feedback reads the old residual)")
        check_tensor("residual_out", residual_out, dtype=torch.float32, device=device, numel=n)
        if n > 0:
            if overlaps(residual_out, grad):
                raise ValueError("residual_out must not overlap grad")
            if residual_out.data_ptr() != residual_in.data_ptr() and overlaps(residual_out, residual_in):
                raise ValueError("residual_out must be residual_in itself (in place) or not overlap it")
    if mask_out is not None:
        _check_mask_out(mask_out, codec, grad, residual_out)
    block = _check_block(block) if codec in BLOCK_CODECS else 0
    k = _check_k(k, n) if codec == "topk" else 0
    nt = check_num_threads(num_threads)
    if out is None:
        out = empty_payload(codec, n, device=device, block=block if block else 256, k=k)
    else:
        check_payload(out, name="out", codec=codec, n=n, device=device)
        if codec in BLOCK_CODECS and out.block != block:
            raise ValueError(f"out.block is {out.block} but block={block} was asked for")
        if codec == "topk" and out.k != k:
            raise ValueError(f"out.k is {out.k} but k={k} was asked for")
    if nonfinite is None:
        flag = torch.zeros(1, dtype=torch.int32, device=device)
    else:
        check_tensor("nonfinite", nonfinite, dtype=torch.int32, device=device)
        if nonfinite.numel() < 1:
            raise ValueError("nonfinite must hold at least one int32 element")
        flag = nonfinite
    if n == 0:
        out.finite = not bool(flag[0].item())
        return out
    workspace, ws_bytes = None, 0
    if codec == "topk" and device.type == "cuda":
        from pyasync import _ext

        ws_bytes = int(_ext.C().topk_workspace_bytes(n, k))
        workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=device)
    launch(
        "encode",
        device,
        grad=addr(grad),
        residual_in=addr(residual_in),
        residual_out=addr(residual_out),
        codec=CODEC_IDS[codec],
        codes=addr(out.codes),
        scales=addr(out.scales),
        indices=addr(out.indices),
        n=n,
        k=out.k,
        block=out.block,
        nonfinite=addr(flag),
        workspace=addr(workspace),
        workspace_bytes=ws_bytes,
        num_threads=nt,
        mask_out=addr(mask_out),
    )
    out.finite = not bool(flag[0].item())
    return out


def dgc_velocity(
    grad: torch.Tensor,
    u_in: torch.Tensor,
    u_out: torch.Tensor,
    *,
    momentum: float,
    nesterov: bool = False,
    x_out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """The worker's momentum step of a momentum-corrected top-k (DGC; Note [Momentum correction for
    top-k] in csrc/include/pyasync/math/topk.h): ``u_out = momentum * u_in + grad``, and the value to
    encode, ``x = u_out`` or, with Nesterov, ``grad + momentum * u_out`` into ``x_out``. Returns x.

    grad, u_in, u_out, x_out: n contiguous fp32 on one device; u_out may be u_in (in place) but
    overlaps neither grad nor x_out. momentum in [0, 1). x_out is required with Nesterov; without
    it, x is u_out itself.
    """
    check_tensor("grad", grad, dtype=torch.float32)
    if grad.dim() != 1:
        raise ValueError(f"grad must be 1-D (flatten it first), got shape {tuple(grad.shape)}")
    n, device = grad.numel(), grad.device
    check_tensor("u_in", u_in, dtype=torch.float32, device=device, numel=n)
    check_tensor("u_out", u_out, dtype=torch.float32, device=device, numel=n)
    momentum = check_real("momentum", momentum)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    check_bool("nesterov", nesterov)
    if nesterov and x_out is None:
        raise ValueError("a Nesterov velocity step needs x_out (x = grad + momentum * u_out is not u_out)")
    if x_out is not None:
        check_tensor("x_out", x_out, dtype=torch.float32, device=device, numel=n)
    if n > 0:
        if overlaps(u_out, grad) or (x_out is not None and (overlaps(x_out, u_out) or overlaps(x_out, u_in))):
            raise ValueError("u_out must not overlap grad, and x_out must overlap neither u_in nor u_out")
        if u_out.data_ptr() != u_in.data_ptr() and overlaps(u_out, u_in):
            raise ValueError("u_out must be u_in itself (in place) or not overlap it")
        launch(
            "dgc_velocity",
            device,
            grad=addr(grad),
            u_in=addr(u_in),
            u_out=addr(u_out),
            x_out=addr(x_out),
            mu=float(momentum),
            nesterov=bool(nesterov),
            n=n,
            num_threads=check_num_threads(num_threads),
        )
    return u_out if x_out is None else x_out


def decode(
    payload: Payload,
    *,
    out: torch.Tensor | None = None,
    alpha: float = 1.0,
    accumulate: bool = False,
    num_threads: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """``out = (out if accumulate else 0) + alpha * decode(payload)``; returns out (n fp32).

    out: n contiguous fp32 on the payload's device; None allocates one (then accumulate adds to
    zeros). Top-k indices must lie in [0, n) and ascend strictly: checked on CPU; on CUDA (no host
    sync) the kernel skips out-of-range indices instead of touching memory outside out.
    validate: False skips these checks, for a payload validated where it came in (the engine's own
    encoder, or the wire's unpack_push) and an ``out`` of the caller's own.
    """
    if not validate:
        if out is None:
            raise ValueError("decode(validate=False) needs out")
        return _launch_decode(payload, out, alpha, accumulate, check_num_threads(num_threads))
    check_payload(payload)
    device = payload.device
    n = payload.n
    check_real("alpha", alpha)
    check_bool("accumulate", accumulate)
    nt = check_num_threads(num_threads)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=device)
        if accumulate:
            out.zero_()
    else:
        check_tensor("out", out, dtype=torch.float32, device=device, numel=n)
    if payload.codec == "topk" and device.type == "cpu":
        idx = payload.indices
        if int(idx[0]) < 0 or int(idx[-1]) >= n:
            lo, hi = int(idx.min()), int(idx.max())
            raise ValueError(f"payload.indices must lie in [0, n={n}); got values in [{lo}, {hi}]")
        if payload.k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError("payload.indices must be strictly ascending (a corrupt top-k payload?)")
    return _launch_decode(payload, out, alpha, accumulate, nt)


def _launch_decode(
    payload: Payload, out: torch.Tensor, alpha: float, accumulate: bool, nt: int
) -> torch.Tensor:
    if payload.n:
        launch(
            "decode",
            payload.device,
            codec=CODEC_IDS[payload.codec],
            codes=addr(payload.codes),
            scales=addr(payload.scales),
            indices=addr(payload.indices),
            n=payload.n,
            k=payload.k,
            block=payload.block,
            out=addr(out),
            alpha=float(alpha),
            accumulate=accumulate,
            num_threads=nt,
        )
    return out
