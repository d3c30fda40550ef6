"""Hand-offs between threads on a device: record an event where data is produced, make the consumer's
stream wait on it. No ``synchronize()`` in the hot path. On the CPU every call is a no-op (kernels
complete before they return)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["on_stream", "record_event", "side_stream", "used_here", "wait_event"]


def record_event(device: torch.device) -> Any:
    """An event recorded on ``device``'s current stream (None on the CPU)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def wait_event(event: Any, device: torch.device) -> None:
    """Make ``device``'s current stream wait for ``event`` (recorded by another thread or stream)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def side_stream(device: torch.device) -> Any:
    """A stream of its own for a background thread's kernels (None on the CPU)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def on_stream(stream: Any):
    """A context that runs kernels on ``stream`` (nothing on the CPU, where ``stream`` is None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def used_here(tensors: list, device: torch.device) -> None:
    """Tell the caching allocator that ``tensors`` (made on another thread's stream) are read on this
    thread's current stream, so their memory is not reused before that stream is done with them."""
    if device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    for t in tensors:
        if t is not None and t.device.type == "cuda":
            t.record_stream(stream)
