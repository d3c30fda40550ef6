"""The wire format: one message (a *frame*) per push, reply or close: a fixed int64 header, then one flat
byte payload, in a single uint8 buffer. Nothing is ever unpickled.

Header (``HEADER_LEN`` int64, in this order)::

    0 magic        MAGIC ("PYASYNC\\x01" as little-endian int64)
    1 format       FORMAT_VERSION
    2 kind         PUSH (worker -> owner), REPLY (owner -> worker), CLOSE, PAUSE, RESUME (worker -> owner)
    3 sender       rank of the sender in the engine's group (must equal the rank it came from)
    4 clock        PUSH/CLOSE: the worker's clock; REPLY: the clock of the push it answers
    5 version      PUSH: shard version the gradient was computed on; REPLY: version of the values
    6 bucket       bucket index
    7 shard        shard index (= owner rank)
    8 codec        codec id (pyasync.ops._common.CODEC_IDS); REPLY: 0 (fp32 values)
    9 numel        elements of the shard
   10 nbytes       bytes of the payload that follows (0: no payload message)
   11 k            top-k kept elements, else 0
   12 block        int8/sign block size, else 0
   13 flags        FLAG_FINITE, FLAG_FINAL
   14 count        PUSH: mask entries (parameters overlapping the shard); REPLY: workers in the clock vector
   15 check        checksum of fields 0..14

Push payload: codes | scales or indices | mask (uint8 per overlapping parameter, 1 = has a gradient),
each part starting at a multiple of 8 bytes. Reply payload: numel fp32 values | count int64 clocks
(the highest clock of each worker fully included in the values).

A frame is ``HEADER_BYTES`` of header followed by exactly ``nbytes`` of payload. A receiver posts one
receive into a buffer of :meth:`WireSpec.max_push_frame` / :meth:`WireSpec.max_reply_frame` bytes,
the largest frame its own layout allows (gloo accepts a message up to the posted size), so no size a
peer announces ever sizes an allocation. Receivers check every field against what they expect
(:meth:`WireSpec.check_push`, :meth:`WireSpec.check_reply`) before looking at the payload, and raise
:class:`WireError` naming the sender and the field. See Note [One message per push] in
docs/architecture.md for why header and payload travel together.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pyasync.ops._common import CODEC_IDS, CODEC_NAMES, Payload

__all__ = [
    "CLOSE",
    "FLAG_FINAL",
    "FramePool",
    "PushFrame",
    "ReplyFrame",
    "FLAG_FINITE",
    "FORMAT_VERSION",
    "HEADER_LEN",
    "MAGIC",
    "PAUSE",
    "PUSH",
    "REPLY",
    "RESUME",
    "Header",
    "WireError",
    "WireSpec",
    "HEADER_BYTES",
    "encode_header",
    "frame_body",
    "frame_header",
    "pack_push",
    "pack_reply",
    "parse_header",
    "push_parts",
    "reply_parts",
    "to_host",
    "unpack_push",
    "unpack_reply",
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
_ALIGN = 8
MAX_CLOCK = 1 << 60  # clocks and versions above this are corrupt

_CODE_DTYPES = {
    "none": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "sign": torch.uint8,
    "topk": torch.float32,
}


_ELEM_SIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in set(_CODE_DTYPES.values()) | {torch.int32, torch.int64}}


class WireError(ValueError):
    """A message that does not fit the protocol (corrupt, or a peer running something else)."""


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


def encode_header(h: Header, out: torch.Tensor | None = None) -> torch.Tensor:
    """The header as an int64 tensor of HEADER_LEN elements (written into ``out`` when given)."""
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
        h.nbytes,
        h.k,
        h.block,
        h.flags,
        h.count,
    ]
    f.append(_checksum(f))
    t = torch.tensor(f, dtype=torch.int64)
    if out is None:
        return t
    out.copy_(t)
    return out


def parse_header(t: torch.Tensor, src: int) -> Header:
    """Check the fields every message shares (magic, format, kind, checksum, sender == src, ranges)
    and return the Header. ``src`` is the rank the message came from."""
    if t.dtype != torch.int64 or t.numel() != HEADER_LEN:
        raise WireError(f"header from rank {src} must be {HEADER_LEN} int64, got {t.numel()} {t.dtype}")
    f = [int(x) for x in t.tolist()]
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
    names = dict(zip(_FIELDS, f))
    for name in ("clock", "version", "bucket", "shard", "codec", "numel", "nbytes", "k", "block", "count"):
        v = names[name]
        lo = -1 if name in ("clock", "version") else 0
        if v < lo or v > MAX_CLOCK:
            raise WireError(f"{KIND_NAMES[f[2]]} from rank {src} has {name}={v} out of range")
    if f[13] & ~_KNOWN_FLAGS:
        raise WireError(f"{KIND_NAMES[f[2]]} from rank {src} has unknown flags {f[13]:#x}")
    return Header(
        kind=f[2],
        sender=f[3],
        clock=f[4],
        version=f[5],
        bucket=f[6],
        shard=f[7],
        codec=f[8],
        numel=f[9],
        nbytes=f[10],
        k=f[11],
        block=f[12],
        flags=f[13],
        count=f[14],
    )


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def push_parts(codec: str, n: int, block: int, k: int, mask_len: int) -> tuple[tuple[tuple, ...], int]:
    """[(name, dtype, numel, byte offset)] of a push payload and its total bytes (cached: the same
    few layouts recur every step)."""
    if codec not in _CODE_DTYPES:
        raise WireError(f"unknown codec {codec!r}")
    return _push_parts(codec, n, block, k, mask_len)


@functools.lru_cache(maxsize=4096)
def _push_parts(codec: str, n: int, block: int, k: int, mask_len: int) -> tuple[tuple[tuple, ...], int]:
    if codec in ("none", "fp16", "bf16"):
        shapes = [("codes", _CODE_DTYPES[codec], n)]
    elif codec == "int8":
        shapes = [("codes", torch.int8, n), ("scales", torch.float32, -(-n // block))]
    elif codec == "sign":
        shapes = [("codes", torch.uint8, -(-n // 8)), ("scales", torch.float32, -(-n // block))]
    else:  # topk
        shapes = [("codes", torch.float32, k), ("indices", torch.int32, k)]
    shapes.append(("mask", torch.uint8, mask_len))
    parts, off = [], 0
    for name, dt, numel in shapes:
        parts.append((name, dt, numel, off))
        off = _pad(off + numel * _ELEM_SIZE[dt])
    return tuple(parts), off


@functools.lru_cache(maxsize=4096)
def reply_parts(n: int, world_size: int) -> tuple[tuple[tuple, ...], int]:
    values = _pad(4 * n)
    return (
        ("values", torch.float32, n, 0),
        ("clocks", torch.int64, world_size, values),
    ), values + 8 * world_size


def _views(buf: torch.Tensor, parts: Sequence[tuple]) -> dict[str, torch.Tensor]:
    out = {}
    for name, dt, numel, off in parts:
        out[name] = buf[off : off + numel * _ELEM_SIZE[dt]].view(dt)
    return out


def _zero_padding(buf: torch.Tensor, parts: Sequence[tuple], total: int) -> None:
    """Zero the alignment gaps between parts (and after the last one) of a freshly allocated buffer,
    so no stale process memory goes on the wire; the parts themselves are overwritten by the caller."""
    for i, (_, dt, numel, off) in enumerate(parts):
        end = off + numel * _ELEM_SIZE[dt]
        nxt = parts[i + 1][3] if i + 1 < len(parts) else total
        if nxt > end:
            buf[end:nxt].zero_()


def _check_buffer(buf: torch.Tensor, total: int, h: Header) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != total or buf.numel() != h.nbytes:
        raise WireError(
            f"{KIND_NAMES.get(h.kind, h.kind)} payload from rank {h.sender} is {buf.numel()} {buf.dtype} elements, "
            f"expected {total} uint8 bytes (header says {h.nbytes})"
        )
    if not buf.is_contiguous() or buf.data_ptr() % 8 != 0:
        raise WireError(
            f"{KIND_NAMES.get(h.kind, h.kind)} payload buffer from rank {h.sender} must be contiguous and "
            f"8-byte aligned (receive into a fresh buffer)"
        )


def _frame(total: int, header: Header | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, body): a fresh uint8 buffer for ``total`` payload bytes, with room for a header in
    front when one is given (written with nbytes = total)."""
    off = 0 if header is None else HEADER_BYTES
    buf = torch.empty(off + total, dtype=torch.uint8, device=device)
    if header is not None:
        _seal(buf, header, total)
    return buf, buf[off:]


def _seal(buf: torch.Tensor, header: Header, nbytes: int) -> None:
    """Write ``header``, its nbytes set to the payload size, at the front of frame ``buf``."""
    encode_header(dataclasses.replace(header, nbytes=nbytes), out=buf[:HEADER_BYTES].view(torch.int64))


def next_frame(ring: list, timeout):
    """Take the least recently used of a list of reusable send frames (PushFrame / ReplyFrame), after
    waiting (at most ``timeout``) for the send it carried last; it goes to the back of the list."""
    fr = ring.pop(0)
    ring.append(fr)
    if fr.handle is not None:
        fr.handle.wait(timeout)
        fr.handle = None
    return fr


def pack_push(
    payload: Payload, mask: torch.Tensor, *, header: Header | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """One uint8 buffer holding the payload tensors and the mask (see push_parts); with ``header``, the
    whole frame: the header (its nbytes set to the payload size) and then the payload."""
    parts, total = push_parts(payload.codec, payload.n, payload.block, payload.k, mask.numel())
    buf, body = _frame(total, header, device if device is not None else payload.device)
    _zero_padding(body, parts, total)  # the alignment padding must not carry stale process memory
    views = _views(body, parts)
    src = {"codes": payload.codes, "scales": payload.scales, "indices": payload.indices, "mask": mask}
    for name, v in views.items():
        if v.numel():
            v.copy_(src[name].reshape(-1))
    return buf


def frame_header(frame: torch.Tensor, src: int) -> Header:
    """Parse (parse_header) the header at the front of a received frame; ``src`` is the sender."""
    if frame.dtype != torch.uint8 or frame.dim() != 1 or frame.numel() < HEADER_BYTES:
        raise WireError(
            f"a frame from rank {src} must be a 1-D uint8 buffer of at least {HEADER_BYTES} bytes, got "
            f"{tuple(frame.shape)} {frame.dtype}"
        )
    if not frame.is_contiguous() or frame.data_ptr() % 8 != 0:
        raise WireError(f"frame buffer for rank {src} must be contiguous and 8-byte aligned")
    return parse_header(frame[:HEADER_BYTES].view(torch.int64), src)


def frame_body(frame: torch.Tensor, h: Header) -> torch.Tensor:
    """The payload of a received frame whose header ``h`` has been checked: its h.nbytes bytes."""
    if HEADER_BYTES + h.nbytes > frame.numel():
        raise WireError(
            f"{KIND_NAMES.get(h.kind, h.kind)} from rank {h.sender} announces {h.nbytes} payload bytes, "
            f"more than the {frame.numel() - HEADER_BYTES} its receive buffer holds"
        )
    return frame[HEADER_BYTES : HEADER_BYTES + h.nbytes]


def unpack_push(buf: torch.Tensor, h: Header) -> tuple[Payload, torch.Tensor]:
    """(Payload of views into buf, uint8 mask) of a checked push."""
    codec = CODEC_NAMES.get(h.codec)
    if codec is None:
        raise WireError(f"PUSH from rank {h.sender} has an unknown codec id {h.codec}")
    parts, total = push_parts(codec, h.numel, h.block, h.k, h.count)
    _check_buffer(buf, total, h)
    v = _views(buf, parts)
    p = Payload(
        codec=codec,
        n=h.numel,
        codes=v["codes"],
        scales=v.get("scales"),
        indices=v.get("indices"),
        k=h.k,
        block=h.block,
        finite=h.finite,
    )
    return p, v["mask"]


class PushFrame:
    """A reusable send buffer for the pushes of one (bucket, shard) on the CPU: header | codes |
    scales or indices | mask. ``payload`` and ``mask`` are views into it, so the encoder writes the
    payload in place (no allocation, no copy); :meth:`seal` writes the header. Zeroed once, so the
    alignment padding never carries stale memory. ``handle``: its last send, waited before reuse."""

    def __init__(self, codec: str, n: int, block: int, k: int, mask_len: int) -> None:
        parts, self.nbytes = push_parts(codec, n, block, k, mask_len)
        self.buf = torch.zeros(HEADER_BYTES + self.nbytes, dtype=torch.uint8)
        v = _views(self.buf[HEADER_BYTES:], parts)
        self.payload = Payload(
            codec=codec, n=n, codes=v["codes"], scales=v.get("scales"), indices=v.get("indices"), k=k, block=block
        )
        self.mask = v["mask"]
        self.handle = None

    def seal(self, header: Header) -> torch.Tensor:
        """Write ``header`` (its nbytes set to the payload size) in front; returns the frame."""
        _seal(self.buf, header, self.nbytes)
        return self.buf


class ReplyFrame:
    """A reusable send buffer for the replies of one shard to one worker on the CPU: header | fp32
    values | clocks. Zeroed once (no stale padding). ``handle``: its last send, waited before reuse."""

    def __init__(self, n: int, world_size: int) -> None:
        parts, self.nbytes = reply_parts(n, world_size)
        self.buf = torch.zeros(HEADER_BYTES + self.nbytes, dtype=torch.uint8)
        v = _views(self.buf[HEADER_BYTES:], parts)
        self.values, self.clocks = v["values"], v["clocks"]
        self.handle = None

    def fill(self, header: Header, values: torch.Tensor, clocks: torch.Tensor) -> torch.Tensor:
        """Copy the values (a snapshot: later updates never reach a frame in flight) and the clock
        vector, write the header; returns the frame."""
        self.values.copy_(values)
        self.clocks.copy_(clocks)
        _seal(self.buf, header, self.nbytes)
        return self.buf


class FramePool:
    """Receive buffers of one size, recycled: a receiver takes one (or a new one when none is free), and
    whoever consumes the message gives it back once nothing reads it any more. At most ``keep`` free
    buffers are kept; more are dropped, so a backlog (an ASP owner behind its pushes) does not pin
    its peak in memory for good. A buffer that is never given back (an error path) is simply
    garbage-collected. Thread-safe."""

    def __init__(self, nbytes: int, keep: int = 8) -> None:
        self.nbytes = nbytes
        self.keep = keep
        self.allocated = 0  # buffers made so far (for tests and stats: flat in steady state)
        self._free: queue.SimpleQueue = queue.SimpleQueue()

    def get(self) -> torch.Tensor:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            self.allocated += 1
            return torch.empty(self.nbytes, dtype=torch.uint8)

    def put(self, buf: torch.Tensor | None) -> None:
        if buf is not None and self._free.qsize() < self.keep:
            self._free.put(buf)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself on the CPU, else a copy in pinned host memory (for the gloo transport). The copy is
    synchronous, so the host buffer is complete (and the device tensor free to change) on return."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def pack_reply(values: torch.Tensor, clocks: Sequence[int], *, header: Header | None = None) -> torch.Tensor:
    """One uint8 buffer with the values and the clock vector (see reply_parts); with ``header``, the
    whole frame (header first, its nbytes set to the payload size)."""
    parts, total = reply_parts(values.numel(), len(clocks))
    buf, body = _frame(total, header, values.device)
    _zero_padding(body, parts, total)  # no stale bytes in the padding
    v = _views(body, parts)
    v["values"].copy_(values.reshape(-1))
    v["clocks"].copy_(torch.tensor(list(clocks), dtype=torch.int64))
    return buf


def unpack_reply(buf: torch.Tensor, h: Header) -> tuple[torch.Tensor, list[int]]:
    parts, total = reply_parts(h.numel, h.count)
    _check_buffer(buf, total, h)
    v = _views(buf, parts)
    return v["values"], [int(c) for c in v["clocks"].tolist()]


class WireSpec:
    """What this rank expects in messages: the bucket/shard sizes and the agreed codec.

    shard_numels[b][r]: elements of shard r of bucket b; mask_lens[b][r]: parameters overlapping it;
    codec: the agreed codec name; block: the agreed block (int8/sign); topk_k: n -> k (top-k)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        shard_numels: Sequence[Sequence[int]],
        mask_lens: Sequence[Sequence[int]],
        codec: str,
        block: int,
        topk_k: Callable[[int], int] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.shard_numels = [list(x) for x in shard_numels]
        self.mask_lens = [list(x) for x in mask_lens]
        self.codec = codec
        self.codec_id = CODEC_IDS[codec]
        self.block = block if codec in ("int8", "sign") else 0
        self.topk_k = topk_k

    def push_bytes(self, bucket: int, shard: int) -> int:
        """Payload bytes of a push to shard ``shard`` of ``bucket`` under the agreed codec."""
        n = self.shard_numels[bucket][shard]
        k = self.topk_k(n) if self.codec == "topk" and n > 0 else 0
        return push_parts(self.codec, n, self.block, k, self.mask_lens[bucket][shard])[1]

    def max_push_frame(self) -> int:
        """Bytes of the largest frame a worker may send this rank (a PUSH to one of its non-empty
        shards, or a CLOSE): the size of the owner's receive buffer."""
        sizes = [self.push_bytes(b, self.rank) for b, row in enumerate(self.shard_numels) if row[self.rank] > 0]
        return HEADER_BYTES + max(sizes, default=0)

    def max_reply_frame(self) -> int:
        """Bytes of the largest frame an owner may send this rank (a REPLY for a non-empty shard of
        another rank): the size of the worker's receive buffer."""
        sizes = [
            reply_parts(n, self.world_size)[1]
            for row in self.shard_numels
            for r, n in enumerate(row)
            if n > 0 and r != self.rank
        ]
        return HEADER_BYTES + max(sizes, default=0)

    def _bucket(self, h: Header, what: str) -> None:
        if not 0 <= h.bucket < len(self.shard_numels):
            raise WireError(
                f"{what} from rank {h.sender} names bucket {h.bucket}, but there are "
                f"{len(self.shard_numels)} buckets"
            )
        if not 0 <= h.shard < self.world_size:
            raise WireError(f"{what} from rank {h.sender} names shard {h.shard} of {self.world_size}")
        n = self.shard_numels[h.bucket][h.shard]
        if h.numel != n:
            raise WireError(
                f"{what} from rank {h.sender} for bucket {h.bucket} shard {h.shard} has numel "
                f"{h.numel}, expected {n}"
            )

    def check_push(self, h: Header) -> None:
        """Validate a PUSH header addressed to this rank (before receiving its payload)."""
        if h.kind != PUSH:
            raise WireError(f"expected a PUSH from rank {h.sender}, got {KIND_NAMES[h.kind]}")
        if h.shard != self.rank:
            raise WireError(f"PUSH from rank {h.sender} is for shard {h.shard}, but this is rank {self.rank}")
        self._bucket(h, "PUSH")
        if h.clock < 0 or h.version < 0:
            raise WireError(
                f"PUSH from rank {h.sender} has a negative clock/version ({h.clock}, {h.version})"
            )
        if h.codec != self.codec_id:
            got = CODEC_NAMES.get(h.codec, f"id {h.codec}")
            raise WireError(f"PUSH from rank {h.sender} uses codec {got}, the agreed codec is {self.codec}")
        want_block = self.block
        if h.block != want_block:
            raise WireError(f"PUSH from rank {h.sender} has block {h.block}, expected {want_block}")
        want_k = self.topk_k(h.numel) if self.codec == "topk" else 0
        if h.k != want_k:
            raise WireError(f"PUSH from rank {h.sender} has k={h.k}, expected {want_k}")
        want_mask = self.mask_lens[h.bucket][h.shard]
        if h.count != want_mask:
            raise WireError(f"PUSH from rank {h.sender} has {h.count} mask entries, expected {want_mask}")
        if h.final:
            raise WireError(f"PUSH from rank {h.sender} carries the FINAL flag")
        _, total = push_parts(self.codec, h.numel, h.block, h.k, h.count)
        if h.nbytes != total:
            raise WireError(f"PUSH from rank {h.sender} announces {h.nbytes} payload bytes, expected {total}")

    def check_reply(self, h: Header) -> None:
        """Validate a REPLY header addressed to this rank."""
        if h.kind != REPLY:
            raise WireError(f"expected a REPLY from rank {h.sender}, got {KIND_NAMES[h.kind]}")
        if h.shard != h.sender:
            raise WireError(f"REPLY from rank {h.sender} carries shard {h.shard}, which it does not own")
        self._bucket(h, "REPLY")
        if h.codec != 0 or h.k != 0 or h.block != 0:
            raise WireError(
                f"REPLY from rank {h.sender} has codec/k/block {h.codec}/{h.k}/{h.block}, expected 0/0/0"
            )
        if h.count != self.world_size:
            raise WireError(f"REPLY from rank {h.sender} has {h.count} clocks, expected {self.world_size}")
        _, total = reply_parts(h.numel, h.count)
        if h.nbytes != total:
            raise WireError(
                f"REPLY from rank {h.sender} announces {h.nbytes} payload bytes, expected {total}"
            )

    def check_close(self, h: Header) -> None:
        """Validate a header-only control frame (CLOSE, PAUSE, RESUME)."""
        if h.kind not in CONTROL_KINDS:
            raise WireError(f"expected CLOSE, PAUSE or RESUME from rank {h.sender}, got {KIND_NAMES[h.kind]}")
        if h.nbytes != 0 or h.clock < 0:
            raise WireError(f"{KIND_NAMES[h.kind]} from rank {h.sender} has nbytes={h.nbytes}, clock={h.clock}")
