"""Codec kernels (pyasync.ops.codecs) against the pure-torch specification (pyasync.reference.codecs).

Exact where the result is determined: fp16/bf16 codes, int8 codes and scales, sign bits, top-k index
sets, the residual of every codec but sign, and decode given the codes. The sign scale is a sum whose
order differs between the kernel and torch, so it (and the sign residual) is compared to a tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from pyasync.ops import codecs as C
from pyasync.ops._common import Payload
from pyasync.reference import codecs as R

SIZES = [1, 255, 4097, 278011]
BLOCKS = [32, 256, 1000, 13]  # 13: sign blocks that start and end inside a byte
CAST = ["none", "fp16", "bf16"]
BLOCKY = ["int8", "sign"]


def _gen(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * scale


def _codes_equal(a: Payload, b: Payload) -> bool:
    """Bitwise equality of the code tensors (float codes compared as raw words). A NaN code only has
    to be a NaN: torch's own bf16 cast gives 0x7fc0 or 0xffff depending on its code path."""
    x, y = a.codes, b.codes
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.is_floating_point():
        nan = torch.isnan(x)
        if not torch.equal(nan, torch.isnan(y)):
            return False
        x, y = x[~nan], y[~nan]
        words = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[x.dtype]
        x, y = x.view(words), y.view(words)
    return torch.equal(x, y)


def _check_against_reference(codec, g, e, block, k=0, num_threads=None):
    """Encode with the kernel and the reference; assert they agree; return the kernel payload."""
    ro = None if e is None else torch.empty_like(e)
    p = C.encode(codec, g, residual_in=e, residual_out=ro, block=block, k=k, num_threads=num_threads)
    rp, rr = R.encode(codec, g, residual=e, block=block, k=k)
    assert p.codec == rp.codec and p.n == rp.n == g.numel()
    assert p.finite == rp.finite
    if codec == "sign":
        assert _codes_equal(p, rp), "sign bits differ"
        torch.testing.assert_close(p.scales, rp.scales, rtol=2e-6, atol=0)
        if e is not None:
            # e' = v -+ scale: the scale's last-bit difference is all that may differ
            tol = 1e-6 * float(rp.scales.abs().max()) + 1e-30
            torch.testing.assert_close(ro, rr, rtol=0, atol=tol)
    else:
        assert _codes_equal(p, rp), f"{codec} codes differ"
        if codec == "int8":
            assert torch.equal(p.scales, rp.scales)
        if codec == "topk":
            assert torch.equal(p.indices, rp.indices)
        if e is not None:
            assert torch.equal(ro, rr), f"{codec} residual differs"
    return p


# -- kernels vs reference ------------------------------------------------------------------------


@pytest.mark.parametrize("residual", [False, True], ids=["noef", "ef"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec", CAST)
def test_cast_codecs_match_reference(codec, n, residual):
    g = _gen(n, 1)
    e = _gen(n, 2, 0.01) if residual else None
    p = _check_against_reference(codec, g, e, 256)
    assert p.block == 0 and p.scales is None
    assert torch.equal(C.decode(p), R.decode(p))


@pytest.mark.parametrize("residual", [False, True], ids=["noef", "ef"])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec", BLOCKY)
def test_block_codecs_match_reference(codec, n, block, residual):
    g = _gen(n, 3)
    e = _gen(n, 4, 0.01) if residual else None
    p = _check_against_reference(codec, g, e, block)
    assert p.block == block and p.scales.numel() == math.ceil(n / block)
    assert torch.equal(C.decode(p), R.decode(p))


@pytest.mark.parametrize("residual", [False, True], ids=["noef", "ef"])
@pytest.mark.parametrize("n", SIZES)
def test_topk_through_codecs_matches_reference(n, residual):
    g = _gen(n, 5)
    e = _gen(n, 6, 0.01) if residual else None
    k = C.topk_count(n, 0.01)
    p = _check_against_reference("topk", g, e, 256, k=k)
    assert p.k == k and p.indices.numel() == k
    assert torch.equal(C.decode(p), R.decode(p))


@pytest.mark.parametrize("codec", CAST + BLOCKY + ["topk"])
def test_bucket_of_25mb(codec):
    n = 25_000_000 // 4
    g = _gen(n, 7)
    e = _gen(n, 8, 0.01)
    k = C.topk_count(n, 0.001) if codec == "topk" else 0
    p = _check_against_reference(codec, g, e, 256, k=k)
    assert torch.equal(C.decode(p, alpha=0.25), R.decode(p, alpha=0.25))


def test_sign_bit_layout_is_lsb_first():
    g = torch.tensor([1.0, -1.0, -2.0, 3.0, -0.0, float("-inf"), -5.0, -6.0, -7.0, 8.0])
    p = C.encode("sign", g, block=256)
    # elements 0..7 -> byte 0: bits 1,0,0,1,1,1,0,0 (LSB first; -0 and non-finite are 1)
    assert p.codes.tolist() == [0b00111001, 0b00000010]
    assert not p.finite


# -- decode ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CAST + BLOCKY + ["topk"])
def test_decode_alpha_and_accumulate(codec):
    n = 4097
    g = _gen(n, 9)
    p = C.encode(codec, g, block=100, k=37)
    base = _gen(n, 10)
    for alpha in (1.0, -0.5, 3.0):
        got = C.decode(p, out=base.clone(), alpha=alpha, accumulate=True)
        want = R.decode(p, out=base.clone(), alpha=alpha, accumulate=True)
        assert torch.equal(got, want)
        got = C.decode(p, out=base.clone(), alpha=alpha)
        want = R.decode(p, out=base.clone(), alpha=alpha)
        assert torch.equal(got, want)
    dense = C.decode(p)
    if codec == "topk":
        assert int((dense != 0).sum()) <= 37
        assert torch.equal(dense[p.indices.long()], p.codes)


def test_decode_from_given_codes():
    """Decode is determined by the codes alone: hand-made payloads decode exactly."""
    q = torch.tensor([-127, -1, 0, 1, 127], dtype=torch.int8)
    s = torch.tensor([0.5, 2.0])
    p = Payload(codec="int8", n=5, codes=q, scales=s, block=3)
    assert C.decode(p).tolist() == [-63.5, -0.5, 0.0, 2.0, 254.0]
    p = Payload(codec="sign", n=5, codes=torch.tensor([0b10110], dtype=torch.uint8),
                scales=torch.tensor([1.5, 4.0]), block=3)
    assert C.decode(p).tolist() == [-1.5, 1.5, 1.5, -4.0, 4.0]
    idx = torch.tensor([1, 4], dtype=torch.int32)
    p = Payload(codec="topk", n=6, codes=torch.tensor([2.0, -3.0]), indices=idx, k=2)
    assert C.decode(p).tolist() == [0.0, 2.0, 0.0, 0.0, -3.0, 0.0]
    h = torch.tensor([1.0, -2.5, 65504.0]).half()
    assert C.decode(Payload(codec="fp16", n=3, codes=h)).tolist() == [1.0, -2.5, 65504.0]


# -- non-finite inputs, zeros, odd shapes ------------------------------------------------------


@pytest.mark.parametrize("codec", CAST + BLOCKY + ["topk"])
def test_nonfinite_sets_flag_and_keeps_residual(codec):
    n = 1000
    g = _gen(n, 11)
    bad = [3, 64, 65, 999]
    g[3], g[64], g[65], g[999] = float("nan"), float("inf"), float("-inf"), float("nan")
    e = _gen(n, 12, 0.01)
    ro = torch.empty_like(e)
    flag = torch.zeros(1, dtype=torch.int32)
    p = C.encode(codec, g, residual_in=e, residual_out=ro, block=64, k=10, nonfinite=flag)
    assert not p.finite and int(flag) == 1
    assert torch.equal(ro[bad], e[bad])
    rp, rr = R.encode(codec, g, residual=e, block=64, k=10)
    assert not rp.finite
    assert torch.equal(ro[bad], rr[bad])
    good = torch.ones(n, dtype=torch.bool)
    good[bad] = False
    if codec == "sign":
        assert _codes_equal(p, rp)
        torch.testing.assert_close(ro[good], rr[good], rtol=0, atol=1e-6)
    else:
        assert _codes_equal(p, rp)
        assert torch.equal(ro[good], rr[good])
    if codec == "int8":
        assert torch.equal(p.scales, rp.scales) and p.codes[bad].eq(0).all()
    # without error feedback the flag is still raised
    assert not C.encode(codec, g, block=64, k=10).finite


def test_nonfinite_flag_is_never_cleared():
    flag = torch.ones(1, dtype=torch.int32)
    p = C.encode("int8", torch.ones(10), nonfinite=flag)
    assert int(flag) == 1 and not p.finite  # the caller's flag was already set
    flag.zero_()
    assert C.encode("int8", torch.ones(10), nonfinite=flag).finite and int(flag) == 0


def test_fp16_overflow_is_flagged_and_keeps_residual():
    g = torch.tensor([1.0, 70000.0, -1e6, 2.0])
    e = torch.full((4,), 0.25)
    ro = torch.empty(4)
    p = C.encode("fp16", g, residual_in=e, residual_out=ro)
    assert not p.finite
    assert ro[1] == 0.25 and ro[2] == 0.25 and ro[0] == 0.0 and ro[3] == 0.0
    rp, rr = R.encode("fp16", g, residual=e)
    assert not rp.finite and torch.equal(ro, rr)


@pytest.mark.parametrize("codec", BLOCKY)
def test_all_zero_blocks(codec):
    n, block = 1000, 128
    g = _gen(n, 13)
    g[128:512] = 0.0  # three whole zero blocks
    g[-(n % block):] = 0.0  # a zero short last block
    e = torch.zeros(n)
    ro = torch.empty(n)
    p = C.encode(codec, g, residual_in=e, residual_out=ro, block=block)
    assert p.finite
    assert p.scales[1:4].eq(0).all() and p.scales[-1] == 0
    assert ro[128:512].eq(0).all()
    assert C.decode(p)[128:512].eq(0).all()
    _check_against_reference(codec, g, e, block)


@pytest.mark.parametrize("codec", BLOCKY)
def test_short_last_block_scale(codec):
    g = torch.tensor([1.0, -2.0, 4.0, 8.0, -16.0, 32.0, 2.0])  # blocks [0..4], [5..6]
    p = C.encode(codec, g, block=5)
    if codec == "int8":
        assert torch.equal(p.scales, torch.tensor([16.0, 32.0]) / 127.0)  # fp32 division
        assert p.codes[5] == 127
    else:
        assert p.scales.tolist() == pytest.approx([31.0 / 5.0, 17.0])  # mean |v| over 2, not 5


def test_int8_codes_round_half_to_even_and_clamp():
    # absmax 127 -> scale 1: codes are rint(v), ties to even
    g = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5])
    p = C.encode("int8", g, block=256)
    assert p.codes.tolist() == [127, 0, 2, 2, 0, -2, 126]


# -- threads, in place, reuse --------------------------------------------------------------------


@pytest.mark.parametrize("codec", CAST + BLOCKY)
def test_num_threads_one_equals_default(codec):
    n = 278011
    g, e = _gen(n, 14), _gen(n, 15, 0.01)
    outs = []
    for nt in (1, None, 3):
        ro = torch.empty(n)
        p = C.encode(codec, g, residual_in=e, residual_out=ro, block=13, num_threads=nt)
        outs.append((p, ro, C.decode(p, num_threads=nt)))
    for p, ro, d in outs[1:]:
        assert _codes_equal(p, outs[0][0]) and torch.equal(ro, outs[0][1]) and torch.equal(d, outs[0][2])
        if p.scales is not None:
            assert torch.equal(p.scales, outs[0][0].scales)


@pytest.mark.parametrize("codec", CAST + BLOCKY + ["topk"])
def test_in_place_residual_equals_separate(codec):
    n = 4097
    g, e = _gen(n, 16), _gen(n, 17, 0.01)
    ro = torch.empty(n)
    p1 = C.encode(codec, g, residual_in=e, residual_out=ro, k=50)
    r = e.clone()
    out = C.empty_payload(codec, n, k=50)
    p2 = C.encode(codec, g, residual_in=r, residual_out=r, out=out, k=50)
    assert p2 is out
    assert _codes_equal(p1, p2) and torch.equal(ro, r)
    # residual read but not written: same codes, residual untouched
    r2 = e.clone()
    p3 = C.encode(codec, g, residual_in=r2, k=50)
    assert _codes_equal(p1, p3) and torch.equal(r2, e)


def test_empty_tensor():
    for codec in CAST + BLOCKY:
        p = C.encode(codec, torch.empty(0), residual_in=torch.empty(0), residual_out=torch.empty(0))
        assert p.n == 0 and p.finite and C.decode(p).numel() == 0


def test_helpers():
    assert C.topk_count(1, 0.01) == 1
    assert C.topk_count(1000, 0.01) == 10
    assert C.topk_count(1001, 0.01) == 11
    assert C.topk_count(5, 1.0) == 5
    assert C.payload_nbytes("int8", 1000, block=256) == 1000 + 4 * 4
    assert C.payload_nbytes("sign", 1001, block=1000) == 126 + 8
    assert C.payload_nbytes("topk", 1000, k=10) == 80
    assert C.payload_nbytes("fp16", 7) == 14
    for codec in CAST + BLOCKY + ["topk"]:
        p = C.empty_payload(codec, 1001, block=100, k=3)
        C.check_payload(p)
        assert p.nbytes == C.payload_nbytes(codec, 1001, block=100, k=3)


# -- bad arguments and malformed payloads --------------------------------------------------------


def test_bad_encode_arguments():
    g = torch.randn(100)
    with pytest.raises(ValueError, match="codec must be one of"):
        C.encode("int4", g)
    with pytest.raises(TypeError, match="codec must be a str"):
        C.encode(3, g)
    with pytest.raises(TypeError, match="grad must have dtype torch.float32"):
        C.encode("int8", g.double())
    with pytest.raises(ValueError, match="grad must be 1-D"):
        C.encode("int8", g.view(10, 10))
    with pytest.raises(ValueError, match="grad must be contiguous"):
        C.encode("int8", torch.randn(200)[::2])
    with pytest.raises(TypeError, match="grad must be a torch.Tensor"):
        C.encode("int8", [1.0, 2.0])
    with pytest.raises(ValueError, match="residual_in must have 100 elements"):
        C.encode("int8", g, residual_in=torch.zeros(99))
    with pytest.raises(ValueError, match="residual_out needs residual_in"):
        C.encode("int8", g, residual_out=torch.zeros(100))
    buf = torch.zeros(150)
    with pytest.raises(ValueError, match="must be residual_in itself"):
        C.encode("int8", g, residual_in=buf[:100], residual_out=buf[50:])
    with pytest.raises(ValueError, match="must not overlap grad"):
        C.encode("int8", g, residual_in=torch.zeros(100), residual_out=g)
    for block, exc in ((0, ValueError), (-1, ValueError), (C.MAX_BLOCK + 1, ValueError), (2.0, TypeError),
                       (True, TypeError)):
        with pytest.raises(exc, match="block must"):
            C.encode("sign", g, block=block)
    for k in (0, 101, -3):
        with pytest.raises(ValueError, match="k must be in"):
            C.encode("topk", g, k=k)
    with pytest.raises(ValueError, match="num_threads"):
        C.encode("int8", g, num_threads=-1)
    with pytest.raises(ValueError, match="out.block is 128"):
        C.encode("int8", g, out=C.empty_payload("int8", 100, block=128))
    with pytest.raises(ValueError, match="out has codec 'sign'"):
        C.encode("int8", g, out=C.empty_payload("sign", 100))
    with pytest.raises(ValueError, match="out holds 101 elements"):
        C.encode("int8", g, out=C.empty_payload("int8", 101))
    with pytest.raises(TypeError, match="nonfinite must have dtype torch.int32"):
        C.encode("int8", g, nonfinite=torch.zeros(1))
    with pytest.raises(ValueError, match="ratio must be in"):
        C.topk_count(10, 0.0)
    with pytest.raises(ValueError, match="ratio must be in"):
        C.topk_count(10, 1.5)


def _malformed():
    ok_int8 = C.encode("int8", torch.randn(300), block=100)
    ok_sign = C.encode("sign", torch.randn(300), block=100)
    ok_topk = C.encode("topk", torch.randn(300), k=5)
    rep = lambda p, **kw: Payload(**{**p.__dict__, **kw})  # noqa: E731
    return [
        ("unknown codec", rep(ok_int8, codec="int4"), ValueError, "codec must be one of"),
        ("short codes", rep(ok_int8, codes=ok_int8.codes[:299]), ValueError, "codes must have 300 elements"),
        ("codes dtype", rep(ok_int8, codes=ok_int8.codes.to(torch.uint8)), TypeError,
         "codes must have dtype"),
        ("scales missing", rep(ok_int8, scales=None), ValueError, "scales is missing"),
        ("short scales", rep(ok_int8, scales=ok_int8.scales[:2]), ValueError, "scales must have 3 elements"),
        ("n too big", rep(ok_int8, n=301), ValueError, "codes must have 301 elements"),
        ("negative n", rep(ok_int8, n=-1), ValueError, "n must be an int >= 0"),
        ("block 0", rep(ok_int8, block=0), ValueError, "block must be an int"),
        ("bigger block", rep(ok_sign, block=50), ValueError, "scales must have 6 elements"),
        ("sign bytes", rep(ok_sign, n=310), ValueError, "codes must have 39 elements"),
        ("k too big", rep(ok_topk, k=301), ValueError, "k must be an int in"),
        ("k mismatch", rep(ok_topk, k=4), ValueError, "codes must have 4 elements"),
        ("indices missing", rep(ok_topk, indices=None), ValueError, "indices is missing"),
        ("index past n", rep(ok_topk, indices=torch.tensor([0, 1, 2, 3, 300], dtype=torch.int32)), ValueError,
         r"must lie in \[0, n=300\)"),
        ("negative index", rep(ok_topk, indices=torch.tensor([-1, 1, 2, 3, 4], dtype=torch.int32)),
         ValueError,
         r"must lie in \[0, n=300\)"),
        ("unsorted", rep(ok_topk, indices=torch.tensor([0, 2, 1, 3, 4], dtype=torch.int32)), ValueError,
         "strictly ascending"),
        ("duplicate", rep(ok_topk, indices=torch.tensor([0, 1, 1, 3, 4], dtype=torch.int32)), ValueError,
         "strictly ascending"),
        ("not a payload", {"codec": "int8"}, TypeError, "must be a pyasync Payload"),
        ("strided codes", rep(ok_int8, codes=torch.zeros(600, dtype=torch.int8)[::2]), ValueError,
         "contiguous"),
    ]


_MALFORMED = ["unknown codec", "short codes", "codes dtype", "scales missing", "short scales", "n too big",
              "negative n", "block 0", "bigger block", "sign bytes", "k too big", "k mismatch",
              "indices missing",
              "index past n", "negative index", "unsorted", "duplicate", "not a payload", "strided codes"]


@pytest.mark.parametrize("name", _MALFORMED)
def test_malformed_payload_raises(name):
    cases = {c[0]: c for c in _malformed()}
    assert sorted(cases) == sorted(_MALFORMED)
    _, p, exc, msg = cases[name]
    with pytest.raises(exc, match=msg):
        C.decode(p)


def test_bad_decode_arguments():
    p = C.encode("int8", torch.randn(100))
    with pytest.raises(ValueError, match="out must have 100 elements"):
        C.decode(p, out=torch.zeros(99))
    with pytest.raises(TypeError, match="out must have dtype"):
        C.decode(p, out=torch.zeros(100, dtype=torch.float16))
    with pytest.raises(TypeError, match="alpha must be a float"):
        C.decode(p, alpha="2")
    with pytest.raises(TypeError, match="accumulate must be a bool"):
        C.decode(p, accumulate=1)


# -- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("block", [32, 256, 1000, 13, 5000])
@pytest.mark.parametrize("n", SIZES + [25_000_000 // 4])
@pytest.mark.parametrize("codec", CAST + BLOCKY)
def test_cuda_matches_cpu(codec, n, block):
    if codec in CAST and block != 256:
        pytest.skip("block only matters for int8 / sign")
    g, e = _gen(n, 18), _gen(n, 19, 0.01)
    g[n // 2] = float("nan") if n > 1000 else g[n // 2]
    ro = torch.empty(n)
    p = C.encode(codec, g, residual_in=e, residual_out=ro, block=block)
    gd, ed = g.cuda(), e.cuda()
    rod = torch.empty_like(ed)
    pd = C.encode(codec, gd, residual_in=ed, residual_out=rod, block=block)
    assert pd.finite == p.finite
    pc = Payload(**{**pd.__dict__, "codes": pd.codes.cpu(),
                    "scales": None if pd.scales is None else pd.scales.cpu()})
    assert _codes_equal(pc, p)
    if codec == "sign":
        torch.testing.assert_close(pc.scales, p.scales, rtol=2e-6, atol=0)
        torch.testing.assert_close(rod.cpu(), ro, rtol=0, atol=1e-6 * float(p.scales.abs().max()) + 1e-30)
    else:
        if codec == "int8":
            assert torch.equal(pc.scales, p.scales)
        assert torch.equal(rod.cpu(), ro)
    base = _gen(n, 20)
    dd = C.decode(pd, out=base.cuda(), alpha=0.5, accumulate=True)
    dc = C.decode(pc, out=base.clone(), alpha=0.5, accumulate=True)
    if codec == "sign":
        torch.testing.assert_close(dd.cpu(), R.decode(pc, out=base.clone(), alpha=0.5, accumulate=True))
    else:
        assert torch.equal(dd.cpu(), dc)
    # in place on the GPU equals separate
    r = ed.clone()
    C.encode(codec, gd, residual_in=r, residual_out=r, block=block)
    assert torch.equal(r, rod)


@pytest.mark.cuda
def test_cuda_topk_decode_and_flag():
    n = 4097
    g = _gen(n, 21)
    p = C.encode("topk", g, k=40)
    pd = Payload(**{**p.__dict__, "codes": p.codes.cuda(), "indices": p.indices.cuda()})
    assert torch.equal(C.decode(pd).cpu(), C.decode(p))
    base = _gen(n, 22)
    assert torch.equal(C.decode(pd, out=base.cuda(), alpha=2.0, accumulate=True).cpu(),
                       C.decode(p, out=base.clone(), alpha=2.0, accumulate=True))
    # a corrupt index is skipped on the GPU (no host sync to report it), never written out of bounds
    bad = Payload(**{**pd.__dict__, "indices": pd.indices.clone()})
    bad.indices[-1] = n + 1000
    out = torch.zeros(n + 2000, device="cuda")
    C.decode(bad, out=out[:n])
    assert out[n:].eq(0).all()
    g[7] = float("inf")
    assert not C.encode("int8", g.cuda()).finite


@pytest.mark.cuda
@pytest.mark.parametrize("residual", [False, True], ids=["noef", "ef"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec", CAST + BLOCKY + ["topk"])
def test_cuda_matches_reference(codec, n, residual):
    """The CUDA kernels against the reference run on the same GPU tensors, with and without error
    feedback, a NaN in the 4097-element case; then decode (alpha, with and without accumulate)."""
    g = _gen(n, 24).cuda()
    if n == 4097:
        g[n // 3] = float("nan")
    e = _gen(n, 25, 0.01).cuda() if residual else None
    k = C.topk_count(n, 0.01) if codec == "topk" else 0
    for block in (256, 13) if codec in BLOCKY else (256,):
        p = _check_against_reference(codec, g, e, block, k=k)
        assert p.codes.is_cuda and p.finite == (n != 4097)
        for alpha, accumulate in ((1.0, False), (-0.5, True)):
            base = _gen(n, 26).cuda()
            got = C.decode(p, out=base.clone(), alpha=alpha, accumulate=accumulate)
            want = R.decode(p, out=base.clone(), alpha=alpha, accumulate=accumulate)
            # Both decode the same payload: one product and one sum, rounded alike (NaN codes stay NaN).
            what = f"{codec} block={block} alpha={alpha} accumulate={accumulate}"
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, w=what: f"{w}: {m}")
