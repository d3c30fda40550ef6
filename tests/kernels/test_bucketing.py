"""Bucketing kernels (pyasync.ops.bucketing) against their pure-torch twins (pyasync.reference.bucketing).

Every result is compared BIT for bit with the reference (NaN payloads aside: torch's own vectorised
and scalar casts disagree on those, so only NaN positions are compared). Layouts use awkward sizes
(1, 255, 4097, 278011), odd offsets (misaligned for the CUDA vector path), gaps that must stay
untouched, and value sets that hit fp16 overflow and subnormals.
"""

from __future__ import annotations

import pytest
import torch

from pyasync.ops import bucketing as ops
from pyasync.reference import bucketing as ref

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SENTINEL = -7.25  # exact in every dtype; marks bucket elements / tensor elements nobody may touch


# ---------------------------------------------------------------------------------------------- helpers


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "result") -> None:
    """Same dtype, shape, NaN positions, and identical bits everywhere else (so -0.0 != +0.0)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().cpu().reshape(-1)
    e = expected.detach().cpu().reshape(-1)
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        i = int((nan_a != nan_e).nonzero()[0])
        raise AssertionError(f"{what}: NaN positions differ, first at {i}: {a[i].item()} vs {e[i].item()}")
    ab = a.view(_BITS[a.dtype]).masked_fill(nan_a, 0)
    eb = e.view(_BITS[e.dtype]).masked_fill(nan_e, 0)
    if not torch.equal(ab, eb):
        bad = (ab != eb).nonzero().reshape(-1)
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} elements differ, first at {i}: {a[i].item()!r} (bits {int(ab[i]):#x}) vs "
            f"expected {e[i].item()!r} (bits {int(eb[i]):#x})"
        )


def make_values(n: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """n finite fp32 values over 12 decades (fp16 overflow and subnormals included), cast to dtype."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-7, 6, (n,), generator=g).float())
    specials = torch.tensor(
        [0.0, -0.0, 1e-40, -1e-45, 65504.0, 65519.99, 65520.0, -1e-7, 6e-8, 2.9802322e-08, 3.0e38,
         1.1754942e-38]
    )
    k = min(n, specials.numel())
    x[torch.randperm(n, generator=g)[:k]] = specials[:k]
    return x.to(dtype).to(device)


def layout(sizes: list[int], *, gap: int = 3, start: int = 1) -> tuple[list[int], int]:
    """Offsets with `gap` untouched elements between tensors (odd, so most offsets are misaligned)."""
    offsets, pos = [], start
    for n in sizes:
        offsets.append(pos)
        pos += n + gap
    return offsets, pos


def check_flatten(tensors, out_dtype, offsets, total, device, *, numels=None, scale=1.0, num_threads=None):
    """Run ops.flatten and ref.flatten on sentinel-filled buckets; compare bucket bits and the flag."""
    out = torch.full((total,), SENTINEL, dtype=out_dtype, device=device)
    expect = out.clone()
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    flag_ref = flag.clone()
    ret = ops.flatten(
        tensors, out, offsets, numels=numels, scale=scale, nonfinite=flag, num_threads=num_threads
    )
    ref.flatten(tensors, expect, offsets, numels=numels, scale=scale, nonfinite=flag_ref)
    assert ret is out
    assert_bits_equal(out, expect, "bucket")
    assert int(flag) == int(flag_ref), f"nonfinite flag {int(flag)} != reference {int(flag_ref)}"
    return out, int(flag)


# ---------------------------------------------------------------------------------------------- flatten

SIZE_CASES = [
    pytest.param([1], id="n1"),
    pytest.param([255, 1, 3], id="n255"),
    pytest.param([4097, 255, 1, 64], id="n4097"),
    pytest.param([278011, 4097, 17], id="n278011"),
]


@pytest.mark.parametrize("sizes", SIZE_CASES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_flatten_matches_reference(device, src_dtype, dst_dtype, sizes):
    tensors = [make_values(n, src_dtype, device, seed=i) for i, n in enumerate(sizes)]
    offsets, total = layout(sizes)
    out, _ = check_flatten(tensors, dst_dtype, offsets, total, device)  # plain converting copy
    # the gaps stay untouched
    covered = torch.zeros(total, dtype=torch.bool)
    for o, n in zip(offsets, sizes):
        covered[o : o + n] = True
    assert bool((out.cpu()[~covered] == SENTINEL).all())
    # scale folded into the copy (1/3 and 0.1 are inexact in binary: every product is rounded)
    check_flatten(tensors, dst_dtype, offsets, total, device, scale=1.0 / 3.0)
    check_flatten(tensors, dst_dtype, offsets, total, device, scale=0.1)


@pytest.mark.parametrize("dst_dtype", [DTYPES[0], DTYPES[2]])  # fp16 is checked inside for every source
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_flatten_every_16bit_pattern(device, src_dtype, dst_dtype):
    """All 65536 bit patterns of the 16-bit source types (subnormals, Inf, NaN included); for fp32 sources
    65536 random bit patterns plus the rounding boundaries of fp16 and bf16."""
    if src_dtype == torch.float32:
        g = torch.Generator().manual_seed(5)
        bits = torch.randint(-(2**31), 2**31 - 1, (65536,), generator=g, dtype=torch.int64).to(torch.int32)
        edges = [0x477FE000, 0x477FEFFF, 0x477FF000, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001,
                 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x3F808000, 0x3F818000, 0x00000001]  # fmt: skip
        edges = torch.tensor(edges, dtype=torch.int64).to(torch.int32)
        src = torch.cat([bits, edges, edges | (-(2**31))]).view(torch.float32)
    else:
        src = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(src_dtype)
    src = src.to(device)
    for out_dtype in (dst_dtype, torch.float16):
        _, flag = check_flatten([src], out_dtype, [0], src.numel(), device)
        assert flag == 1  # NaN and Inf patterns are in every set
        check_flatten([src], out_dtype, [0], src.numel(), device, scale=-0.75)


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_25mb_bucket(device):
    """A default-sized bucket: 25 MB of fp32 gradients from a mix of layer shapes, scaled by 1/world."""
    sizes = [4_000_000, 1_000_000, 278011, 4097, 4096, 255, 1]
    sizes.append(25 * 2**20 // 4 - sum(sizes))  # fill the bucket to exactly 25 MiB
    tensors = [make_values(n, torch.float32, device, seed=10 + i) for i, n in enumerate(sizes)]
    offsets, total = layout(sizes, gap=0, start=0)
    assert total * 4 == 25 * 2**20
    out, _ = check_flatten(tensors, torch.float32, offsets, total, device, scale=1.0 / 3.0)
    # and back: every tensor recovers its scaled values
    back = [torch.empty_like(t) for t in tensors]
    ops.unflatten(out, back, offsets)
    for t, b in zip(tensors, back):
        assert_bits_equal(b, t * (1.0 / 3.0), "unflattened tensor")


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_many_tiny_and_one_huge(device):
    """3000 tensors of 0..9 elements around one of 1M: the split must cover both kinds exactly."""
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 10, (3000,), generator=g).tolist()
    sizes.insert(1500, 1_000_003)
    tensors = [make_values(n, torch.float32, device, seed=i) if n else torch.empty(0, device=device)
               for i, n in enumerate(sizes)]  # fmt: skip
    offsets, total = layout(sizes, gap=1)
    for dst, nt in ((torch.float32, None), (torch.float32, 3), (torch.bfloat16, 2)):
        check_flatten(tensors, dst, offsets, total, device, scale=0.5, num_threads=nt)


@pytest.mark.cuda
def test_flatten_launch_tables_roll_over():
    """More than one launch table (> 36 tensors and > 320 chunks of 64K elements): 100 two-chunk
    tensors and one tensor longer than a whole table, at odd and even offsets. (The CPU split is
    covered by the many-tiny-and-one-huge test; this layout only matters to the CUDA launcher.)"""
    device = "cuda"
    sizes = [70_001] * 50 + [320 * 65536 + 12345] + [70_000] * 50
    tensors = [torch.full((n,), float(i % 7) - 3.0, device=device) for i, n in enumerate(sizes)]
    tensors[50][-1] = float("inf")  # in the last chunk of the second table
    offsets, total = layout(sizes, gap=1)
    _, flag = check_flatten(tensors, torch.bfloat16, offsets, total, device, scale=0.25)
    assert flag == 1


@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_flatten_none_sources_write_zeros(device, dst_dtype):
    sizes = [4097, 255, 1, 278011, 7]
    tensors = [make_values(n, torch.float16, device, seed=i) for i, n in enumerate(sizes)]
    tensors[1] = tensors[3] = None
    offsets, total = layout(sizes)
    out, _ = check_flatten(tensors, dst_dtype, offsets, total, device, numels=sizes, scale=2.0)
    zeros = out.cpu()[offsets[3] : offsets[3] + sizes[3]]
    assert_bits_equal(zeros, torch.zeros_like(zeros), "zero-filled slot")  # +0.0, not -0.0
    # only None entries: the dtype of the (absent) sources does not matter
    check_flatten([None, None], dst_dtype, [5, 0], 300, device, numels=[295, 5])


NONFINITE = [
    pytest.param(float("nan"), id="nan"),
    pytest.param(float("inf"), id="posinf"),
    pytest.param(float("-inf"), id="neginf"),
    pytest.param(None, id="finite"),
]


@pytest.mark.parametrize("where", ["first", "body", "last"])
@pytest.mark.parametrize("bad", NONFINITE)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_flatten_nonfinite_flag(device, src_dtype, bad, where):
    sizes = [255, 4097, 70_001, 3]
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=g).to(src_dtype).to(device) for n in sizes]
    pos = {"first": 0, "body": 2048, "last": 4096}[where]
    if bad is not None:
        tensors[1][pos] = bad
    offsets, total = layout(sizes)
    _, flag = check_flatten(tensors, torch.float32, offsets, total, device, scale=0.5)
    assert flag == (0 if bad is None else 1)
    # scale 0 does not hide a bad source: the check looks at the source values
    _, flag = check_flatten(tensors, torch.bfloat16, offsets, total, device, scale=0.0)
    assert flag == (0 if bad is None else 1)


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_nonfinite_flag_semantics(device):
    x = torch.tensor([3.0e38, -70000.0, 1.0], device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.empty(3, dtype=torch.float16, device=device)
    # finite sources that overflow after scaling / narrowing are not flagged (the check is on sources)
    ops.flatten([x], out, [0], scale=10.0, nonfinite=flag)
    assert int(flag) == 0
    assert out.cpu().isinf().tolist() == [True, True, False]
    # the flag is never cleared by a clean call
    flag.fill_(1)
    ops.flatten([torch.ones(5, device=device)], torch.empty(5, device=device), [0], nonfinite=flag)
    assert int(flag) == 1
    # without a flag tensor, NaNs are copied and nothing else happens
    out32 = torch.empty(2, device=device)
    ops.flatten([torch.tensor([float("nan"), 1.0], device=device)], out32, [0])
    assert out32.isnan().tolist() == [True, False]


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_in_place_slot(device):
    """Gradients that already live in their bucket slot (bucket views) are scaled in place."""
    sizes = [4097, 255, 1]
    offsets, total = layout(sizes, gap=0, start=0)
    bucket = make_values(total, torch.float32, device, seed=4)
    expect = bucket.clone()
    ref.flatten([expect[o : o + n].clone() for o, n in zip(offsets, sizes)], expect, offsets, scale=0.125)
    views = [bucket[o : o + n] for o, n in zip(offsets, sizes)]
    ops.flatten(views, bucket, offsets, scale=0.125)
    assert_bits_equal(bucket, expect, "in-place bucket")


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_empty_tensors_are_noops(device):
    out = torch.full((4,), SENTINEL, device=device)
    ops.flatten([torch.empty(0, device=device)], out, [4])  # offset == numel is in range for n = 0
    ops.flatten([torch.empty(0, 3, device=device), None], out, [0, 2], numels=[0, 0])
    ops.flatten([torch.empty(0, device=device)], torch.empty(0, device=device), [0])
    assert out.cpu().tolist() == [SENTINEL] * 4


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_multidimensional_and_shapes(device):
    """Tensors of any shape are taken flat (row-major); out may have any shape too."""
    a = make_values(6 * 35, torch.float32, device, seed=8).reshape(6, 5, 7)
    b = make_values(3, torch.float32, device, seed=9).reshape(3, 1)
    out = torch.full((4, 54), SENTINEL, dtype=torch.bfloat16, device=device)
    expect = out.clone()
    ops.flatten([a, b], out, [1, 211])
    ref.flatten([a, b], expect, [1, 211])
    assert_bits_equal(out, expect)
    assert_bits_equal(out.reshape(-1)[1:211], a.reshape(-1).to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_num_threads_do_not_change_results(device):
    sizes = [278011, 1, 255, 4097, 500_003, 33, 65536]
    tensors = [make_values(n, torch.float32, device, seed=20 + i) for i, n in enumerate(sizes)]
    tensors[4][499_999] = float("nan")
    offsets, total = layout(sizes)
    results = []
    for nt in (1, None, 2, 7):
        out, flag = check_flatten(tensors, torch.float16, offsets, total, device, scale=0.3, num_threads=nt)
        back = [torch.full_like(t, SENTINEL, dtype=torch.bfloat16) for t in tensors]
        ops.unflatten(out[1000:800_000], back, offsets, begin=1000, num_threads=nt)
        results.append((out, flag, back))
    out1, flag1, back1 = results[0]
    assert flag1 == 1
    for out, flag, back in results[1:]:
        assert_bits_equal(out, out1, "bucket vs num_threads=1")
        assert flag == flag1
        for b, b1 in zip(back, back1):
            assert_bits_equal(b, b1, "unflatten vs num_threads=1")


# -------------------------------------------------------------------------------------------- unflatten


def check_unflatten(src_full, sizes, offsets, dst_dtype, begin, end, device, num_threads=None):
    """Unflatten bucket elements [begin, end) into sentinel-filled tensors; compare with the reference."""
    src = src_full[begin:end]
    got = [torch.full((n,), SENTINEL, dtype=dst_dtype, device=device) for n in sizes]
    want = [t.clone() for t in got]
    ops.unflatten(src, got, offsets, begin=begin, num_threads=num_threads)
    ref.unflatten(src, want, offsets, begin=begin)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits_equal(g, w, f"tensors[{i}] after unflatten of [{begin}, {end})")
    return got


@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_unflatten_shard_slices(device, src_dtype, dst_dtype):
    sizes = [1, 255, 4097, 0, 278011, 17]
    offsets, total = layout(sizes, gap=2, start=3)
    src_full = make_values(total, src_dtype, device, seed=7)
    o = offsets
    slices = [
        (0, total),                        # the whole bucket
        (o[2] + 100, o[4] + 5000),         # cuts through tensors 2 and 4
        (o[4] + 1, o[4] + 2),              # one element inside a tensor
        (o[1] + 255, o[2]),                # only a gap
        (o[2] + 7, o[2] + 7),              # empty
        (o[5] + 16, total),                # the last element of the last tensor, then the gap
        (0, o[1] + 1),                     # the head, cutting tensor 1 after its first element
    ]  # fmt: skip
    g = torch.Generator().manual_seed(2)
    for _ in range(5):  # and random shards
        a, b = sorted(torch.randint(0, total + 1, (2,), generator=g).tolist())
        slices.append((a, b))
    for begin, end in slices:
        check_unflatten(src_full, sizes, offsets, dst_dtype, begin, end, device)


@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("device", DEVICES)
def test_unflatten_shards_reassemble_the_bucket(device, world):
    """Each owner's shard (fp32 master values) installed into bf16 parameters: together, the full cast."""
    sizes = [4097, 278011, 1, 255, 70_000]
    offsets, total = layout(sizes, gap=0, start=0)
    master = make_values(total, torch.float32, device, seed=11)
    params = [torch.full((n,), SENTINEL, dtype=torch.bfloat16, device=device) for n in sizes]
    shard = -(-total // world)
    for r in range(world):
        begin, end = min(r * shard, total), min((r + 1) * shard, total)
        ops.unflatten(master[begin:end], params, offsets, begin=begin)
    for p, o, n in zip(params, offsets, sizes):
        assert_bits_equal(p, master[o : o + n].to(torch.bfloat16), "parameter")


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_flatten_unflatten_round_trip(device, src_dtype):
    sizes = [278011, 1, 4097, 255]
    tensors = [make_values(n, src_dtype, device, seed=30 + i).reshape(-1, 1) for i, n in enumerate(sizes)]
    offsets, total = layout(sizes)
    bucket = torch.zeros(total, dtype=torch.float32, device=device)  # widening: lossless
    ops.flatten(tensors, bucket, offsets)
    back = [torch.empty_like(t) for t in tensors]
    ops.unflatten(bucket, back, offsets)
    for t, b in zip(tensors, back):
        assert_bits_equal(b, t, "round trip")


# ---------------------------------------------------------------------------------------- cross-checks


@pytest.mark.cuda
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
def test_cpu_and_cuda_agree(src_dtype, dst_dtype):
    sizes = [278011, 4097, 255, 1, 3]
    cpu = [make_values(n, src_dtype, "cpu", seed=40 + i) for i, n in enumerate(sizes)]
    cpu[0][1234] = float("nan")
    offsets, total = layout(sizes)
    outs, flags = [], []
    for device in ("cpu", "cuda"):
        out = torch.full((total,), SENTINEL, dtype=dst_dtype, device=device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        ops.flatten([t.to(device) for t in cpu], out, offsets, scale=0.3, nonfinite=flag)
        back = [torch.full((n,), SENTINEL, dtype=src_dtype, device=device) for n in sizes]
        ops.unflatten(out[5:-5], back, offsets, begin=5)
        outs.append((out, back))
        flags.append(int(flag))
    assert flags == [1, 1]
    assert_bits_equal(outs[1][0], outs[0][0], "CUDA bucket vs CPU bucket")
    for b_cuda, b_cpu in zip(outs[1][1], outs[0][1]):
        assert_bits_equal(b_cuda, b_cpu, "CUDA unflatten vs CPU unflatten")


@pytest.mark.cuda
def test_cuda_runs_on_the_current_stream():
    """The copy is ordered after work queued on the caller's current stream (no host sync needed)."""
    side = torch.cuda.Stream()
    src = torch.zeros(5_000_000, device="cuda")
    out = torch.empty(5_000_000, dtype=torch.bfloat16, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        src.add_(1.5)  # queued on `side`; flatten must see it
        ops.flatten([src], out, [0], scale=2.0)
    side.synchronize()
    assert bool((out == 3.0).all())


# ---------------------------------------------------------------------------------------------- bad input


def _flatten_case(**overrides):
    args = dict(tensors=[torch.ones(4), torch.ones(3)], out=torch.zeros(10), offsets=[0, 5])
    args.update(overrides)
    return args


_t = torch.ones
BAD_FLATTEN = [
    pytest.param(dict(tensors=[], offsets=[]), ValueError, "tensors is empty", id="empty-list"),
    pytest.param(dict(tensors=torch.ones(3), offsets=[0]), TypeError, "tensors must be a list",
                 id="not-a-list"),
    pytest.param(dict(offsets=[0]), ValueError, "offsets has 1 entries", id="offsets-length"),
    pytest.param(dict(numels=[4]), ValueError, "numels has 1 entries", id="numels-length"),
    pytest.param(dict(numels=[4, 2]), ValueError, r"numels\[1\] is 2 but tensors\[1\] has 3",
                 id="numels-mismatch"),
    pytest.param(dict(tensors=[_t(4), None]), ValueError, r"tensors\[1\] is None: pass numels",
                 id="none-no-numels"),
    pytest.param(dict(tensors=[_t(4), _t(3, dtype=torch.float16)]), TypeError, "share one dtype",
                 id="mixed-dtypes"),
    pytest.param(dict(tensors=[_t(4, dtype=torch.float64), _t(3)]), TypeError,
                 r"tensors\[0\] must have one of", id="src-float64"),
    pytest.param(dict(out=torch.zeros(10, dtype=torch.int32)), TypeError, "out must have one of",
                 id="out-int32"),
    pytest.param(dict(out=torch.zeros(10, 2)[:, 0]), ValueError, "out must be contiguous", id="out-strided"),
    pytest.param(dict(tensors=[_t(4, 2).t(), _t(3)], offsets=[0, 8]), ValueError,
                 r"tensors\[0\] must be contiguous", id="src-strided"),
    pytest.param(dict(tensors=[_t(4), "x"]), TypeError, r"tensors\[1\] must be a torch.Tensor",
                 id="src-not-tensor"),
    pytest.param(dict(offsets=[0, 8]), ValueError, r"tensors\[1\] needs bucket elements \[8, 11\)",
                 id="past-end"),
    pytest.param(dict(offsets=[0, 2]), ValueError, "tensors 0 and 1 overlap", id="overlapping"),
    pytest.param(dict(offsets=[0, -1]), ValueError, r"offsets\[1\] must be >= 0", id="negative-offset"),
    pytest.param(dict(offsets=[0, 5.0]), TypeError, r"offsets\[1\] must be an int", id="float-offset"),
    pytest.param(dict(offsets=[0, True]), TypeError, r"offsets\[1\] must be an int, got bool",
                 id="bool-offset"),
    pytest.param(dict(scale=float("nan")), ValueError, "scale must be finite", id="scale-nan"),
    pytest.param(dict(scale="0.5"), TypeError, "scale must be a float", id="scale-str"),
    pytest.param(dict(nonfinite=torch.zeros(1)), TypeError, "nonfinite must have dtype torch.int32",
                 id="flag-float"),
    pytest.param(dict(nonfinite=torch.zeros(2, dtype=torch.int32)), ValueError,
                 "nonfinite must have 1 elements", id="flag-numel"),
    pytest.param(dict(num_threads=-1), ValueError, "num_threads must be None or an int >= 0",
                 id="threads-negative"),
    pytest.param(dict(out=torch.zeros(10, device="meta")), ValueError, "pyasync kernels support cpu and cuda",
                 id="out-meta"),
]


@pytest.mark.parametrize("overrides, exc, match", BAD_FLATTEN)
def test_flatten_rejects_bad_input(overrides, exc, match):
    args = _flatten_case(**overrides)
    out = args["out"]
    before = out.clone() if out.device.type == "cpu" else None
    with pytest.raises(exc, match=match):
        ops.flatten(args.pop("tensors"), args.pop("out"), args.pop("offsets"), **args)
    if before is not None:
        assert torch.equal(out, before), "a rejected call must not write into out"


def test_flatten_rejects_aliasing():
    bucket = torch.zeros(10)
    with pytest.raises(ValueError, match=r"tensors\[0\] shares memory with out"):
        ops.flatten([bucket[2:6]], bucket, [0])  # a view of out, but not its own slot
    with pytest.raises(ValueError, match="nonfinite shares memory with out"):
        ops.flatten([torch.ones(2)], bucket.view(torch.int32)[:4].view(torch.float32), [0],
                    nonfinite=bucket.view(torch.int32)[3:4])  # fmt: skip


@pytest.mark.cuda
def test_flatten_rejects_mixed_devices():
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cpu but the other tensors are on cuda"):
        ops.flatten([torch.ones(2, device="cuda"), torch.ones(2)], torch.zeros(4, device="cuda"), [0, 2])
    with pytest.raises(ValueError, match="nonfinite is on cpu"):
        ops.flatten([torch.ones(2, device="cuda")], torch.zeros(4, device="cuda"), [0],
                    nonfinite=torch.zeros(1, dtype=torch.int32))  # fmt: skip


def _unflatten_case(**overrides):
    args = dict(src=torch.ones(10), tensors=[torch.zeros(4), torch.zeros(3)], offsets=[0, 5])
    args.update(overrides)
    return args


BAD_UNFLATTEN = [
    pytest.param(dict(tensors=[], offsets=[]), ValueError, "tensors is empty", id="empty-list"),
    pytest.param(dict(offsets=[0]), ValueError, "offsets has 1 entries", id="offsets-length"),
    pytest.param(dict(tensors=[torch.zeros(4), None]), TypeError, r"tensors\[1\] is None", id="none-dst"),
    pytest.param(dict(tensors=[torch.zeros(4), torch.zeros(3, dtype=torch.bfloat16)]), TypeError,
                 "must share one dtype", id="mixed-dtypes"),
    pytest.param(dict(src=torch.ones(10, dtype=torch.float64)), TypeError, "src must have one of",
                 id="src-float64"),
    pytest.param(dict(src=torch.ones(10, 2)[:, 0]), ValueError, "src must be contiguous", id="src-strided"),
    pytest.param(dict(tensors=[torch.zeros(4), torch.zeros(3, 2)[:, 0]]), ValueError,
                 r"tensors\[1\] must be contiguous", id="dst-strided"),
    pytest.param(dict(tensors=[torch.zeros(4), torch.zeros(3, dtype=torch.int8)]), TypeError,
                 r"tensors\[1\] must have one of", id="dst-int8"),
    pytest.param(dict(offsets=[0, 3]), ValueError, "tensor ranges in the bucket overlap", id="overlapping"),
    pytest.param(dict(begin=-1), ValueError, "begin must be >= 0", id="negative-begin"),
    pytest.param(dict(begin=1.5), TypeError, "begin must be an int", id="float-begin"),
    pytest.param(dict(num_threads=1.0), ValueError, "num_threads must be None or an int", id="threads-float"),
]


@pytest.mark.parametrize("overrides, exc, match", BAD_UNFLATTEN)
def test_unflatten_rejects_bad_input(overrides, exc, match):
    args = _unflatten_case(**overrides)
    with pytest.raises(exc, match=match):
        ops.unflatten(args.pop("src"), args.pop("tensors"), args.pop("offsets"), **args)


def test_unflatten_rejects_aliasing():
    buf = torch.zeros(10)
    with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] share memory"):
        ops.unflatten(torch.ones(8), [buf[0:4], buf[2:6]], [0, 4])
    with pytest.raises(ValueError, match=r"tensors\[1\] shares memory with src"):
        ops.unflatten(buf[0:5], [torch.zeros(2), buf[4:7]], [0, 2])


def test_core_rejects_what_python_would_not_send():
    """The bindings re-check what would corrupt memory even if the Python layer were bypassed."""
    from pyasync import _ext

    c = _ext.C()
    with pytest.raises(ValueError, match="same length"):
        c.flatten_cpu(srcs=[0], numels=[1, 2], offsets=[0], src_dtype=0, dst_dtype=0, bucket=0, scale=1.0,
                      nonfinite=0, num_threads=0)  # fmt: skip
    with pytest.raises(ValueError, match="unknown dtype id"):
        c.unflatten_cpu(dsts=[0], numels=[1], offsets=[0], src_dtype=5, dst_dtype=0, src=0, begin=0, end=1,
                        num_threads=0)  # fmt: skip
    with pytest.raises(ValueError, match="null source or destination"):
        c.unflatten_cpu(dsts=[0], numels=[1], offsets=[0], src_dtype=0, dst_dtype=0, src=0, begin=0, end=1,
                        num_threads=0)  # fmt: skip
    with pytest.raises(ValueError, match="null bucket"):
        c.flatten_cpu(srcs=[0], numels=[1], offsets=[0], src_dtype=0, dst_dtype=0, bucket=0, scale=1.0,
                      nonfinite=0, num_threads=0)  # fmt: skip
