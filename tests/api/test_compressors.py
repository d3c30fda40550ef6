"""Compressor classes (pyasync.compression): error feedback over steps, NaN steps, specs, state."""

from __future__ import annotations

import io

import pytest
import torch

from pyasync import compression as comp
from pyasync.ops import codecs as C

LOSSY = [
    comp.FP16(),
    comp.BF16(),
    comp.Int8(),
    comp.Int8(block=1000),
    comp.Sign(),
    comp.Sign(block=13),
    comp.TopK(),
    comp.TopK(ratio=0.1),
]


def _grad(n: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, generator=g) * (1.0 + step % 3)


def _fresh(c: comp.Compressor) -> comp.Compressor:
    return comp.from_spec(c.spec())


@pytest.mark.parametrize("n", [4097, 278011])
@pytest.mark.parametrize("proto", LOSSY, ids=lambda c: c.spec())
def test_error_feedback_invariant_over_20_steps(proto, n):
    c = _fresh(proto)
    key = ("bucket", 0)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for step in range(20):
        g = _grad(n, step)
        e_old = c.residual(key)
        e_old = torch.zeros(n) if e_old is None else e_old.clone()
        p = c.compress(g, key=key)
        assert p.finite and p.codec == c.name
        d = c.decompress(p)
        e_new = c.residual(key)
        v = g + e_old
        # what was sent plus what is kept is what had to be sent, up to one rounding of v
        torch.testing.assert_close(d + e_new, v, rtol=2e-7, atol=1e-7 * float(v.abs().max()))
        sent += d.double()
        total += g.double()
    # over the steps: sum of decompressed == sum of gradients - final residual
    want = total - c.residual(key).double()
    scale = float(total.abs().max())
    torch.testing.assert_close(sent, want, rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("proto", LOSSY, ids=lambda c: c.spec())
def test_nan_step_leaves_residual_untouched(proto):
    c = _fresh(proto)
    n = 4097
    c.compress(_grad(n, 0), key=7)
    c.compress(_grad(n, 1), key=7)
    before = c.residual(7).clone()
    bad = _grad(n, 2)
    bad[100] = float("nan")
    bad[4000] = float("-inf")
    p = c.compress(bad, key=7)
    assert not p.finite
    assert torch.equal(c.residual(7), before)
    # and the next finite step continues from that residual exactly like a compressor that never saw it
    twin = _fresh(proto)
    twin.load_state_dict(c.state_dict())
    g = _grad(n, 3)
    p1, p2 = c.compress(g, key=7), twin.compress(g, key=7)
    assert p1.finite and torch.equal(p1.codes, p2.codes)
    assert torch.equal(c.residual(7), twin.residual(7))


def test_keys_are_independent_and_sizes_checked():
    c = comp.Int8()
    c.compress(_grad(100, 0), key=(0, 0))
    c.compress(_grad(300, 1), key=(0, 1))
    assert c.residual((0, 0)).numel() == 100 and c.residual((0, 1)).numel() == 300
    with pytest.raises(ValueError, match=r"slot \(0, 0\) holds 100 elements but the tensor has 101"):
        c.compress(_grad(101, 2), key=(0, 0))
    c.reset()
    assert c.residual((0, 0)) is None and c.state_dict() == {}
    c.compress(_grad(101, 2), key=(0, 0))  # fine after reset


def test_compress_accepts_any_contiguous_shape():
    c = comp.FP16()
    g = _grad(60, 0)
    p = c.compress(g.view(3, 4, 5), key="w")
    assert p.n == 60
    out = torch.empty(3, 20)
    assert c.decompress(p, out=out) is out
    torch.testing.assert_close(out.view(-1), g, rtol=1e-3, atol=1e-3)


def test_without_error_feedback_there_is_no_state():
    for c in (comp.Int8(error_feedback=False), comp.TopK(0.2, error_feedback=False), comp.NoCompression()):
        g = _grad(500, 0)
        p1, p2 = c.compress(g, key=1), c.compress(g, key=1)
        assert torch.equal(c.decompress(p1), c.decompress(p2))
        assert c.state_dict() == {} and c.residual(1) is None
    c = comp.NoCompression()
    g = _grad(500, 1)
    assert torch.equal(c.decompress(c.compress(g)), g)
    g[3] = float("inf")
    assert not c.compress(g).finite


def test_state_dict_round_trip():
    c = comp.Sign(block=64)
    for step in range(3):
        for key in ((0, 0), (0, 1), (1, 0)):
            c.compress(_grad(1000 + 10 * key[1], step), key=key)
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert set(sd) == {(0, 0), (0, 1), (1, 0)}
    twin = comp.from_spec(c.spec())
    twin.load_state_dict(sd)
    for key in sd:
        assert torch.equal(twin.residual(key), c.residual(key))
    g = _grad(1010, 9)
    p1, p2 = c.compress(g, key=(0, 1)), twin.compress(g, key=(0, 1))
    assert torch.equal(p1.codes, p2.codes) and torch.equal(p1.scales, p2.scales)
    assert torch.equal(c.residual((0, 1)), twin.residual((0, 1)))
    # the state dict is a copy, not a view of the live buffers
    sd2 = c.state_dict()
    c.compress(_grad(1010, 10), key=(0, 1))
    assert not torch.equal(sd2[(0, 1)], c.residual((0, 1)))
    with pytest.raises(TypeError, match="float32 tensor"):
        twin.load_state_dict({(0, 0): [1.0, 2.0]})
    with pytest.raises(ValueError, match="keeps no residuals"):
        comp.Int8(error_feedback=False).load_state_dict({0: torch.zeros(3)})


# -- specs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "c, spec",
    [
        (comp.NoCompression(), "none"),
        (comp.FP16(), "fp16(ef=1)"),
        (comp.BF16(error_feedback=False), "bf16(ef=0)"),
        (comp.Int8(), "int8(block=256,ef=1)"),
        (comp.Int8(block=128, error_feedback=False), "int8(block=128,ef=0)"),
        (comp.Sign(block=32), "sign(block=32,ef=1)"),
        (comp.TopK(), "topk(ratio=0.01,ef=1)"),
        (comp.TopK(ratio=1 / 3), f"topk(ratio={1 / 3!r},ef=1)"),
        (comp.Int8(replies=False), "int8(block=256,ef=1,replies=0)"),
        (comp.TopK(error_feedback=False, replies=False), "topk(ratio=0.01,ef=0,replies=0)"),
    ],
    ids=lambda x: x if isinstance(x, str) else type(x).__name__,
)
def test_spec_round_trip(c, spec):
    assert c.spec() == spec
    back = comp.from_spec(spec)
    assert type(back) is type(c) and back.spec() == spec and back == c


@pytest.mark.parametrize(
    "text, want",
    [
        ("none", "none"),
        ("fp16", "fp16(ef=1)"),
        ("bf16", "bf16(ef=1)"),
        ("int8", "int8(block=256,ef=1)"),
        ("int8:128", "int8(block=128,ef=1)"),
        ("sign", "sign(block=256,ef=1)"),
        ("sign:64", "sign(block=64,ef=1)"),
        ("topk", "topk(ratio=0.01,ef=1)"),
        ("topk:0.05", "topk(ratio=0.05,ef=1)"),
        (" Int8:512 ", "int8(block=512,ef=1)"),
        ("int8(ef=0)", "int8(block=256,ef=0)"),
        ("int8(replies=0)", "int8(block=256,ef=1,replies=0)"),
        ("topk(replies=1)", "topk(ratio=0.01,ef=1)"),
    ],
)
def test_from_spec_strings(text, want):
    assert comp.from_spec(text).spec() == want


def test_from_spec_objects():
    c = comp.Int8()
    assert comp.from_spec(c) is c
    assert isinstance(comp.from_spec(None), comp.NoCompression)


@pytest.mark.parametrize(
    "bad, exc, msg",
    [
        ("int9", ValueError, "unknown compression 'int9'"),
        ("", ValueError, "unknown compression"),
        ("int8:abc", ValueError, "bad value 'abc' for 'block'"),
        ("int8:0", ValueError, "block must be in"),
        ("topk:0", ValueError, "ratio must be in"),
        ("topk:2", ValueError, "ratio must be in"),
        ("fp16:3", ValueError, "takes no argument"),
        ("int8(block=0,ef=1)", ValueError, "block must be in"),
        ("int8(foo=1)", ValueError, "unexpected argument 'foo=1'"),
        ("int8(ef=2)", ValueError, "bad value '2' for 'ef'"),
        ("topk(block=3)", ValueError, "unexpected argument"),
        (42, TypeError, "must be a Compressor, None or a str"),
        (comp.Int8, TypeError, "must be a Compressor, None or a str"),
    ],
)
def test_from_spec_errors(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        comp.from_spec(bad)


@pytest.mark.parametrize(
    "make, exc, msg",
    [
        (lambda: comp.Int8(block=0), ValueError, "block must be in"),
        (lambda: comp.Sign(block=-4), ValueError, "block must be in"),
        (lambda: comp.Int8(block=2.5), TypeError, "block must be an int"),
        (lambda: comp.Int8(block=True), TypeError, "block must be an int"),
        (lambda: comp.TopK(ratio=0), ValueError, "ratio must be in"),
        (lambda: comp.TopK(ratio=1.5), ValueError, "ratio must be in"),
        (lambda: comp.TopK(ratio="0.1"), TypeError, "ratio must be a float"),
        (lambda: comp.FP16(error_feedback=1), TypeError, "error_feedback must be a bool"),
        (lambda: comp.Compressor(), TypeError, "base class"),
    ],
)
def test_bad_constructor_arguments(make, exc, msg):
    with pytest.raises(exc, match=msg):
        make()


def test_compress_rejects_bad_tensors_and_foreign_payloads():
    c = comp.Int8()
    with pytest.raises(TypeError, match="float32"):
        c.compress(torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        c.compress(torch.zeros(10, 10).t())
    with pytest.raises(TypeError, match="torch.Tensor"):
        c.compress([1.0])
    with pytest.raises(ValueError, match="codec 'sign'"):
        c.decompress(comp.Sign().compress(torch.ones(10)))


@pytest.mark.parametrize("proto", [comp.NoCompression()] + LOSSY, ids=lambda c: c.spec())
def test_wire_bytes_and_ratio(proto):
    c = _fresh(proto)
    for n in (1, 1000, 4097):
        assert c.wire_bytes(n) == c.compress(_grad(n, 0), key=n).nbytes
        assert c.ratio(n) == c.wire_bytes(n) / (4 * n)
    expected = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}
    if c.name in expected:
        assert c.ratio() == expected[c.name]
    elif c.name == "int8":
        assert c.ratio() == pytest.approx((1 + 4 / c.block) / 4, rel=1e-6)
    elif c.name == "sign":
        assert c.ratio() == pytest.approx((1 / 8 + 4 / c.block) / 4, rel=1e-3)
    else:
        assert c.ratio() == pytest.approx(2 * c.topk_ratio, rel=1e-3)
    assert C.payload_nbytes("int8", 1000, block=256) == comp.Int8().wire_bytes(1000)
