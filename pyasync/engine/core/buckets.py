"""Bucket assignment: a pure function, like PyTorch's ``compute_bucket_assignment_by_size``."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["compute_bucket_assignment_by_size"]


def compute_bucket_assignment_by_size(
    sizes_bytes: Sequence[int],
    dtypes: Sequence[Hashable],
    devices: Sequence[Hashable],
    cap_bytes: int,
) -> list[list[int]]:
    """Group parameter indices into buckets of about ``cap_bytes`` bytes, in gradient order.

    Parameters are visited from the last to the first (backward produces gradients roughly in reverse
    order of registration). Only parameters with the same dtype and device share a bucket. A bucket is
    closed as soon as its size reaches ``cap_bytes`` (the parameter that crosses the cap stays in it, so
    a parameter larger than the cap gets a bucket of its own). Buckets are returned in the order they
    start, each listing its parameter indices in visiting (descending) order.

    sizes_bytes: bytes of each parameter (numel * element size); dtypes, devices: any hashable keys;
    cap_bytes: bucket size cap in bytes (> 0).
    """
    n = len(sizes_bytes)
    if len(dtypes) != n or len(devices) != n:
        raise ValueError(
            "sizes_bytes, dtypes and devices must have the same length, "
            f"got {n}, {len(dtypes)}, {len(devices)}"
        )
    if not isinstance(cap_bytes, int) or isinstance(cap_bytes, bool) or cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be an int > 0, got {cap_bytes!r}")
    for i, s in enumerate(sizes_bytes):
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"sizes_bytes[{i}] must be an int >= 0, got {s!r}")

    open_buckets: dict[tuple, tuple[int, list[int]]] = {}  # key -> (first index seen, indices)
    open_sizes: dict[tuple, int] = {}
    done: list[tuple[int, list[int]]] = []
    for i in reversed(range(n)):
        key = (dtypes[i], devices[i])
        if key not in open_buckets:
            open_buckets[key] = (i, [])
            open_sizes[key] = 0
        open_buckets[key][1].append(i)
        open_sizes[key] += sizes_bytes[i]
        if open_sizes[key] >= cap_bytes:
            done.append(open_buckets.pop(key))
            del open_sizes[key]
    done.extend(open_buckets.values())
    # Order by the first (highest) index: the order in which backward starts filling them.
    done.sort(key=lambda fb: -fb[0])
    return [indices for _, indices in done]
