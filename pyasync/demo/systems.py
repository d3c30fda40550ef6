"""The systems a rank trains under: DDP with a byte-counting all-reduce, or pyasync's optimizer wrapped
around the same ``torch.optim.SGD``.

Note [Bytes sent]
    pyasync reports its own ``bytes_sent`` per rank (``Stats``, headers included). For DDP a
    communication hook counts the bytes of every all-reduce bucket and multiplies by ``2 (n - 1) / n``,
    what one rank sends in a ring all-reduce (reduce-scatter plus all-gather), whatever algorithm gloo
    picks (:class:`ByteCount`; hooks that compress count what they all-reduce the same way). Records
    report the sum over ranks in MB (1e6 bytes) and ``bytes_per_step``: that sum over the total number
    of steps of all ranks, i.e. the mean bytes one rank sends per step. Systems without byte counters
    report null.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from pyasync.demo.config import TrainConfig

#: Per-rank counters of pyasync's Stats that a record sums (or averages) over ranks.
PYASYNC_COUNTERS = (
    "bytes_sent",
    "bytes_received",
    "pushes_applied",
    "pushes_dropped",
    "nonfinite_skipped",
    "wait_seconds",
    "compression_ratio",
)


class ByteCount:
    """What one rank sends in DDP's all-reduces, under the ring model (see Note [Bytes sent])."""

    def __init__(self, world: int) -> None:
        self.factor = 2.0 * (world - 1) / world  # ring all-reduce: bytes sent per byte reduced
        self.bytes_sent = 0.0  # bytes this rank sent, under the ring model
        self.buckets = 0  # hook calls

    def count(self, payload: int) -> float:
        """Count one all-reduce of ``payload`` bytes; returns the bytes this rank sends for it."""
        sent = payload * self.factor
        self.bytes_sent += sent
        self.buckets += 1
        return sent


def counted_allreduce_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """DDP communication hook: torch's default all-reduce, counted in ``state`` (a :class:`ByteCount`)."""
    buf = bucket.buffer()
    state.count(buf.numel() * buf.element_size())
    return default_hooks.allreduce_hook(None, bucket)


def _nothing() -> None:
    pass


@dataclasses.dataclass
class Trainer:
    """One rank's system, ready to train: call ``net`` forward, then ``opt.zero_grad()/step()``."""

    net: nn.Module  # what the loop calls (DDP's wrapper, or the model itself)
    opt: Any  # the optimizer the loop steps
    ddp_bytes: ByteCount | None = None  # DDP's hook state (counts bytes); None for other systems
    shutdown: Callable[[], None] = _nothing  # after the timed window: stop the system's own threads


def build_ddp(
    model: nn.Module, cfg: TrainConfig, state: ByteCount, hook=counted_allreduce_hook, **ddp_kwargs: Any
) -> Trainer:
    """``model`` under DistributedDataParallel with communication ``hook(state, bucket)`` and SGD;
    ``ddp_kwargs`` go to DistributedDataParallel."""
    net = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    net.register_comm_hook(state, hook)
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    return Trainer(net=net, opt=sgd, ddp_bytes=state)


def build_pyasync(model: nn.Module, cfg: TrainConfig, transport=None) -> Trainer:
    """``pyasync.DistributedOptimizer`` around SGD with ``cfg.system``'s policy and compression.

    ``transport`` is the optimizer's transport factory (None: gloo)."""
    import pyasync

    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    opt = pyasync.DistributedOptimizer(
        sgd,
        policy=cfg.system.policy,
        compression=cfg.system.compression,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        transport=transport,
    )
    return Trainer(net=model, opt=opt)


def build_trainer(cfg: TrainConfig, model: nn.Module, world: int) -> Trainer:
    """The demo's systems: DDP (default all-reduce, counted) or a pyasync policy."""
    if cfg.system.is_ddp:
        return build_ddp(model, cfg, ByteCount(world))
    if cfg.system.is_pyasync:
        return build_pyasync(model, cfg)
    raise ValueError(
        f"system {cfg.system.name!r}: the demo trains ddp or a pyasync policy, not {cfg.system.kind!r}"
    )


def rank_counters(trainer: Trainer) -> tuple[dict[str, float], dict[int, int]]:
    """This rank's counters after training (bytes, pushes, waits; empty for a system without any) and
    its staleness histogram ``{staleness: count}`` (empty unless pyasync)."""
    if trainer.ddp_bytes is not None:
        sent = trainer.ddp_bytes.bytes_sent
        return {"bytes_sent": sent, "bytes_received": sent}, {}
    import pyasync

    if not isinstance(trainer.opt, pyasync.DistributedOptimizer):
        return {}, {}
    st = trainer.opt.stats()
    return {f: float(getattr(st, f)) for f in PYASYNC_COUNTERS}, {
        int(k): int(v) for k, v in st.staleness.items()
    }
