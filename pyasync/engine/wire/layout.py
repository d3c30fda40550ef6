"""Payload layouts of push and reply frames, and views of them.

A frame is ``HEADER_BYTES`` of header (wire/header.py) followed by exactly ``nbytes`` of payload:

* push payload: the payload tensors of its codec (``ops._common.payload_parts``: codes, then scales or
  indices) | mask (uint8 per parameter overlapping the shard, 1 = has a gradient);
* reply payload: numel fp32 values | count int64 clocks (the highest clock of each worker fully
  included in the values);
* coded reply payload (a lossy codec, Note [Compressed replies] in engine/core/replies.py): the payload
  tensors of the codec, encoding the change since the values the worker holds | count int64 clocks.

Each part starts at a multiple of 8 bytes; the alignment padding is zero, so no stale process memory
goes on the wire. The engine writes pushes and replies straight into reused frames through the views
of :func:`push_views` / :func:`reply_views`; :func:`unpack_push` / :func:`unpack_reply` view a
received payload after its header was checked, and :func:`unpack_push` also checks top-k indices, so
a remote payload is validated once, here (the kernels then trust it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from pyasync.engine.wire.header import HEADER_BYTES, KIND_NAMES, Header, seal
from pyasync.errors import WireError
from pyasync.ops._common import CODE_DTYPES, CODEC_NAMES, Payload, payload_parts

__all__ = [
    "coded_reply_parts",
    "coded_reply_views",
    "pack_push",
    "pack_reply",
    "push_parts",
    "push_views",
    "reply_parts",
    "reply_views",
    "unpack_coded_reply",
    "unpack_push",
    "unpack_reply",
]

_ALIGN = 8
Parts = tuple[tuple[str, torch.dtype, int, int], ...]  # (name, dtype, numel, byte offset)


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(shapes: Sequence[tuple[str, torch.dtype, int]]) -> tuple[Parts, int]:
    parts, off = [], 0
    for name, dt, numel in shapes:
        parts.append((name, dt, numel, off))
        off = _pad(off + numel * dt.itemsize)
    return tuple(parts), off


def push_parts(codec: str, n: int, block: int, k: int, mask_len: int) -> tuple[Parts, int]:
    """[(name, dtype, numel, byte offset)] of a push payload and its total bytes (cached: the same
    few layouts recur every step)."""
    if codec not in CODE_DTYPES:
        raise WireError(f"unknown codec {codec!r}")
    return _push_parts(codec, n, block, k, mask_len)


@functools.lru_cache(maxsize=4096)
def _push_parts(codec: str, n: int, block: int, k: int, mask_len: int) -> tuple[Parts, int]:
    return _layout([*payload_parts(codec, n, block, k), ("mask", torch.uint8, mask_len)])


@functools.lru_cache(maxsize=4096)
def reply_parts(n: int, world_size: int) -> tuple[Parts, int]:
    """The same for a reply: n fp32 values, then ``world_size`` int64 clocks."""
    return _layout([("values", torch.float32, n), ("clocks", torch.int64, world_size)])


@functools.lru_cache(maxsize=4096)
def coded_reply_parts(codec: str, n: int, block: int, k: int, world_size: int) -> tuple[Parts, int]:
    """The same for a coded reply: the codec's payload tensors, then ``world_size`` int64 clocks."""
    if codec not in CODE_DTYPES:
        raise WireError(f"unknown codec {codec!r}")
    return _layout([*payload_parts(codec, n, block, k), ("clocks", torch.int64, world_size)])


def _views(buf: torch.Tensor, parts: Parts) -> dict[str, torch.Tensor]:
    return {name: buf[off : off + numel * dt.itemsize].view(dt) for name, dt, numel, off in parts}


def _payload(
    v: dict[str, torch.Tensor], codec: str, n: int, block: int, k: int, finite: bool = True
) -> Payload:
    """The Payload of a codec's views ``v`` (codes, then scales or indices)."""
    return Payload(
        codec=codec,
        n=n,
        codes=v["codes"],
        scales=v.get("scales"),
        indices=v.get("indices"),
        k=k,
        block=block,
        finite=finite,
    )


def _zero_padding(body: torch.Tensor, parts: Parts, total: int) -> None:
    """Zero the alignment gaps between parts (and after the last one)."""
    for i, (_, dt, numel, off) in enumerate(parts):
        end = off + numel * dt.itemsize
        nxt = parts[i + 1][3] if i + 1 < len(parts) else total
        if nxt > end:
            body[end:nxt].zero_()


def push_views(frame: torch.Tensor, codec: str, n: int, block: int, k: int, mask_len: int):
    """(Payload of views, mask view, payload bytes) of a push laid out in ``frame`` (header first);
    the padding is zeroed once here, the parts are the encoder's to write."""
    parts, total = push_parts(codec, n, block, k, mask_len)
    body = frame[HEADER_BYTES : HEADER_BYTES + total]
    _zero_padding(body, parts, total)
    v = _views(body, parts)
    return _payload(v, codec, n, block, k), v["mask"], total


def reply_views(frame: torch.Tensor, n: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values view, clocks view, payload bytes) of a reply laid out in ``frame`` (header first)."""
    parts, total = reply_parts(n, world_size)
    body = frame[HEADER_BYTES : HEADER_BYTES + total]
    _zero_padding(body, parts, total)
    v = _views(body, parts)
    return v["values"], v["clocks"], total


def coded_reply_views(frame: torch.Tensor, codec: str, n: int, block: int, k: int, world_size: int):
    """(Payload of views, clocks view, payload bytes) of a coded reply laid out in ``frame``."""
    parts, total = coded_reply_parts(codec, n, block, k, world_size)
    body = frame[HEADER_BYTES : HEADER_BYTES + total]
    _zero_padding(body, parts, total)
    v = _views(body, parts)
    return _payload(v, codec, n, block, k), v["clocks"], total


def _check_buffer(buf: torch.Tensor, total: int, h: Header) -> None:
    what = KIND_NAMES.get(h.kind, h.kind)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != total or buf.numel() != h.nbytes:
        raise WireError(
            f"{what} payload from rank {h.sender} is {buf.numel()} {buf.dtype} elements, "
            f"expected {total} uint8 bytes (header says {h.nbytes})"
        )
    if not buf.is_contiguous() or buf.data_ptr() % 8 != 0:
        raise WireError(
            f"{what} payload buffer from rank {h.sender} must be contiguous and 8-byte aligned "
            "(receive into a fresh buffer)"
        )


def pack_push(
    payload: Payload, mask: torch.Tensor, *, header: Header | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """A fresh uint8 buffer holding the payload tensors and the mask; with ``header``, the whole frame:
    the header (its nbytes set to the payload size) and then the payload."""
    parts, total = push_parts(payload.codec, payload.n, payload.block, payload.k, mask.numel())
    off = 0 if header is None else HEADER_BYTES
    buf = torch.empty(off + total, dtype=torch.uint8, device=device if device is not None else payload.device)
    body = buf[off:]
    _zero_padding(body, parts, total)
    src = {"codes": payload.codes, "scales": payload.scales, "indices": payload.indices, "mask": mask}
    for name, v in _views(body, parts).items():
        if v.numel():
            v.copy_(src[name].reshape(-1))
    if header is not None:
        seal(buf, header, total)
    return buf


def pack_reply(values: torch.Tensor, clocks: Sequence[int], *, header: Header | None = None) -> torch.Tensor:
    """A fresh uint8 buffer with the values and the clock vector; with ``header``, the whole frame."""
    parts, total = reply_parts(values.numel(), len(clocks))
    off = 0 if header is None else HEADER_BYTES
    buf = torch.empty(off + total, dtype=torch.uint8, device=values.device)
    body = buf[off:]
    _zero_padding(body, parts, total)
    v = _views(body, parts)
    v["values"].copy_(values.reshape(-1))
    v["clocks"].copy_(torch.tensor(list(clocks), dtype=torch.int64))
    if header is not None:
        seal(buf, header, total)
    return buf


def _check_topk(indices: torch.Tensor, n: int, h: Header) -> None:
    if indices.numel() == 0:
        return
    what = KIND_NAMES.get(h.kind, h.kind)
    lo, hi = int(indices[0]), int(indices[-1])
    if lo < 0 or hi >= n:
        raise WireError(f"{what} from rank {h.sender}: top-k indices lie in [{lo}, {hi}], outside [0, {n})")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise WireError(
            f"{what} from rank {h.sender}: top-k indices are not strictly ascending (corrupt payload)"
        )


def _unpack_payload(buf: torch.Tensor, h: Header, codec: str, parts: Parts, total: int):
    """(views, Payload) of a checked header's payload in ``buf``: the buffer's size and alignment, then
    top-k indices in range and ascending (the kernels trust them)."""
    _check_buffer(buf, total, h)
    v = _views(buf, parts)
    p = _payload(v, codec, h.numel, h.block, h.k, h.finite)
    if p.indices is not None and buf.device.type == "cpu":
        _check_topk(p.indices, h.numel, h)
    return v, p


def unpack_push(buf: torch.Tensor, h: Header) -> tuple[Payload, torch.Tensor]:
    """(Payload of views into buf, uint8 mask) of a push whose header was checked. Validates what the
    header cannot: top-k indices in range and ascending, mask bytes 0/1."""
    codec = CODEC_NAMES.get(h.codec)
    if codec is None:
        raise WireError(f"PUSH from rank {h.sender} has an unknown codec id {h.codec}")
    v, p = _unpack_payload(buf, h, codec, *push_parts(codec, h.numel, h.block, h.k, h.count))
    mask = v["mask"]
    if mask.numel() and int(mask.max()) > 1:
        raise WireError(f"PUSH from rank {h.sender} for bucket {h.bucket} has mask bytes other than 0/1")
    return p, mask


def unpack_reply(buf: torch.Tensor, h: Header) -> tuple[torch.Tensor, list[int]]:
    """(values view, clocks) of a reply whose header was checked."""
    parts, total = reply_parts(h.numel, h.count)
    _check_buffer(buf, total, h)
    v = _views(buf, parts)
    return v["values"], [int(c) for c in v["clocks"].tolist()]


def unpack_coded_reply(buf: torch.Tensor, h: Header) -> tuple[Payload, list[int]]:
    """(Payload of views into buf, clocks) of a coded reply whose header was checked; top-k indices are
    checked here (in range, ascending), as for a push."""
    codec = CODEC_NAMES.get(h.codec)
    if codec is None:
        raise WireError(f"REPLY from rank {h.sender} has an unknown codec id {h.codec}")
    v, p = _unpack_payload(buf, h, codec, *coded_reply_parts(codec, h.numel, h.block, h.k, h.count))
    return p, [int(c) for c in v["clocks"].tolist()]
