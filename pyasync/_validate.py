"""Argument checks shared by the whole package: one wording for every "must be a ..." error.

Every check returns the value (converted where it says so) or raises TypeError (wrong kind) /
ValueError (right kind, bad value) naming the argument. ``bool`` is never accepted as a number.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_bool", "check_int", "check_real", "overlaps"]


def check_bool(name: str, v: object) -> bool:
    """``v`` itself if it is a bool."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(v).__name__} ({v!r})")
    return v


def check_int(name: str, v: object, *, lo: int | None = None, hi: int | None = None, what: str = "") -> int:
    """``v`` itself if it is an int (not a bool) in [lo, hi]; ``what`` names the unit in messages."""
    if not isinstance(v, int) or isinstance(v, bool):
        unit = f" ({what})" if what else ""
        raise TypeError(f"{name} must be an int{unit}, got {type(v).__name__} ({v!r})")
    if lo is not None and hi is not None and not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}]{' ' + what if what else ''}, got {v}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_real(
    name: str, v: object, *, lo: float | None = None, lo_open: bool = False, hi: float | None = None
) -> float:
    """``float(v)`` if ``v`` is a finite int or float (not a bool) with lo <= v (lo < v when
    ``lo_open``) and v < hi."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(v).__name__} ({v!r})")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {v!r}")
    if lo is not None and (f <= lo if lo_open else f < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    if hi is not None and not f < hi:
        raise ValueError(f"{name} must be < {hi}, got {v!r}")
    return f


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do the memory ranges of two tensors overlap (empty tensors never do)?"""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
