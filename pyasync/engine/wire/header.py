"""Message headers: a fixed block of ``HEADER_LEN`` int64 at the front of every frame.

Header fields, in this order::

    0 magic        MAGIC ("PYASYNC\\x01" as little-endian int64)
    1 format       FORMAT_VERSION
    2 kind         PUSH (worker -> owner), REPLY (owner -> worker), CLOSE, PAUSE, RESUME (worker -> owner)
    3 sender       rank of the sender in the engine's group (must equal the rank it came from)
    4 clock        PUSH/CLOSE: the worker's clock; REPLY: the clock of the push it answers
    5 version      PUSH: shard version the gradient was computed on; REPLY: version of the values
    6 bucket       bucket index
    7 shard        shard index (= owner rank)
    8 codec        codec id (pyasync.ops._common.CODEC_IDS); REPLY: 0 (exact) or the agreed codec (coded)
    9 numel        elements of the shard
   10 nbytes       bytes of the payload that follows (0: no payload)
   11 k            top-k kept elements, else 0
   12 block        int8/sign block size, else 0
   13 flags        FLAG_FINITE, FLAG_FINAL
   14 count        PUSH: mask entries (parameters overlapping the shard); REPLY: workers in the clock vector
   15 check        checksum of fields 0..14

:func:`parse_header` checks what every message shares (magic, format, checksum, kind, sender, value
ranges, flags); :class:`pyasync.engine.wire.spec.WireSpec` checks the rest against this rank's layout.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pyasync.errors import WireError

__all__ = [
    "CLOSE",
    "CONTROL_KINDS",
    "FLAG_FINAL",
    "FLAG_FINITE",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "HEADER_LEN",
    "KIND_NAMES",
    "MAGIC",
    "MAX_CLOCK",
    "PAUSE",
    "PUSH",
    "REPLY",
    "RESUME",
    "Header",
    "encode_header",
    "frame_body",
    "frame_header",
    "parse_header",
    "put_ints",
    "seal",
]

HEADER_LEN = 16
HEADER_BYTES = HEADER_LEN * 8
MAGIC = int.from_bytes(b"PYASYNC\x01", "little")
FORMAT_VERSION = 2  # 2: one frame per message (header + payload), PAUSE/RESUME
PUSH, REPLY, CLOSE, PAUSE, RESUME = 1, 2, 3, 4, 5
KIND_NAMES = {PUSH: "PUSH", REPLY: "REPLY", CLOSE: "CLOSE", PAUSE: "PAUSE", RESUME: "RESUME"}
CONTROL_KINDS = (CLOSE, PAUSE, RESUME)  # header-only frames on the push flow
FLAG_FINITE = 1
FLAG_FINAL = 2
_KNOWN_FLAGS = FLAG_FINITE | FLAG_FINAL
_FIELDS = (
    "magic",
    "format",
    "kind",
    "sender",
    "clock",
    "version",
    "bucket",
    "shard",
    "codec",
    "numel",
    "nbytes",
    "k",
    "block",
    "flags",
    "count",
    "check",
)
_MASK63 = (1 << 63) - 1
MAX_CLOCK = 1 << 60  # clocks and versions above this are corrupt


def _checksum(fields: Sequence[int]) -> int:
    c = 0x2545F4914F6CDD1D
    for f in fields:
        c = ((c ^ (int(f) & ((1 << 64) - 1))) * 0x100000001B3) & ((1 << 64) - 1)
    return c & _MASK63


@dataclass(frozen=True)
class Header:
    kind: int
    sender: int
    clock: int
    version: int
    bucket: int
    shard: int
    codec: int
    numel: int
    nbytes: int
    k: int = 0
    block: int = 0
    flags: int = 0
    count: int = 0

    @property
    def finite(self) -> bool:
        return bool(self.flags & FLAG_FINITE)

    @property
    def final(self) -> bool:
        return bool(self.flags & FLAG_FINAL)


_HDR = struct.Struct("<16q")  # the header's bytes (int64 little-endian: a CPU int64 tensor's layout)
_RANGED = tuple(  # (field index, name, lowest value) of the fields checked against [lo, MAX_CLOCK]
    (i, name, -1 if name in ("clock", "version") else 0)
    for i, name in enumerate(_FIELDS)
    if name in ("clock", "version", "bucket", "shard", "codec", "numel", "nbytes", "k", "block", "count")
)


def _fields(h: Header, nbytes: int) -> list[int]:
    f = [
        MAGIC,
        FORMAT_VERSION,
        h.kind,
        h.sender,
        h.clock,
        h.version,
        h.bucket,
        h.shard,
        h.codec,
        h.numel,
        nbytes,
        h.k,
        h.block,
        h.flags,
        h.count,
    ]
    f.append(_checksum(f))
    return f


def encode_header(h: Header, out: torch.Tensor | None = None) -> torch.Tensor:
    """The header as an int64 tensor of HEADER_LEN elements (written into ``out`` when given)."""
    f = _fields(h, h.nbytes)
    if out is None:
        return torch.tensor(f, dtype=torch.int64)
    put_ints(out, f)
    return out


def parse_header(t: torch.Tensor, src: int) -> Header:
    """Check the fields every message shares (magic, format, kind, checksum, sender == src, ranges)
    and return the Header. ``src`` is the rank the message came from."""
    if t.dtype != torch.int64 or t.numel() != HEADER_LEN:
        raise WireError(f"header from rank {src} must be {HEADER_LEN} int64, got {t.numel()} {t.dtype}")
    return _checked([int(x) for x in t.tolist()], src)


def _checked(f: list[int], src: int) -> Header:
    if f[0] != MAGIC:
        raise WireError(
            f"message from rank {src} has a bad magic number {f[0]:#x} (expected {MAGIC:#x}): "
            "not a pyasync message, or a corrupt one"
        )
    if f[1] != FORMAT_VERSION:
        raise WireError(
            f"message from rank {src} has wire format version {f[1]}, this rank speaks "
            f"{FORMAT_VERSION}: run the same pyasync version on every rank"
        )
    if f[15] != _checksum(f[:15]):
        raise WireError(f"header from rank {src} fails its checksum (corrupt message)")
    if f[2] not in KIND_NAMES:
        raise WireError(f"message from rank {src} has an unknown kind {f[2]}")
    if f[3] != src:
        raise WireError(f"message received from rank {src} claims sender {f[3]}")
    for i, name, lo in _RANGED:
        v = f[i]
        if v < lo or v > MAX_CLOCK:
            raise WireError(f"{KIND_NAMES[f[2]]} from rank {src} has {name}={v} out of range")
    if f[13] & ~_KNOWN_FLAGS:
        raise WireError(f"{KIND_NAMES[f[2]]} from rank {src} has unknown flags {f[13]:#x}")
    return Header(*f[2:15])


def seal(buf: torch.Tensor, header: Header, nbytes: int) -> None:
    """Write ``header``, its nbytes set to ``nbytes``, at the front of frame ``buf`` (any device)."""
    f = _fields(header, nbytes)
    if buf.device.type == "cpu" and buf.is_contiguous():
        _HDR.pack_into(buf.numpy(), 0, *f)
    else:
        buf[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(f, dtype=torch.int64))


def put_ints(t: torch.Tensor, values: Sequence[int]) -> None:
    """Write ``values`` into the 1-D tensor ``t`` (its dtype), without a temporary tensor on the CPU."""
    if t.device.type == "cpu" and t.is_contiguous():
        t.numpy()[:] = values
    else:
        t.copy_(torch.tensor(list(values), dtype=t.dtype))


def frame_header(frame: torch.Tensor, src: int) -> Header:
    """Parse (parse_header) the header at the front of a received frame; ``src`` is the sender."""
    if frame.dtype != torch.uint8 or frame.dim() != 1 or frame.numel() < HEADER_BYTES:
        raise WireError(
            f"a frame from rank {src} must be a 1-D uint8 buffer of at least {HEADER_BYTES} bytes, got "
            f"{tuple(frame.shape)} {frame.dtype}"
        )
    if not frame.is_contiguous() or frame.data_ptr() % 8 != 0:
        raise WireError(f"frame buffer for rank {src} must be contiguous and 8-byte aligned")
    if frame.device.type == "cpu":
        return _checked(list(_HDR.unpack_from(frame.numpy(), 0)), src)
    return parse_header(frame[:HEADER_BYTES].view(torch.int64), src)


def frame_body(frame: torch.Tensor, h: Header) -> torch.Tensor:
    """The payload of a received frame whose header ``h`` has been checked: its h.nbytes bytes."""
    if HEADER_BYTES + h.nbytes > frame.numel():
        raise WireError(
            f"{KIND_NAMES.get(h.kind, h.kind)} from rank {h.sender} announces {h.nbytes} payload bytes, "
            f"more than the {frame.numel() - HEADER_BYTES} its receive buffer holds"
        )
    return frame[HEADER_BYTES : HEADER_BYTES + h.nbytes]
