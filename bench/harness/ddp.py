"""DDP's side of the benchmark: one communication hook that runs torch's all-reduce, fp16 or PowerSGD
hook, counts what this rank sends (the demo's ByteCount), and charges it the wire time of an emulated link.

Note [DDP bytes and link time]
    Bytes are counted under the ring model, whatever algorithm gloo picks: an all-reduce of B bytes
    makes each rank send ``2 (n - 1) / n * B`` (reduce-scatter plus all-gather). Per bucket, B is
    - ``ddp``: the bucket's fp32 bytes (torch's default all-reduce);
    - ``ddp+fp16``: half of them (``fp16_compress_hook`` all-reduces an fp16 copy);
    - ``ddp+powersgd``: during the first ``start_powerSGD_iter`` steps (warm-up) the bucket's bytes, as
      the hook falls back to a plain all-reduce; after that the P and Q factors plus the tensors the
      hook leaves uncompressed (biases, and matrices PowerSGD does not find worth compressing). That is
      the growth of ``PowerSGDState.total_numel_after_compression`` during the call, in elements of
      the bucket's dtype; the hook issues three all-reduces (uncompressed tensors, Ps, Qs).
    With a :class:`linkemu.Link`, the hook reserves those bytes on the link when it
    is called and returns a future that completes no earlier than the link says their last byte
    left, and no earlier than the real all-reduce (``complete_after``): the backward pass is never
    blocked, and DDP's wait at the end of backward pays the wire time, as it would on a real network.
"""

from __future__ import annotations

from linkemu import Link, complete_after
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from pyasync.demo.systems import ByteCount

__all__ = ["DdpCommState", "ddp_comm_hook"]


class DdpCommState(ByteCount):
    """State of :func:`ddp_comm_hook`: which hook runs, the bytes this rank sent, the link.

    ``kind`` is "allreduce", "fp16" or "powersgd"; ``powersgd_rank`` and ``powersgd_warmup`` configure
    PowerSGD (``matrix_approximation_rank`` and ``start_powerSGD_iter``; error feedback and warm start
    on, torch's defaults). See Note [DDP bytes and link time].
    """

    def __init__(
        self,
        kind: str,
        world: int,
        link: Link | None = None,
        powersgd_rank: int = 2,
        powersgd_warmup: int = 10,
        seed: int = 0,
    ) -> None:
        if kind not in ("allreduce", "fp16", "powersgd"):
            raise ValueError(f"kind must be 'allreduce', 'fp16' or 'powersgd', got {kind!r}")
        super().__init__(world)
        self.kind = kind
        self.link = link
        self.compressed_buckets = 0  # PowerSGD calls past the warm-up
        self.powersgd = None
        if kind == "powersgd":
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=powersgd_warmup,
                random_seed=seed,
            )


def ddp_comm_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """DDP communication hook: ``state.kind``'s torch hook, counted and (with a link) held for its wire
    time."""
    buf = bucket.buffer()
    if state.kind == "allreduce":
        payload = buf.numel() * buf.element_size()
        fut = default_hooks.allreduce_hook(None, bucket)
    elif state.kind == "fp16":
        payload = buf.numel() * 2
        fut = default_hooks.fp16_compress_hook(None, bucket)
    else:
        ps = state.powersgd
        warmup = ps.iter < ps.start_powerSGD_iter
        before = ps.total_numel_after_compression
        fut = powerSGD_hook.powerSGD_hook(ps, bucket)
        if warmup:
            payload = buf.numel() * buf.element_size()
        else:
            payload = (ps.total_numel_after_compression - before) * buf.element_size()
            state.compressed_buckets += 1
    sent = state.count(payload)
    if state.link is not None:
        fut = complete_after(fut, state.link.reserve(round(sent)))
    return fut
