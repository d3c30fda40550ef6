"""Bucket assignment and shard layout: pure functions, exact expected lists."""

import pytest

from pyasync.engine.core.buckets import compute_bucket_assignment_by_size
from pyasync.engine.core.shards import build_layout, shard_bounds


def test_reverse_order_and_cap():
    sizes = [40, 40, 40, 40, 40]
    f32 = ["f32"] * 5
    cpu = ["cpu"] * 5
    assert compute_bucket_assignment_by_size(sizes, f32, cpu, 100) == [[4, 3, 2], [1, 0]]
    assert compute_bucket_assignment_by_size(sizes, f32, cpu, 80) == [[4, 3], [2, 1], [0]]
    assert compute_bucket_assignment_by_size(sizes, f32, cpu, 1) == [[4], [3], [2], [1], [0]]
    assert compute_bucket_assignment_by_size(sizes, f32, cpu, 10**9) == [[4, 3, 2, 1, 0]]


def test_large_parameter_gets_its_own_bucket():
    assert compute_bucket_assignment_by_size([10, 500, 10, 10], ["a"] * 4, ["d"] * 4, 100) == [[3, 2, 1], [0]]


def test_dtypes_and_devices_never_share_a_bucket():
    sizes = [10, 10, 10, 10, 10, 10]
    dtypes = ["f32", "bf16", "f32", "bf16", "f32", "f32"]
    devices = ["cpu"] * 5 + ["cuda:0"]
    assert compute_bucket_assignment_by_size(sizes, dtypes, devices, 25) == [[5], [4, 2, 0], [3, 1]]
    assert compute_bucket_assignment_by_size(sizes, dtypes, devices, 20) == [[5], [4, 2], [3, 1], [0]]


def test_empty_and_zero_sized():
    assert compute_bucket_assignment_by_size([], [], [], 10) == []
    assert compute_bucket_assignment_by_size([0, 0], ["a", "a"], ["d", "d"], 10) == [[1, 0]]


@pytest.mark.parametrize(
    "args, match",
    [
        (([1, 2], ["a"], ["d", "d"], 10), "same length"),
        (([1], ["a"], ["d"], 0), "cap_bytes"),
        (([1], ["a"], ["d"], 1.5), "cap_bytes"),
        (([-1], ["a"], ["d"], 10), r"sizes_bytes\[0\]"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        compute_bucket_assignment_by_size(*args)


def test_shard_bounds():
    assert shard_bounds(10, 3) == [0, 3, 6, 10]
    assert shard_bounds(2, 4) == [0, 0, 1, 1, 2]
    assert shard_bounds(0, 2) == [0, 0, 0]
    with pytest.raises(ValueError):
        shard_bounds(5, 0)


def test_layout_segments_cover_shards_exactly():
    # params 0..3 with numels 3, 5, 0, 4; groups 0, 1, 1, 0; one bucket [3, 2, 1, 0] (gradient order)
    numels = [3, 5, 0, 4]
    lay = build_layout([[3, 2, 1, 0]], numels, [0, 1, 1, 0], 3)[0]
    assert lay.offsets == [0, 4, 4, 9] and lay.numel == 12
    assert [(s.begin, s.end) for s in lay.shards] == [(0, 4), (4, 8), (8, 12)]
    s0, s1, s2 = lay.shards
    assert [(g.param, g.slot, g.group, g.begin, g.end, g.param_begin) for g in s0.segments] == [
        (3, 0, 0, 0, 4, 0)
    ]
    assert [(g.param, g.slot, g.group, g.begin, g.end, g.param_begin) for g in s1.segments] == [
        (1, 2, 1, 0, 4, 0)
    ]
    assert [(g.param, g.slot, g.group, g.begin, g.end, g.param_begin) for g in s2.segments] == [
        (1, 2, 1, 0, 1, 4),
        (0, 3, 0, 1, 4, 0),
    ]
    assert s2.slots == [2, 3]
    for sh in lay.shards:  # segments tile each shard
        covered = sum(g.end - g.begin for g in sh.segments)
        assert covered == sh.numel


def test_layout_more_ranks_than_elements():
    lay = build_layout([[0]], [2], [0], 4)[0]
    assert [s.numel for s in lay.shards] == [0, 1, 0, 1]
    assert [len(s.segments) for s in lay.shards] == [0, 1, 0, 1]
