"""The training loop every system runs, and the record rank 0 makes of it.

Note [Timing and evaluation]
    Wall time runs from a barrier after set-up to a barrier after the last step (after
    ``DistributedOptimizer.close()`` for pyasync, so it includes draining every push). Evaluation never
    runs inside that window: every ``eval_every`` steps rank 0 copies its parameters (one memcpy, 1.2 MB
    for the default model) with a timestamp and the global sample count; the copies are evaluated on
    the test set after training. So the accuracy-against-time curve costs every system the same and
    excludes evaluation time.

Note [Bytes sent]
    pyasync reports its own ``bytes_sent`` per rank (``Stats``). For DDP a communication hook counts
    the bytes of every all-reduce bucket and multiplies by ``2 (n - 1) / n``, what one rank sends in a
    ring all-reduce (reduce-scatter plus all-gather), whatever algorithm gloo picks. Records report the
    sum over ranks in MB (1e6 bytes).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pyasync.experiments.report import histogram_percentile
from pyasync.experiments.workload import (
    Digits,
    TrainConfig,
    _batches,
    accuracy,
    load_digits_split,
    make_model,
    measure_compute_s,
    shard_indices,
    steps_per_epoch,
)

# Per-rank numbers gathered to rank 0 after training, in this order (see _gather_rank_stats).
_RANK_FIELDS = (
    "steps",
    "samples",
    "bytes_sent",
    "bytes_received",
    "pushes_applied",
    "pushes_dropped",
    "nonfinite_skipped",
    "wait_seconds",
    "compression_ratio",
    "straggler_delay_s",
)


def store_from_env(timeout_s: float) -> tuple[dist.Store, int, int]:
    """The rendezvous store, rank and world size of a ``torchrun`` (or plain env://) launch.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. Under torchrun the agent hosts
    the store (``TORCHELASTIC_USE_AGENT_STORE=True``) and every rank is a client; otherwise rank 0 hosts.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"environment variables {missing} are not set: launch with torchrun, e.g. "
            "`torchrun --nproc-per-node 4 examples/train_digits.py`"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        hosts,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return store, rank, world


def join_run(store: dist.Store, prefix: str, rank: int, world: int, timeout_s: float) -> dist.Store:
    """``init_process_group("gloo")`` under ``prefix`` of ``store``, every collective with a timeout.

    Returns the store :func:`train_worker` takes (the same ``store``, under its own sub-prefix).
    """
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(prefix + "pg/", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(prefix + "harness/", store)


class _DdpByteCounter:
    """State of :func:`_ddp_counting_hook`: what this rank sends. See Note [Bytes sent]."""

    def __init__(self, world: int) -> None:
        self.bytes_sent = 0.0  # bytes this rank sends, under the ring model
        self.factor = 2.0 * (world - 1) / world  # ring all-reduce: bytes sent per byte of bucket


def _ddp_counting_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """DDP communication hook: the default all-reduce, adding the ring's bytes to ``state``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    state.bytes_sent += buf.numel() * buf.element_size() * state.factor
    return default_hooks.allreduce_hook(None, bucket)


def _inject_fault(kind: str, rank: int, step: int) -> None:
    """For tests of the failure paths: this rank raises, dies, or stops answering (see TrainConfig.fault)."""
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        time.sleep(24 * 3600)  # the peers' collectives time out after TrainConfig.timeout_s
    raise RuntimeError(f"injected fault on rank {rank} at step {step}")


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train_worker(
    cfg: TrainConfig,
    rank: int,
    store: dist.Store,
    progress: Callable[[int], None] | None = None,
    data: Digits | None = None,
) -> dict[str, Any] | None:
    """Train on this rank (the default process group must be initialised); rank 0 returns the record.

    ``store`` is a store shared by all ranks of this run (for the step counter, see Note [Work
    budget]); ``progress(samples)`` is called on rank 0 now and then with the number of samples the
    whole cluster has claimed. The record (rank 0 only; None on other ranks) holds ``name``,
    ``wall_s`` (s), ``samples``, ``samples_per_s``, ``test_acc`` (final, all replicas equal),
    ``mb_sent`` / ``mb_received`` (MB, summed over ranks), ``staleness_p50`` / ``staleness_p99`` /
    ``staleness_hist`` (of applied pushes, summed over owners; None for DDP), ``pushes_applied``,
    ``pushes_dropped``, ``nonfinite_skipped``, ``wait_s`` (summed over ranks), ``compression_ratio``
    (mean over ranks), ``steps_per_rank``, ``replicas_equal``, ``straggler`` and ``curve`` (list of
    ``{"t": s, "samples": n, "acc": fraction}``, see Note [Timing and evaluation]). ``data`` defaults to
    ``load_digits_split(cfg.seed)``.
    """
    world = dist.get_world_size()
    if world != cfg.workers:
        raise ValueError(f"the process group has {world} ranks but the config says workers={cfg.workers}")
    data = load_digits_split(cfg.seed) if data is None else data
    idx = shard_indices(len(data.x_train), rank, world, cfg.seed)
    x, y = data.x_train[idx], data.y_train[idx]
    per_pass = steps_per_epoch(len(data.x_train), world, cfg.batch_size)
    budget = cfg.epochs * per_pass * world  # worker-steps for the whole cluster
    my_steps = cfg.epochs * per_pass  # per rank, synchronous systems
    model = make_model(cfg.hidden, cfg.seed)

    # See Note [Straggler injection].
    delay_s = 0.0
    if cfg.straggler is not None:
        slow_rank, factor = cfg.straggler
        if cfg.straggler_delay_s is None:
            compute_s = measure_compute_s(model, x, y, cfg.batch_size, cfg.lr, cfg.momentum)
            if rank == slow_rank:
                delay_s = (factor - 1.0) * compute_s
        elif rank == slow_rank:
            delay_s = cfg.straggler_delay_s

    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    counter = None
    if cfg.system.is_ddp:
        counter = _DdpByteCounter(world)
        net: nn.Module = nn.parallel.DistributedDataParallel(model)
        net.register_comm_hook(counter, _ddp_counting_hook)
        opt: Any = sgd
    else:
        import pyasync

        net = model
        opt = pyasync.DistributedOptimizer(
            sgd,
            policy=cfg.system.policy,
            compression=cfg.system.compression,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
        )

    eval_every = max(1, my_steps // max(1, cfg.eval_points))
    snapshots = [(0.0, 0, _flat_params(model))] if rank == 0 else []
    key = "steps_claimed"
    batches = _batches(x, y, per_pass, cfg.batch_size, cfg.seed, rank)
    steps = 0
    last_report = 0.0
    dist.barrier()
    t0 = time.perf_counter()
    while True:
        if cfg.system.synchronous and steps >= my_steps:
            break
        claimed = store.add(key, 1)
        if not cfg.system.synchronous and claimed > budget:
            break
        if delay_s:
            time.sleep(delay_s)
        if cfg.fault is not None and cfg.fault[:2] == (rank, steps):
            _inject_fault(cfg.fault[2], rank, steps)
        xb, yb = next(batches)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(xb), yb).backward()
        opt.step()
        steps += 1
        if rank == 0:
            now = time.perf_counter() - t0
            if steps % eval_every == 0:
                snapshots.append((now, min(claimed, budget) * cfg.batch_size, _flat_params(model)))
            if progress is not None and now - last_report >= 0.1:
                progress(min(claimed, budget) * cfg.batch_size)
                last_report = now
    if not cfg.system.is_ddp:
        opt.close()
    dist.barrier()
    wall_s = time.perf_counter() - t0

    if cfg.system.is_ddp:
        own = {"bytes_sent": counter.bytes_sent, "bytes_received": counter.bytes_sent}
        hist: dict[int, int] = {}
    else:
        st = opt.stats()
        own = {f: float(getattr(st, f)) for f in _RANK_FIELDS[2:9]}
        hist = {int(k): int(v) for k, v in st.staleness.items()}
    own.update(steps=steps, samples=steps * cfg.batch_size, straggler_delay_s=delay_s)
    per_rank = _gather_rank_stats(own)
    total_hist = _gather_histogram(hist)
    final = _flat_params(model)
    replicas = [torch.empty_like(final) for _ in range(world)]
    dist.all_gather(replicas, final)
    if rank != 0:
        return None

    if progress is not None:
        progress(budget * cfg.batch_size)
    snapshots.append((wall_s, budget * cfg.batch_size, final))
    probe = make_model(cfg.hidden, cfg.seed)
    curve = []
    for t, samples, flat in snapshots:
        nn.utils.vector_to_parameters(flat, probe.parameters())
        curve.append(
            {"t": round(t, 4), "samples": int(samples), "acc": accuracy(probe, data.x_test, data.y_test)}
        )

    def total(field: str) -> float:
        return float(sum(r[field] for r in per_rank))

    samples = int(total("samples"))
    record: dict[str, Any] = {
        "name": cfg.system.name,
        "policy": cfg.system.policy,
        "compression": cfg.system.compression,
        "workers": world,
        "wall_s": wall_s,
        "samples": samples,
        "samples_per_s": samples / wall_s,
        "test_acc": curve[-1]["acc"],
        "mb_sent": total("bytes_sent") / 1e6,
        "mb_received": total("bytes_received") / 1e6,
        # pyasync's own counters; for DDP these do not apply (None), and DDP drops nothing.
        "staleness_p50": None,
        "staleness_p99": None,
        "staleness_hist": None,
        "pushes_applied": None,
        "pushes_dropped": 0,
        "nonfinite_skipped": None,
        "wait_s": None,
        "compression_ratio": None,
        "steps_per_rank": [int(r["steps"]) for r in per_rank],
        "replicas_equal": all(bool(torch.equal(r, final)) for r in replicas),
        "straggler": None
        if cfg.straggler is None
        else {
            "rank": cfg.straggler[0],
            "factor": cfg.straggler[1],
            "delay_s": max(r["straggler_delay_s"] for r in per_rank),
        },
        "config": {
            "epochs": cfg.epochs,
            "batch_size": cfg.batch_size,
            "hidden": cfg.hidden,
            "lr": cfg.lr,
            "momentum": cfg.momentum,
            "seed": cfg.seed,
            "steps_per_epoch": per_pass,
            "budget_steps": budget,
            "eval_every": eval_every,
        },
        "curve": curve,
    }
    if not cfg.system.is_ddp:
        record.update(
            staleness_p50=histogram_percentile(total_hist, 0.5),
            staleness_p99=histogram_percentile(total_hist, 0.99),
            staleness_hist={str(k): v for k, v in sorted(total_hist.items())},
            pushes_applied=int(total("pushes_applied")),
            pushes_dropped=int(total("pushes_dropped")),
            nonfinite_skipped=int(total("nonfinite_skipped")),
            wait_s=total("wait_seconds"),
            compression_ratio=total("compression_ratio") / world,
        )
    return record


def _gather_rank_stats(own: Mapping[str, float]) -> list[dict[str, float]]:
    vec = torch.tensor([float(own.get(f, 0.0)) for f in _RANK_FIELDS], dtype=torch.float64)
    out = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
    dist.all_gather(out, vec)
    return [dict(zip(_RANK_FIELDS, v.tolist())) for v in out]


def _gather_histogram(hist: Mapping[int, int]) -> dict[int, int]:
    if any(k < 0 for k in hist):
        raise ValueError(f"staleness histogram has negative keys: {dict(hist)}")
    length = torch.tensor([max(hist, default=-1) + 1], dtype=torch.int64)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    dense = torch.zeros(int(length), dtype=torch.int64)
    for k, v in hist.items():
        dense[k] += v
    dist.all_reduce(dense)
    return {i: int(c) for i, c in enumerate(dense.tolist()) if c}
