"""Hostile input for the wire decoder (pyasync.engine.wire): random, mutated and resealed headers, and
random payload bytes behind a valid header.

Property: whatever arrives, the receive path (a frame into a buffer sized by this rank's own layout
-> frame_header -> WireSpec.check_* -> frame_body -> unpack -> decode) either accepts a message that
exactly matches what this rank expects, or raises WireError (a ValueError) / ValueError / TypeError.
Never another exception, a crash, a hang or an allocation sized by a peer: the receive buffer is
fixed before anything arrives, a header is fully checked before h.nbytes is used, and an accepted
header's h.nbytes fits the buffer (asserted).

Hypothesis runs derandomized (the same examples on every run) with no deadline, so CI is stable.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pyasync.engine import wire
from pyasync.engine.wire import Header, WireError, WireSpec
from pyasync.ops import codecs as ops_codecs
from pyasync.ops._common import CODEC_IDS
from pyasync.reference import codecs as ref_codecs

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
RANK, WORLD = 1, 3
SHARD_NUMELS = [[5, 17, 1], [300, 257, 0], [8, 8, 8]]  # [bucket][shard]; rank 1 owns column 1
MASK_LENS = [[1, 2, 1], [3, 4, 0], [1, 1, 1]]
BLOCK = 16
ALLOWED = (ValueError, TypeError)  # WireError is a ValueError


def topk_k(n: int) -> int:
    return max(1, n // 4)


def make_spec(codec: str) -> WireSpec:
    return WireSpec(
        rank=RANK,
        world_size=WORLD,
        shard_numels=SHARD_NUMELS,
        mask_lens=MASK_LENS,
        codec=codec,
        block=BLOCK,
        topk_k=topk_k,
    )


def max_push_bytes(codec: str) -> int:
    """The largest payload any valid PUSH to this rank can announce: the bound on what the receive
    path may allocate."""
    best = 0
    for b, row in enumerate(SHARD_NUMELS):
        n = row[RANK]
        k = topk_k(n) if codec == "topk" else 0
        blk = BLOCK if codec in ("int8", "sign") else 0
        best = max(best, wire.push_parts(codec, n, blk, k, MASK_LENS[b][RANK])[1])
    return best


def valid_push(codec: str, bucket: int = 1, **kw) -> Header:
    n = SHARD_NUMELS[bucket][RANK]
    k = topk_k(n) if codec == "topk" else 0
    blk = BLOCK if codec in ("int8", "sign") else 0
    fields = {
        "kind": wire.PUSH,
        "sender": 0,
        "clock": 4,
        "version": 3,
        "bucket": bucket,
        "shard": RANK,
        "codec": CODEC_IDS[codec],
        "numel": n,
        "nbytes": wire.push_parts(codec, n, blk, k, MASK_LENS[bucket][RANK])[1],
        "k": k,
        "block": blk,
        "flags": wire.FLAG_FINITE,
        "count": MASK_LENS[bucket][RANK],
    }
    fields.update(kw)
    return Header(**fields)


def valid_reply(bucket: int = 0, sender: int = 2, **kw) -> Header:
    n = SHARD_NUMELS[bucket][sender]
    fields = {
        "kind": wire.REPLY,
        "sender": sender,
        "clock": 4,
        "version": 9,
        "bucket": bucket,
        "shard": sender,
        "codec": 0,
        "numel": n,
        "nbytes": wire.reply_parts(n, WORLD)[1],
        "count": WORLD,
    }
    fields.update(kw)
    return Header(**fields)


def receive_push(spec: WireSpec, hdr: torch.Tensor, src: int, fill) -> tuple | None:
    """The owner's receive path (pyasync/engine/p2p/owner.py, _recv_loop), step by step, plus the decode
    an applier does: one frame (header, then payload) lands in a buffer of spec.max_push_frame()
    bytes, a size fixed by this rank's layout. fill(h) -> the h.nbytes uint8 payload the sender put
    behind the header. Returns None for a CLOSE."""
    size = spec.max_push_frame()
    assert size == wire.HEADER_BYTES + max_push_bytes(spec.codec)
    frame = torch.zeros(size, dtype=torch.uint8)
    frame[: wire.HEADER_BYTES] = hdr.view(torch.uint8)
    h = wire.frame_header(frame, src)
    if h.kind == wire.CLOSE:
        spec.check_close(h)
        return None
    spec.check_push(h)
    # Everything in h is checked now; the payload it announces fits the receive buffer.
    assert 0 <= h.nbytes <= max_push_bytes(spec.codec), h
    assert h.numel == SHARD_NUMELS[h.bucket][RANK]
    sent = fill(h)
    assert sent.dtype == torch.uint8 and sent.numel() == h.nbytes
    frame[wire.HEADER_BYTES : wire.HEADER_BYTES + h.nbytes] = sent
    buf = wire.frame_body(frame, h)
    payload, mask = wire.unpack_push(buf, h)
    if any(m not in (0, 1) for m in mask.tolist()):
        raise WireError(f"PUSH from rank {src} has mask bytes other than 0/1")
    out = ops_codecs.decode(payload)
    return h, payload, out


def random_bytes(seed: int, clean_mask: bool = False):
    """fill(h): h.nbytes random bytes; clean_mask: with the mask bytes cut to 0/1, so that more
    messages get past the mask check to decode."""

    def fill(h: Header) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        buf = torch.randint(0, 256, (h.nbytes,), dtype=torch.uint8, generator=g)
        if clean_mask:
            codec = {v: k for k, v in CODEC_IDS.items()}[h.codec]
            _, _, numel, off = wire.push_parts(codec, h.numel, h.block, h.k, h.count)[0][-1]
            buf[off : off + numel] &= 1
        return buf

    return fill


def tensor_of(fields: list[int]) -> torch.Tensor:
    return torch.tensor(fields, dtype=torch.int64)


int64s = st.integers(INT64_MIN, INT64_MAX)
# Values that sit on the boundaries the decoder must police: signs, int32/int64 edges, "huge" sizes.
nasty = st.sampled_from(
    [0, 1, -1, -2, 2, 3, 7, 8, 16, 255, 256, 257, 300, 2**31 - 1, 2**31, 2**32, 2**40, 2**60, 2**60 + 1,
     2**62, INT64_MAX, INT64_MIN]
)
field_values = st.one_of(nasty, int64s, st.integers(-4, 400))
codecs = st.sampled_from(sorted(CODEC_IDS))


# ---------------------------------------------------------------------------------------------------
# parse_header: raw tensors


@FUZZ
@given(fields=st.lists(int64s, min_size=wire.HEADER_LEN, max_size=wire.HEADER_LEN), src=st.integers(0, 7))
def test_random_raw_headers_are_rejected(fields, src):
    with pytest.raises(WireError):
        wire.parse_header(tensor_of(fields), src)


@FUZZ
@given(rest=st.lists(field_values, min_size=wire.HEADER_LEN - 2, max_size=wire.HEADER_LEN - 2))
def test_right_magic_random_rest_is_rejected(rest):
    # Past the magic and format checks, a random checksum must still stop it.
    t = tensor_of([wire.MAGIC, wire.FORMAT_VERSION, *rest])
    with pytest.raises(WireError):
        wire.parse_header(t, 0)


@FUZZ
@given(
    codec=codecs,
    field=st.integers(0, wire.HEADER_LEN - 1),
    how=st.sampled_from(["replace", "bit", "plus", "minus"]),
    value=int64s,
    bit=st.integers(0, 63),
)
def test_single_field_mutation_is_rejected(codec, field, how, value, bit):
    """Any change to one field without recomputing the checksum is caught (by the checksum, or by a
    range check where the checksum is blind: it keeps 63 bits, so a flip of bit 63 alone passes it)."""
    t = wire.encode_header(valid_push(codec))
    old = int(t[field])
    if how == "replace":
        new = value
    elif how == "bit":
        u = (old & ((1 << 64) - 1)) ^ (1 << bit)
        new = u - (1 << 64) if u > INT64_MAX else u
    elif how == "plus":
        new = old + 1 if old < INT64_MAX else INT64_MIN
    else:
        new = old - 1 if old > INT64_MIN else INT64_MAX
    if new == old:
        return
    t[field] = new
    with pytest.raises(WireError):
        wire.parse_header(t, 0)


@FUZZ
@given(codec=codecs,
       bits=st.lists(st.integers(0, 64 * wire.HEADER_LEN - 1), min_size=1, max_size=4, unique=True))
def test_bit_flips_anywhere_are_rejected(codec, bits):
    t = wire.encode_header(valid_push(codec))
    raw = bytearray(t.numpy().tobytes())
    for b in bits:
        raw[b // 8] ^= 1 << (b % 8)
    mutated = torch.frombuffer(raw, dtype=torch.int64).clone()
    with pytest.raises(WireError):
        wire.parse_header(mutated, 0)


@pytest.mark.parametrize(
    "t, match",
    [
        (torch.zeros(wire.HEADER_LEN - 1, dtype=torch.int64), "must be 16 int64"),
        (torch.zeros(wire.HEADER_LEN + 1, dtype=torch.int64), "must be 16 int64"),
        (torch.zeros(wire.HEADER_LEN, dtype=torch.int32), "must be 16 int64"),
        (torch.zeros(wire.HEADER_LEN, dtype=torch.float64), "must be 16 int64"),
        (torch.zeros(0, dtype=torch.int64), "must be 16 int64"),
    ],
    ids=["short", "long", "int32", "float64", "empty"],
)
def test_wrong_header_tensor_shape_or_dtype(t, match):
    with pytest.raises(WireError, match=match):
        wire.parse_header(t, 0)


# ---------------------------------------------------------------------------------------------------
# Resealed headers (valid checksum: a peer speaking nonsense, not a bit flip) through the whole path

_HEADER_FIELDS = ["kind", "sender", "clock", "version", "bucket", "shard", "codec", "numel", "nbytes", "k",
                  "block", "flags", "count"]


@FUZZ
@given(
    codec=codecs,
    bucket=st.integers(0, 2),
    edits=st.dictionaries(st.sampled_from(_HEADER_FIELDS), st.one_of(field_values, st.integers(0, 12)),
                          max_size=4),
    src=st.integers(0, WORLD - 1),
    seed=st.integers(0, 2**31 - 1),
)
def test_resealed_push_headers_through_the_receive_path(codec, bucket, edits, src, seed):
    spec = make_spec(codec)
    h = valid_push(codec, bucket=bucket, sender=src)
    fields = {f: getattr(h, f) for f in _HEADER_FIELDS}
    fields.update(edits)
    t = wire.encode_header(Header(**fields))
    try:
        got = receive_push(spec, t, src, random_bytes(seed, clean_mask=True))
    except ALLOWED as e:
        assert str(e), "errors must say what is wrong"
        event("refused: payload" if "indices" in str(e) else "refused: header")
        return
    event("accepted" if got is not None else "accepted CLOSE")
    if got is None:  # a CLOSE that passed check_close
        assert fields["kind"] == wire.CLOSE and fields["nbytes"] == 0
        return
    h2, _payload, out = got
    # Accepted: every field is what this rank expects for that bucket.
    assert h2.kind == wire.PUSH and h2.shard == RANK and h2.sender == src
    assert h2.codec == CODEC_IDS[codec] and 0 <= h2.clock <= wire.MAX_CLOCK and h2.version >= 0
    assert out.numel() == SHARD_NUMELS[h2.bucket][RANK] and out.dtype == torch.float32


@FUZZ
@given(
    bucket=st.integers(0, 2),
    edits=st.dictionaries(st.sampled_from(_HEADER_FIELDS), st.one_of(field_values, st.integers(0, 12)),
                          max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_resealed_reply_headers(bucket, edits, seed):
    spec = make_spec("int8")
    h = valid_reply(bucket=bucket)
    fields = {f: getattr(h, f) for f in _HEADER_FIELDS}
    fields.update(edits)
    src = 2
    t = wire.encode_header(Header(**fields))
    try:
        h2 = wire.parse_header(t, src)
        spec.check_reply(h2)
    except ALLOWED:
        event("refused")
        return
    event("accepted")
    bound = max(wire.reply_parts(row[src], WORLD)[1] for row in SHARD_NUMELS)
    assert 0 <= h2.nbytes <= bound and h2.numel == SHARD_NUMELS[h2.bucket][src]
    buf = random_bytes(seed)(h2)
    values, clocks = wire.unpack_reply(buf, h2)
    assert values.dtype == torch.float32 and values.numel() == h2.numel
    assert len(clocks) == WORLD


@pytest.mark.parametrize("codec", sorted(CODEC_IDS))
@pytest.mark.parametrize("field", ["numel", "nbytes", "count", "k", "block"])
@pytest.mark.parametrize("huge", [2**40, 2**60], ids=["2^40", "2^60"])
def test_huge_claimed_sizes_are_rejected_before_allocation(codec, field, huge):
    """A header claiming 2^40 elements/bytes passes parse_header's ranges (<= 2^60) but must be refused
    by check_push, which compares it with the spec: the receive path never reaches torch.empty."""
    spec = make_spec(codec)
    t = wire.encode_header(valid_push(codec, **{field: huge}))
    h = wire.parse_header(t, 0)
    match = {"nbytes": "payload bytes", "count": "mask entries"}.get(field, field)
    with pytest.raises(WireError, match=match) as e:
        spec.check_push(h)
    assert "rank 0" in str(e.value)


@pytest.mark.parametrize("field", ["numel", "nbytes", "count"])
def test_huge_claimed_reply_sizes_are_rejected(field):
    spec = make_spec("none")
    t = wire.encode_header(valid_reply(**{field: 2**40}))
    h = wire.parse_header(t, 2)
    with pytest.raises(WireError, match="rank 2"):
        spec.check_reply(h)


@pytest.mark.parametrize("field", ["numel", "nbytes", "count", "clock", "version"])
def test_above_max_clock_is_out_of_range(field):
    t = wire.encode_header(valid_push("none", **{field: 2**60 + 1}))
    with pytest.raises(WireError, match=f"{field}=.* out of range"):
        wire.parse_header(t, 0)


# ---------------------------------------------------------------------------------------------------
# Random payload bytes behind a valid header: decode gives an answer equal to the reference, or a
# clear error (top-k indices out of range / not ascending, mask bytes other than 0/1).


@FUZZ
@given(codec=codecs, bucket=st.sampled_from([0, 1, 2]), seed=st.integers(0, 2**31 - 1),
       clean_mask=st.booleans())
def test_random_payload_bytes(codec, bucket, seed, clean_mask):
    spec = make_spec(codec)
    h = valid_push(codec, bucket=bucket)
    try:
        got = receive_push(spec, wire.encode_header(h), 0, random_bytes(seed, clean_mask))
    except ALLOWED as e:
        msg = str(e)
        assert "mask" in msg or "indices" in msg, msg
        event(f"refused: {'mask' if 'mask' in msg else 'indices'}")
        return
    event("decoded")
    _, payload, out = got
    want = ref_codecs.decode(payload)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@FUZZ
@given(bucket=st.sampled_from([0, 1, 2]), seed=st.integers(0, 2**31 - 1))
def test_topk_payload_with_sorted_in_range_indices_decodes(bucket, seed):
    """Top-k indices made valid (strictly ascending, in range) with random values decode exactly."""
    codec = "topk"
    h = valid_push(codec, bucket=bucket)
    n, k = h.numel, h.k
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
    vals = torch.randn(k, generator=g)
    parts, total = wire.push_parts(codec, n, 0, k, h.count)
    buf = torch.zeros(total, dtype=torch.uint8)
    views = {name: buf[off : off + numel * torch.empty((), dtype=dt).element_size()].view(dt)
             for name, dt, numel, off in parts}
    views["codes"].copy_(vals)
    views["indices"].copy_(idx)
    _, _payload, out = receive_push(make_spec(codec), wire.encode_header(h), 0, lambda h: buf.clone())
    want = torch.zeros(n)
    want[idx.long()] = vals
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("codec", sorted(CODEC_IDS))
def test_round_trip_through_the_receive_path(codec):
    """The positive control for the fuzzers above: a real encoded push survives the receive path."""
    bucket = 1
    n = SHARD_NUMELS[bucket][RANK]
    g = torch.Generator().manual_seed(7)
    grad = torch.randn(n, generator=g)
    k = topk_k(n) if codec == "topk" else 0
    payload = ops_codecs.encode(codec, grad, block=BLOCK, k=k)
    mask = torch.tensor([1, 0, 1, 1], dtype=torch.uint8)
    assert mask.numel() == MASK_LENS[bucket][RANK]
    buf = wire.pack_push(payload, mask)
    h = valid_push(codec, bucket=bucket, nbytes=buf.numel())
    _, got, out = receive_push(make_spec(codec), wire.encode_header(h), 0, lambda h: buf.clone())
    torch.testing.assert_close(out, ref_codecs.decode(payload), rtol=0, atol=0)
    assert got.k == k and got.codec == codec


def _bad_buffers(nbytes: int) -> dict:
    return {
        "empty": torch.zeros(0, dtype=torch.uint8),
        "short": torch.zeros(nbytes - 1, dtype=torch.uint8),
        "long": torch.zeros(nbytes + 8, dtype=torch.uint8),
        "int8": torch.zeros(nbytes, dtype=torch.int8),
        "2d": torch.zeros(1, nbytes, dtype=torch.uint8),
    }


@pytest.mark.parametrize("what", ["empty", "short", "long", "int8", "2d"])
def test_unpack_rejects_a_buffer_of_the_wrong_size_or_kind(what):
    h = valid_push("int8", bucket=0)
    with pytest.raises(WireError, match="rank 0"):
        wire.unpack_push(_bad_buffers(h.nbytes)[what], h)
    r = valid_reply()
    with pytest.raises(WireError, match="rank 2"):
        wire.unpack_reply(_bad_buffers(r.nbytes)[what], r)


@pytest.mark.parametrize("what", ["strided", "misaligned"])
def test_unpack_rejects_a_strided_or_misaligned_buffer(what):
    h = valid_push("int8", bucket=0)
    big = torch.zeros(2 * h.nbytes + 1, dtype=torch.uint8)
    buf = big[::2][: h.nbytes] if what == "strided" else big[1 : 1 + h.nbytes]
    with pytest.raises(WireError):
        wire.unpack_push(buf, h)


@pytest.mark.parametrize("field", range(wire.HEADER_LEN - 1))
def test_sign_bit_flip_of_any_field_is_rejected(field):
    """The checksum keeps 63 bits, so flipping bit 63 of one field leaves it valid; the magic, format,
    kind, sender, range and flag checks must catch that flip for every field."""
    t = wire.encode_header(valid_push("int8"))
    u = (int(t[field]) & ((1 << 64) - 1)) ^ (1 << 63)
    t[field] = u - (1 << 64) if u > INT64_MAX else u
    with pytest.raises(WireError, match="rank 0"):
        wire.parse_header(t, 0)
