"""Top-k compression kernel (exact k largest |v|, with error feedback) against its reference.

The kernels must equal pyasync.reference.topk bit for bit: index sets, values, residuals and the
non-finite flag. See Note [Top-k selection] in csrc/include/pyasync/math/topk.h.
"""

from __future__ import annotations

import pytest
import torch

from pyasync import _ext
from pyasync.ops import codecs
from pyasync.reference.topk import topk_encode, topk_key

SIZES = [1, 255, 4097, 278011]
BIG = 25_000_000 // 4


def _ks(n: int) -> list[int]:
    """k = 1, small, 1 %, n (deduplicated)."""
    return sorted({1, min(n, 7), max(1, n // 100), n})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _run(g: torch.Tensor, r: torch.Tensor | None, k: int, mode: str, **kw):
    """The kernel under `mode`: "none" (no residual), "out" (separate residual_out) or "inplace".
    Returns (payload, new residual or None); `r` itself is never modified."""
    if mode == "none":
        return codecs.encode("topk", g, k=k, **kw), None
    r_in = r.clone()
    r_out = r_in if mode == "inplace" else torch.full_like(r, 12345.0)
    p = codecs.encode("topk", g, residual_in=r_in, residual_out=r_out, k=k, **kw)
    return p, r_out


def _check(g: torch.Tensor, r: torch.Tensor | None, k: int, mode: str = "inplace", ref=None, **kw):
    """Kernel == reference exactly (ref: a precomputed reference result); returns the kernel's
    (payload, residual)."""
    if ref is None:
        ref = topk_encode(g.cpu(), None if mode == "none" else r.cpu(), k)
    ref, ref_res = ref
    p, res = _run(g, r, k, mode, **kw)
    assert p.codec == "topk" and p.k == k and p.n == g.numel()
    assert p.indices.dtype == torch.int32 and p.codes.dtype == torch.float32
    assert torch.equal(p.indices.cpu(), ref.indices), "index sets differ"
    assert torch.equal(_bits(p.codes.cpu()), _bits(ref.codes)), "values differ"
    assert p.finite == ref.finite
    if mode != "none":
        assert torch.equal(_bits(res.cpu()), _bits(ref_res)), "residuals differ"
    return p, res


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), 0.3 * torch.randn(n, generator=gen)


# ---------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("mode", ["none", "out", "inplace"])
@pytest.mark.parametrize("n", SIZES, ids=[f"n{n}" for n in SIZES])
def test_matches_reference(n: int, mode: str) -> None:
    g, r = _data(n, n)
    for k in _ks(n):
        _check(g, r, k, mode)


@pytest.mark.parametrize("k", [1, 7, BIG // 100, BIG], ids=["k1", "k7", "k1pct", "kn"])
def test_matches_reference_big(k: int) -> None:
    g, r = _data(BIG, 1)
    _check(g, r, k, "inplace")


def test_indices_ascending_and_values_are_v() -> None:
    g, r = _data(278011, 5)
    p, _ = _run(g, r, 2780, "out")
    idx = p.indices.long()
    assert bool((idx[1:] > idx[:-1]).all())
    v = g + r
    assert torch.equal(_bits(p.codes), _bits(v[idx]))
    # Every kept |v| is >= every dropped |v| (finite data: the keys order |v|).
    dropped = torch.ones(g.numel(), dtype=torch.bool)
    dropped[idx] = False
    assert float(v[idx].abs().min()) >= float(v[dropped].abs().max())


@pytest.mark.parametrize("n", [4097, 278011], ids=["n4097", "n278011"])
def test_ties(n: int) -> None:
    gen = torch.Generator().manual_seed(3)
    few = torch.randint(-3, 4, (n,), generator=gen).float()  # many equal magnitudes, both signs
    ones = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)  # all |v| equal
    zeros = torch.zeros(n)
    ks = _ks(n) + [n // 3, n - 1] if n < 10_000 else [1, n // 100, n // 3, n]
    for g in (few, ones, zeros):
        for k in ks:
            ref = topk_encode(g, zeros, k)
            _check(g, None, k, "none", ref=(ref[0], None))  # v = g + 0 = g: same selection and values
            _check(g, zeros, k, "inplace", ref=ref)
    # All equal: the first k indices are kept.
    p, _ = _run(ones, None, 10, "none")
    assert p.indices.tolist() == list(range(10))


def test_negative_values_keep_sign() -> None:
    g = -torch.arange(1.0, 1001.0)
    p, _ = _check(g, None, 10, "none")
    assert p.indices.tolist() == list(range(990, 1000))
    assert p.codes.tolist() == [-float(i) for i in range(991, 1001)]


def test_negative_zero_without_residual() -> None:
    g = torch.tensor([-0.0, 0.0, -0.0, 1.0])
    p, _ = _check(g, None, 3, "none")
    assert _bits(p.codes).tolist() == _bits(torch.tensor([-0.0, 0.0, 1.0])).tolist()


@pytest.mark.parametrize("mode", ["out", "inplace"])
def test_error_feedback_invariant(mode: str) -> None:
    """decode(payload) + new residual == grad + old residual, bit for bit (finite data)."""
    g, r = _data(278011, 7)
    for k in (1, 2780, 278011):
        p, res = _run(g, r, k, mode)
        assert torch.equal(_bits(codecs.decode(p) + res), _bits(g + r))
        kept = torch.zeros(g.numel(), dtype=torch.bool)
        kept[p.indices.long()] = True
        assert bool((res[kept] == 0).all()) and int(kept.sum()) == k


def test_repeated_steps_match_reference() -> None:
    """Error feedback over several steps (the residual's distribution drifts: a stress test of the
    sampled collection bound) stays equal to the reference."""
    n, k = 300_000, 3000
    gen = torch.Generator().manual_seed(11)
    res = torch.zeros(n)
    ref_res = torch.zeros(n)
    scale = torch.exp(2.0 * torch.randn(n, generator=gen))  # heavy-tailed per-element scales
    for _ in range(6):
        g = scale * torch.randn(n, generator=gen)
        ref, ref_res = topk_encode(g, ref_res, k)
        p = codecs.encode("topk", g, residual_in=res, residual_out=res, k=k)
        assert torch.equal(p.indices, ref.indices)
        assert torch.equal(_bits(res), _bits(ref_res))


@pytest.mark.parametrize(
    "case", ["sorted", "reversed", "spike", "lognormal"], ids=["sorted", "reversed", "spike", "lognormal"]
)
def test_skewed_layouts(case: str) -> None:
    """Large values concentrated in one thread's chunk, or far outside the sample's view."""
    n = 200_000  # >= 3 * 65536: three threads get a chunk each
    gen = torch.Generator().manual_seed(13)
    if case == "sorted":
        g = torch.sort(torch.randn(n, generator=gen).abs()).values
    elif case == "reversed":
        g = torch.sort(torch.randn(n, generator=gen).abs(), descending=True).values
    elif case == "spike":  # a few huge values, the rest tiny and tied: k reaches into the ties
        g = torch.full((n,), 1e-3)
        g[torch.randperm(n, generator=gen)[:500]] = 1e3
    else:
        g = torch.exp(8.0 * torch.randn(n, generator=gen))
    zeros = torch.zeros(n)
    for k in (1, 500, 2000, n // 2):
        ref = topk_encode(g, zeros, k)
        for nt in (1, 2, 3):
            _check(g, zeros, k, "inplace", ref=ref, num_threads=nt)


@pytest.mark.parametrize("case", ["overflow", "sparse", "large_k"], ids=["overflow", "sparse", "large_k"])
def test_fallback_paths(case: str) -> None:
    """The kernel's slower paths (see Note [CPU top-k], step 2): candidates re-collected after one
    thread outgrew its share ("overflow": every large value in thread 0's chunk), and the streaming
    select for huge candidate sets ("sparse": fewer non-zeros than k, so millions of zero keys tie
    at the threshold; "large_k")."""
    n = 1_000_000
    gen = torch.Generator().manual_seed(41)
    zeros = torch.zeros(n)
    if case == "overflow":
        g, k = torch.sort(torch.randn(n, generator=gen).abs(), descending=True).values, n // 10
    elif case == "sparse":
        g, k = zeros.clone(), n // 100
        g[torch.randperm(n, generator=gen)[: n // 200]] = torch.randn(n // 200, generator=gen)
    else:
        g, k = torch.randn(n, generator=gen), n // 2
    ref = topk_encode(g, zeros, k)
    for nt in (1, 3):
        _check(g, zeros, k, "inplace", ref=ref, num_threads=nt)
        _check(g, zeros, k, "out", ref=ref, num_threads=nt)


@pytest.mark.parametrize("n", [278011, 1_000_003], ids=["n278011", "n1000003"])
def test_num_threads_equal(n: int) -> None:
    g, r = _data(n, 17)
    for k in (1, n // 100, n // 2):
        base, base_res = _run(g, r, k, "out", num_threads=1)
        for nt in (None, 2, 3, 4):
            p, res = _run(g, r, k, "out", num_threads=nt)
            assert torch.equal(p.indices, base.indices)
            assert torch.equal(_bits(p.codes), _bits(base.codes))
            assert torch.equal(_bits(res), _bits(base_res))


@pytest.mark.parametrize("n", [4097, 278011], ids=["n4097", "n278011"])
def test_nonfinite(n: int) -> None:
    g, r = _data(n, 19)
    g[3] = float("nan")
    g[n // 2] = float("inf")
    g[n - 1] = float("-inf")
    for k in (1, n // 100, n - 2, n):  # n - 2 and n keep some non-finite elements
        ref = topk_encode(g, r, k)
        for mode in ("out", "inplace"):
            p, res = _check(g, r, k, mode, ref=ref)
            assert not p.finite
            for i in (3, n // 2, n - 1):
                assert res[i].item() == r[i].item()  # the old residual stays
        p, _ = _check(g, None, k, "none")
        assert not p.finite
    # Non-finite keys are 0: with k < (finite non-zero elements) they are never kept.
    p, _ = _run(g, r, n // 100, "out")
    assert not {3, n // 2, n - 1} & set(p.indices.tolist())
    # A finite gradient whose sum with the residual overflows is bad as well.
    g2 = torch.tensor([3e38, 1.0, -2.0, 0.5])
    r2 = torch.tensor([3e38, 0.0, 0.0, 0.0])
    p, res = _check(g2, r2, 2, "inplace")
    assert not p.finite and p.indices.tolist() == [1, 2] and res[0].item() == r2[0].item()


def test_nonfinite_flag_accumulates() -> None:
    flag = torch.zeros(1, dtype=torch.int32)
    codecs.encode("topk", torch.randn(100), k=5, nonfinite=flag)
    assert int(flag[0]) == 0
    g = torch.randn(100)
    g[50] = float("nan")
    codecs.encode("topk", g, k=5, nonfinite=flag)
    assert int(flag[0]) == 1
    p = codecs.encode("topk", torch.randn(100), k=5, nonfinite=flag)
    assert int(flag[0]) == 1 and not p.finite  # never cleared by the kernel


def test_topk_key_orders_magnitudes() -> None:
    v = torch.tensor([0.0, -0.0, 1e-45, -1.0, 1.0, 2.0, float("inf"), float("nan"), -3.5])
    key = topk_key(v).tolist()
    assert key[0] == key[1] == key[6] == key[7] == 0
    assert key[3] == key[4] < key[5] < key[8] and key[2] == 1


@pytest.mark.parametrize("k", [0, -1, 101])
def test_k_out_of_range(k: int) -> None:
    g = torch.randn(100)
    with pytest.raises(ValueError, match="k must be in"):
        codecs.encode("topk", g, k=k)
    with pytest.raises(ValueError, match="k must be in"):
        topk_encode(g, None, k)


def test_k_wrong_type() -> None:
    with pytest.raises(TypeError, match="k"):
        codecs.encode("topk", torch.randn(10), k=2.0)
    with pytest.raises(TypeError, match="k"):
        topk_encode(torch.randn(10), None, True)


def test_core_rejects_bad_sizes() -> None:
    """The core re-checks what would corrupt memory, whoever calls it."""
    c = _ext.C()
    g = torch.randn(16)
    codes = torch.empty(16)
    idx = torch.empty(16, dtype=torch.int32)
    for n, k in ((16, 0), (16, 17), (0, 0)):
        with pytest.raises(ValueError):
            c.encode_cpu(
                grad=g.data_ptr(), residual_in=0, residual_out=0, codec=5, codes=codes.data_ptr(), scales=0,
                indices=idx.data_ptr(), n=n, k=k, block=0, nonfinite=0, workspace=0, workspace_bytes=0,
                num_threads=0, mask_out=0,
            )
    with pytest.raises(ValueError, match="1 <= k <= n"):
        c.topk_workspace_bytes(10, 11)
    with pytest.raises(ValueError, match="int32"):
        c.topk_workspace_bytes(1 << 31, 1)


def test_workspace_bytes() -> None:
    c = _ext.C()
    for n in (1, 255, 4097, 25_000_000):
        b = c.topk_workspace_bytes(n, 1)
        assert b >= 4 * n and b % 256 == 0
        assert b == c.topk_workspace_bytes(n, n)  # depends on n alone
        assert b < 4 * n + 64 * 1024 + 8 * (n // 4096 + 1) + 1024


# ---------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("mode", ["none", "out", "inplace"])
@pytest.mark.parametrize("n", SIZES + [BIG], ids=[f"n{n}" for n in SIZES + [BIG]])
def test_cuda_matches_reference(n: int, mode: str) -> None:
    g, r = _data(n, n)
    for k in _ks(n) if n < BIG else [1, n // 100]:
        _check(g.cuda(), r.cuda(), k, mode)


@cuda
@pytest.mark.parametrize("n", [4097, 278011], ids=["n4097", "n278011"])
def test_cuda_ties_and_nonfinite(n: int) -> None:
    gen = torch.Generator().manual_seed(23)
    few = torch.randint(-3, 4, (n,), generator=gen).float()
    g, r = _data(n, 29)
    g[5] = float("nan")
    g[n - 2] = float("inf")
    for data in (few, torch.zeros(n), torch.ones(n), g):
        for k in _ks(n) + [n // 3, n - 1]:
            for mode in ("none", "inplace"):
                _check(data.cuda(), r.cuda(), k, mode)


@cuda
def test_cuda_equals_cpu() -> None:
    g, r = _data(1_000_003, 31)
    for k in (1, 10_000, 500_001):
        pc, rc = _run(g, r, k, "out")
        pg, rg = _run(g.cuda(), r.cuda(), k, "inplace")
        assert torch.equal(pc.indices, pg.indices.cpu())
        assert torch.equal(_bits(pc.codes), _bits(pg.codes.cpu()))
        assert torch.equal(_bits(rc), _bits(rg.cpu()))
        assert pc.finite == pg.finite


@cuda
def test_cuda_repeated_steps_and_stream() -> None:
    n, k = 300_000, 3000
    gen = torch.Generator().manual_seed(37)
    res = torch.zeros(n, device="cuda")
    ref_res = torch.zeros(n)
    side = torch.cuda.Stream()
    for _ in range(4):
        g = torch.randn(n, generator=gen)
        ref, ref_res = topk_encode(g, ref_res, k)
        gd = g.cuda()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            p = codecs.encode("topk", gd, residual_in=res, residual_out=res, k=k)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(p.indices.cpu(), ref.indices)
        assert torch.equal(_bits(res.cpu()), _bits(ref_res))
