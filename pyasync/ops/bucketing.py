"""Bucketing kernels: copy many tensors into one flat bucket and back.

Torch-facing wrappers of ``flatten_{cpu,cuda}`` / ``unflatten_{cpu,cuda}`` in the core
(csrc/cpu/flatten.cpp, csrc/cuda/flatten.cu). They validate every argument, then launch on the
tensors' device (on CUDA: on the current stream of that device, asynchronously). The pure-torch twin,
with the same signatures and bit-identical results, is :mod:`pyasync.reference.bucketing`.

Semantics (see Note [Bucket copies] in csrc/cpu/flatten.cpp): every value is widened to float32,
multiplied by ``scale`` in float32 (skipped when ``scale == 1``) and rounded once (to nearest, ties to
even) to the destination dtype. All offsets and sizes are in elements, never bytes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from pyasync._validate import check_real
from pyasync.ops._common import DTYPE_IDS, addr, check_num_threads, check_tensor, launch

__all__ = ["SUPPORTED_DTYPES", "flatten", "unflatten"]

SUPPORTED_DTYPES = tuple(DTYPE_IDS)  # float32, float16, bfloat16
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_MAX_TENSORS = (1 << 31) - 1  # the core's tensor count is an int32


def _index(name: str, v: object) -> int:
    """v as a Python int (ints and integer-likes such as numpy ints; bools and floats are refused)."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got bool ({v!r})")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})") from None


def _sequence(name: str, v: object) -> Sequence:
    if isinstance(v, (torch.Tensor, str, bytes)) or not isinstance(v, Sequence):
        raise TypeError(f"{name} must be a list or tuple, got {type(v).__name__}")
    return v


def _int_list(name: str, v: object, length: int, what: str) -> list[int]:
    seq = _sequence(name, v)
    if len(seq) != length:
        raise ValueError(f"{name} has {len(seq)} entries but there are {length} {what}; give one per tensor")
    out = list(seq)
    if not all(type(x) is int for x in out):  # fast path for plain ints; numpy ints etc. converted
        out = [_index(f"{name}[{i}]", x) for i, x in enumerate(out)]
    if out and min(out) < 0:
        i = next(i for i, x in enumerate(out) if x < 0)
        raise ValueError(f"{name}[{i}] must be >= 0, got {out[i]}")
    return out


def _check_disjoint(ranges: list[tuple[int, int, int]], what: str) -> None:
    """ranges: (start, stop, index) with start < stop; raise naming two overlapping entries."""
    if any(r1[0] < r0[1] for r0, r1 in zip(ranges, ranges[1:])):  # not already in ascending order
        ranges = sorted(ranges)
        for (s0, e0, i0), (s1, e1, i1) in zip(ranges, ranges[1:]):
            if s1 < e0:
                a, b = sorted((i0, i1))
                raise ValueError(
                    f"{what}: tensors {a} and {b} overlap (elements [{s0}, {e0}) and [{s1}, {e1}))"
                )


def _device_test(device: torch.device):
    """A cheap `t is on device` predicate for the per-tensor loops (check_tensor explains failures)."""
    if device.type == "cpu":
        return lambda t: t.is_cpu
    index = device.index
    return lambda t: t.is_cuda and t.get_device() == index


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


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
    """Copy ``tensors`` into the bucket ``out``, multiplying by ``scale`` on the way.

    Element ``j`` of ``tensors[i]`` (flattened, row-major) lands at ``out.view(-1)[offsets[i] + j]``
    as ``(tensors[i][j].float() * scale).to(out.dtype)``; a ``None`` tensor writes ``numels[i]`` zeros.
    Bucket elements that no tensor covers are left as they are.

    Args:
        tensors: contiguous tensors, all of one dtype (float32, float16 or bfloat16) and on ``out``'s
            device; ``None`` entries contribute zeros. Must not be empty.
        out: the contiguous bucket (float32, float16 or bfloat16), of any shape; indexed flat.
        offsets: element offset of each tensor in ``out``; the ranges must not overlap and must fit.
        numels: elements of each tensor; required for ``None`` entries, checked against the others.
        scale: multiplies every element (in float32; e.g. ``1 / world_size``). Must be finite.
        nonfinite: optional int32 tensor of one element on ``out``'s device, set to 1 when any source
            element is NaN or +-Inf (checked on the source values, before scaling); never cleared.
        num_threads: CPU threads (None or 0: the default, see ``pyasync.set_num_threads``).

    Returns:
        ``out``. On CUDA the copy is queued on the current stream and may still be running.
    """
    check_tensor("out", out, dtypes=SUPPORTED_DTYPES)
    device = out.device
    tensors = _sequence("tensors", tensors)
    count = len(tensors)
    if count == 0:
        raise ValueError("tensors is empty; pass at least one tensor (or None with its numel)")
    if count > _MAX_TENSORS:
        raise ValueError(f"tensors has {count} entries; at most {_MAX_TENSORS} fit in one call")
    offs = _int_list("offsets", offsets, count, "tensors")
    given = None if numels is None else _int_list("numels", numels, count, "tensors")
    scale = check_real("scale", scale)
    if nonfinite is not None:
        check_tensor("nonfinite", nonfinite, dtype=torch.int32, device=device, numel=1)
    nt = check_num_threads(num_threads)

    src_dtype, sizes, srcs = _flatten_sources(tensors, out, offs, given)
    ranges = _destination_ranges(offs, sizes, out.numel())

    if not ranges:
        return out  # nothing to copy
    if nonfinite is not None and _overlaps(_byte_range(nonfinite), _byte_range(out)):
        raise ValueError("nonfinite shares memory with out; pass a separate int32 tensor")

    launch(
        "flatten",
        device,
        srcs=srcs,
        numels=sizes,
        offsets=offs,
        src_dtype=DTYPE_IDS[src_dtype if src_dtype is not None else out.dtype],
        dst_dtype=DTYPE_IDS[out.dtype],
        bucket=addr(out),
        scale=scale,
        nonfinite=addr(nonfinite),
        num_threads=nt,
    )
    return out


def _flatten_sources(
    tensors: list, out: torch.Tensor, offs: list[int], given: list[int] | None
) -> tuple[torch.dtype | None, list[int], list[int]]:
    """flatten's checks of its sources: (their one dtype, or None when all are None; element counts;
    data pointers, 0 for None or empty).

    One pass over the tensors (this runs once per bucket per step: keep it cheap). Sources that share
    memory with out are allowed only in place: the tensor IS its own slot (same dtype, same address),
    e.g. gradients that are views of their bucket."""
    device = out.device
    src_dtype = None
    sizes: list[int] = []
    srcs: list[int] = []
    out_lo, out_hi = _byte_range(out)
    dst_size = out.element_size()
    on_device = _device_test(device)
    for i, t in enumerate(tensors):
        if t is None:
            if given is None:
                raise ValueError(f"tensors[{i}] is None: pass numels so its number of zeros is known")
            sizes.append(given[i])
            srcs.append(0)
            continue
        if not (isinstance(t, torch.Tensor) and t.dtype in _SUPPORTED and on_device(t) and t.is_contiguous()):
            check_tensor(f"tensors[{i}]", t, dtypes=SUPPORTED_DTYPES, device=device)
        if src_dtype is None:
            src_dtype = t.dtype
            src_size = t.element_size()
        elif t.dtype != src_dtype:
            raise TypeError(
                f"tensors[{i}] has dtype {t.dtype} but earlier tensors have {src_dtype}; all sources must "
                "share one dtype (convert them, or flatten each dtype into its own bucket)"
            )
        n = t.numel()
        if given is not None and given[i] != n:
            raise ValueError(f"numels[{i}] is {given[i]} but tensors[{i}] has {n} elements")
        ptr = t.data_ptr() if n > 0 else 0
        if (
            ptr
            and ptr < out_hi
            and out_lo < ptr + n * src_size
            and not (t.dtype == out.dtype and ptr == out_lo + offs[i] * dst_size)
        ):
            raise ValueError(
                f"tensors[{i}] shares memory with out but is not exactly its own slot at offset "
                f"{offs[i]}; copy it first (t.clone())"
            )
        sizes.append(n)
        srcs.append(ptr)
    return src_dtype, sizes, srcs


def _destination_ranges(offs: list[int], sizes: list[int], total: int) -> list[tuple[int, int, int]]:
    """The non-empty [start, end) ranges flatten writes, checked to fit in ``total`` and not overlap."""
    ranges = []
    for i, (o, n) in enumerate(zip(offs, sizes)):
        if o + n > total:
            raise ValueError(
                f"tensors[{i}] needs bucket elements [{o}, {o + n}) but out has only {total} elements"
            )
        if n > 0:
            ranges.append((o, o + n, i))
    _check_disjoint(ranges, "destination ranges in out overlap")
    return ranges


def unflatten(
    src: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    *,
    begin: int = 0,
    num_threads: int | None = None,
) -> None:
    """Copy bucket elements back into the tensors they belong to, converting dtypes.

    ``src`` holds bucket elements ``[begin, begin + src.numel())`` (e.g. one owner's shard of the
    bucket); ``tensors[i]`` covers bucket elements ``[offsets[i], offsets[i] + tensors[i].numel())``.
    Every tensor element whose bucket element lies in the held range is overwritten with that
    element converted to the tensor's dtype; the rest of each tensor is left as it is, so a slice may
    cut through tensors at both ends.

    Args:
        src: contiguous float32, float16 or bfloat16 tensor, indexed flat.
        tensors: contiguous tensors of one dtype (float32, float16 or bfloat16), on ``src``'s device,
            not sharing memory with each other or with ``src``. Must not be empty.
        offsets: element offset of each tensor in the bucket; the ranges must not overlap.
        begin: bucket element held in ``src.view(-1)[0]`` (elements, >= 0).
        num_threads: CPU threads (None or 0: the default, see ``pyasync.set_num_threads``).

    On CUDA the copy is queued on the current stream and may still be running when this returns.
    """
    check_tensor("src", src, dtypes=SUPPORTED_DTYPES)
    device = src.device
    tensors = _sequence("tensors", tensors)
    count = len(tensors)
    if count == 0:
        raise ValueError("tensors is empty; pass at least one destination tensor")
    if count > _MAX_TENSORS:
        raise ValueError(f"tensors has {count} entries; at most {_MAX_TENSORS} fit in one call")
    offs = _int_list("offsets", offsets, count, "tensors")
    begin = _index("begin", begin)
    if begin < 0:
        raise ValueError(f"begin must be >= 0 (a bucket element index), got {begin}")
    nt = check_num_threads(num_threads)
    end = begin + src.numel()

    dst_dtype = None
    ranges = []
    memory = []
    dsts: list[int] = []
    numels: list[int] = []
    on_device = _device_test(device)
    for i, t in enumerate(tensors):
        if t is None:
            raise TypeError(f"tensors[{i}] is None; unflatten needs a destination tensor for every offset")
        if not (isinstance(t, torch.Tensor) and t.dtype in _SUPPORTED and on_device(t) and t.is_contiguous()):
            check_tensor(f"tensors[{i}]", t, dtypes=SUPPORTED_DTYPES, device=device)
        if dst_dtype is None:
            dst_dtype = t.dtype
        elif t.dtype != dst_dtype:
            raise TypeError(
                f"tensors[{i}] has dtype {t.dtype} but earlier tensors have {dst_dtype}; all destinations "
                "must share one dtype (unflatten each dtype group separately)"
            )
        n = t.numel()
        ptr = t.data_ptr() if n > 0 else 0
        numels.append(n)
        dsts.append(ptr)
        if n > 0:
            ranges.append((offs[i], offs[i] + n, i))
            memory.append((ptr, ptr + n * t.element_size(), i))
    _check_disjoint(ranges, "tensor ranges in the bucket overlap")
    if not memory:
        return
    # Destinations written in parallel must not alias each other or the source.
    if any(m1[0] < m0[1] for m0, m1 in zip(memory, memory[1:])):  # not already in ascending order
        memory.sort()
        for (_s0, e0, i0), (s1, _e1, i1) in zip(memory, memory[1:]):
            if s1 < e0:
                a, b = sorted((i0, i1))
                raise ValueError(f"tensors[{a}] and tensors[{b}] share memory; pass distinct tensors")
    if src.numel() > 0:
        src_lo, src_hi = _byte_range(src)
        for lo, hi, i in memory:
            if lo < src_hi and src_lo < hi:
                raise ValueError(f"tensors[{i}] shares memory with src; copy src first (src.clone())")

    launch(
        "unflatten",
        device,
        dsts=dsts,
        numels=numels,
        offsets=offs,
        src_dtype=DTYPE_IDS[src.dtype],
        dst_dtype=DTYPE_IDS[dst_dtype],
        src=addr(src),
        begin=begin,
        end=end,
        num_threads=nt,
    )
