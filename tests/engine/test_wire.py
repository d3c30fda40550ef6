"""Wire headers and payload packing: round trips, and every corrupt field rejected by name."""

import pytest
import torch

from pyasync.engine import wire
from pyasync.engine.wire import Header, WireError, WireSpec
from pyasync.ops._common import CODEC_IDS, Payload

N = 10  # elements of shard (bucket 1, rank 1)


def spec(codec="int8", block=4):
    # 2 buckets x 2 ranks; this is rank 1.
    return WireSpec(
        rank=1,
        world_size=2,
        shard_numels=[[3, 3], [5, N]],
        mask_lens=[[1, 1], [2, 3]],
        codec=codec,
        block=block,
        topk_k=lambda n: max(1, n // 4),
    )


def push_header(**kw):
    base = {
        "kind": wire.PUSH,
        "sender": 0,
        "clock": 3,
        "version": 2,
        "bucket": 1,
        "shard": 1,
        "codec": CODEC_IDS["int8"],
        "numel": N,
        "nbytes": wire.push_parts("int8", N, 4, 0, 3)[1],
        "k": 0,
        "block": 4,
        "flags": wire.FLAG_FINITE,
        "count": 3,
    }
    base.update(kw)
    return Header(**base)


def test_header_round_trip():
    h = push_header()
    t = wire.encode_header(h)
    assert t.dtype == torch.int64 and t.numel() == wire.HEADER_LEN
    assert wire.parse_header(t, 0) == h
    spec().check_push(h)


@pytest.mark.parametrize(
    "field, value, match",
    [
        (0, 12345, "magic"),
        (1, 99, "format version"),
        (2, 7, "checksum"),  # any edit without recomputing the checksum
        (9, N + 1, "checksum"),
    ],
)
def test_corrupt_raw_fields_are_rejected(field, value, match):
    t = wire.encode_header(push_header())
    t[field] = value
    with pytest.raises(WireError, match=match) as e:
        wire.parse_header(t, 0)
    assert "rank 0" in str(e.value)


def _resealed(h_fields: dict) -> torch.Tensor:
    """A header with fields edited and a VALID checksum (a peer speaking nonsense, not a bit flip)."""
    return wire.encode_header(push_header(**h_fields))


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"kind": 9}, "unknown kind"),
        ({"sender": 1}, "claims sender 1"),
        ({"bucket": -2}, "bucket=-2 out of range"),
        ({"flags": 64}, "unknown flags"),
        ({"numel": 1 << 62}, "numel=.* out of range"),
    ],
)
def test_parse_rejects_bad_values_naming_the_sender(edit, match):
    with pytest.raises(WireError, match=match) as e:
        wire.parse_header(_resealed(edit), 0)
    assert "rank 0" in str(e.value)


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"kind": wire.REPLY}, "expected a PUSH"),
        ({"shard": 0}, "for shard 0, but this is rank 1"),
        ({"bucket": 2}, "names bucket 2, but there are 2 buckets"),
        ({"numel": N - 1}, "numel 9, expected 10"),
        ({"clock": -1}, "negative clock"),
        ({"codec": CODEC_IDS["sign"]}, "uses codec sign, the agreed codec is int8"),
        ({"block": 8}, "block 8, expected 4"),
        ({"k": 2}, "k=2, expected 0"),
        ({"count": 2}, "2 mask entries, expected 3"),
        ({"nbytes": 7}, "announces 7 payload bytes"),
        ({"flags": wire.FLAG_FINITE | wire.FLAG_FINAL}, "FINAL"),
    ],
)
def test_check_push_rejects_each_field(edit, match):
    h = wire.parse_header(_resealed(edit), 0)
    with pytest.raises(WireError, match=match) as e:
        spec().check_push(h)
    assert "rank 0" in str(e.value)


def test_topk_k_is_checked():
    s = spec("topk", 0)
    good = push_header(codec=CODEC_IDS["topk"], block=0, k=2, nbytes=wire.push_parts("topk", N, 0, 2, 3)[1])
    s.check_push(good)
    bad = push_header(codec=CODEC_IDS["topk"], block=0, k=3, nbytes=wire.push_parts("topk", N, 0, 3, 3)[1])
    with pytest.raises(WireError, match="k=3, expected 2"):
        s.check_push(bad)


def reply_header(**kw):
    base = {
        "kind": wire.REPLY,
        "sender": 0,
        "clock": 4,
        "version": 9,
        "bucket": 1,
        "shard": 0,
        "codec": 0,
        "numel": 5,
        "nbytes": wire.reply_parts(5, 2)[1],
        "count": 2,
    }
    base.update(kw)
    return Header(**base)


def test_check_reply():
    s = spec()
    s.check_reply(reply_header())
    for edit, match in [
        ({"shard": 1}, "does not own"),
        ({"count": 3}, "3 clocks"),
        ({"nbytes": 8}, "payload bytes"),
        ({"codec": wire.CODEC_IDS["fp16"]}, "codec/k/block"),  # neither exact nor the agreed codec
        ({"codec": 0, "block": 4}, "codec/k/block"),
        ({"codec": wire.CODEC_IDS["int8"]}, "block/k 0/0, expected 4/0"),  # coded: the agreed block
        ({"numel": 4}, "numel 4, expected 5"),
    ]:
        with pytest.raises(WireError, match=match):
            s.check_reply(reply_header(**edit))
    # A coded reply (the agreed codec int8, its block): the codec's payload and the clocks.
    coded = {"codec": wire.CODEC_IDS["int8"], "block": 4, "nbytes": s.coded_reply_bytes(5)}
    s.check_reply(reply_header(**coded))
    with pytest.raises(WireError, match="payload bytes"):
        s.check_reply(reply_header(**{**coded, "nbytes": wire.reply_parts(5, 2)[1]}))
    with pytest.raises(WireError, match="CLOSE"):
        s.check_close(reply_header(kind=wire.CLOSE))


@pytest.mark.parametrize(
    "codec, block, k",
    [("none", 0, 0), ("fp16", 0, 0), ("bf16", 0, 0), ("int8", 4, 0), ("sign", 4, 0), ("topk", 0, 3)],
)
def test_push_pack_round_trip(codec, block, k):
    n = 11
    g = torch.Generator().manual_seed(0)
    dt = {
        "none": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "int8": torch.int8,
        "sign": torch.uint8,
        "topk": torch.float32,
    }[codec]
    ncodes = {"sign": 2, "topk": k}.get(codec, n)
    codes = (torch.randn(ncodes, generator=g) * 50).to(dt)
    scales = torch.rand(-(-n // block), generator=g) if codec in ("int8", "sign") else None
    indices = torch.tensor([1, 4, 9], dtype=torch.int32) if codec == "topk" else None
    p = Payload(codec=codec, n=n, codes=codes, scales=scales, indices=indices, k=k, block=block)
    mask = torch.tensor([1, 0, 1], dtype=torch.uint8)
    buf = wire.pack_push(p, mask)
    parts, total = wire.push_parts(codec, n, block, k, 3)
    assert buf.numel() == total and all(off % 8 == 0 for *_, off in parts)
    h = Header(
        kind=wire.PUSH,
        sender=0,
        clock=0,
        version=0,
        bucket=0,
        shard=0,
        codec=CODEC_IDS[codec],
        numel=n,
        nbytes=total,
        k=k,
        block=block,
        flags=0,
        count=3,
    )
    q, m = wire.unpack_push(buf, h)
    assert torch.equal(q.codes, codes) and torch.equal(m, mask) and not q.finite
    for a, b in ((q.scales, scales), (q.indices, indices)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_reply_pack_round_trip():
    v = torch.randn(7)
    buf = wire.pack_reply(v, [3, -1, 5])
    h = reply_header(numel=7, nbytes=buf.numel(), count=3)
    values, clocks = wire.unpack_reply(buf, h)
    assert torch.equal(values, v) and clocks == [3, -1, 5]


def test_unpack_rejects_a_buffer_of_the_wrong_size():
    h = push_header()
    for nbytes in (0, h.nbytes - 1, h.nbytes + 8):
        with pytest.raises(WireError, match="expected .* uint8 bytes"):
            wire.unpack_push(torch.zeros(nbytes, dtype=torch.uint8), h)
    r = reply_header()
    with pytest.raises(WireError, match="rank 0"):
        wire.unpack_reply(torch.zeros(r.nbytes - 8, dtype=torch.uint8), r)
    with pytest.raises(WireError, match="unknown codec"):
        wire.unpack_push(torch.zeros(h.nbytes, dtype=torch.uint8), push_header(codec=9))


def test_frames_carry_header_and_payload_in_one_buffer():
    p = Payload("int8", 300, torch.arange(300, dtype=torch.int8), torch.ones(19), block=16)
    mask = torch.tensor([1, 0, 1], dtype=torch.uint8)
    h = push_header(codec=CODEC_IDS["int8"], numel=300, block=16, nbytes=0, count=3)
    frame = wire.pack_push(p, mask, header=h)
    body_bytes = wire.pack_push(p, mask)
    assert frame.numel() == wire.HEADER_BYTES + body_bytes.numel()
    # Received into a larger buffer (the receiver posts its largest frame): the header says how much.
    buf = torch.full((frame.numel() + 64,), 0xAB, dtype=torch.uint8)
    buf[: frame.numel()] = frame
    got = wire.frame_header(buf, 0)
    assert got.nbytes == body_bytes.numel() and got.numel == 300 and got.count == 3
    assert torch.equal(wire.frame_body(buf, got), body_bytes)
    q, m = wire.unpack_push(wire.frame_body(buf, got), got)
    assert torch.equal(q.codes, p.codes) and torch.equal(q.scales, p.scales) and m.tolist() == [1, 0, 1]
    # A header claiming more than the buffer holds is refused before anything is read from it.
    with pytest.raises(WireError, match="more than"):
        wire.frame_body(buf[: frame.numel() - 1], got)
    with pytest.raises(WireError, match="at least"):
        wire.frame_header(buf[:100], 0)
    r = wire.pack_reply(
        torch.arange(5, dtype=torch.float32),
        [1, 2],
        header=wire.Header(
            kind=wire.REPLY,
            sender=2,
            clock=1,
            version=3,
            bucket=0,
            shard=2,
            codec=0,
            numel=5,
            nbytes=0,
            count=2,
        ),
    )
    rh = wire.frame_header(r, 2)
    values, clocks = wire.unpack_reply(wire.frame_body(r, rh), rh)
    assert values.tolist() == [0, 1, 2, 3, 4] and clocks == [1, 2]


def test_max_frames_are_the_largest_message_the_layout_allows():
    spec = wire.WireSpec(
        1, 3, [[5, 17, 1], [300, 257, 0], [8, 8, 8]], [[1, 2, 1], [3, 4, 0], [1, 1, 1]], "int8", 16
    )
    assert spec.max_push_frame() == wire.HEADER_BYTES + max(
        wire.push_parts("int8", n, 16, 0, m)[1] for n, m in [(17, 2), (257, 4), (8, 1)]
    )
    assert spec.max_reply_frame() == wire.HEADER_BYTES + max(
        wire.reply_parts(n, 3)[1] for n in [5, 1, 300, 8, 8]
    )
