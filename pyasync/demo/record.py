"""The record rank 0 makes of a run: every rank's counters gathered, the curve evaluated after training."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pyasync.demo.config import TrainConfig
from pyasync.demo.data import accuracy, flat_params
from pyasync.demo.report import histogram_percentile
from pyasync.demo.run import LoopResult, RankRun
from pyasync.demo.straggler import Injection
from pyasync.demo.systems import PYASYNC_COUNTERS, Trainer, rank_counters

#: Per-rank numbers gathered to rank 0 after training, in this order (see gather_rank_stats).
RANK_FIELDS = ("steps", "samples", *PYASYNC_COUNTERS, "straggler_delay_s", "slept_s")


def gather_rank_stats(own: Mapping[str, float], fields: Sequence[str]) -> list[dict[str, float]]:
    """Every rank's ``own[f]`` for each of ``fields`` (0 where missing), by rank; a collective."""
    vec = torch.tensor([float(own.get(f, 0.0)) for f in fields], dtype=torch.float64)
    out = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
    dist.all_gather(out, vec)
    return [dict(zip(fields, v.tolist(), strict=True)) for v in out]


def gather_histogram(hist: Mapping[int, int]) -> dict[int, int]:
    """The sum over ranks of histograms ``{value >= 0: count}``; a collective."""
    if any(k < 0 for k in hist):
        raise ValueError(f"staleness histogram has negative keys: {dict(hist)}")
    length = torch.tensor([max(hist, default=-1) + 1], dtype=torch.int64)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    dense = torch.zeros(int(length), dtype=torch.int64)
    for k, v in hist.items():
        dense[k] += v
    dist.all_reduce(dense)
    return {i: int(c) for i, c in enumerate(dense.tolist()) if c}


def _curve(cfg: TrainConfig, run: RankRun, snapshots) -> list[dict[str, Any]]:
    probe = cfg.build_model(run.data)
    curve = []
    for t, samples, flat in snapshots:
        nn.utils.vector_to_parameters(flat, probe.parameters())
        acc = accuracy(probe, run.data.x_test, run.data.y_test)
        curve.append({"t": round(t, 4), "samples": int(samples), "acc": acc})
    return curve


def _run_config(cfg: TrainConfig, run: RankRun, loop: LoopResult) -> dict[str, Any]:
    """The record's ``config``: the settings that shaped the run."""
    return {
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "hidden": cfg.hidden,
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "seed": cfg.seed,
        "steps_per_epoch": run.per_pass,
        "budget_steps": run.budget,
        "eval_every": loop.eval_every,
    }


def make_record(
    cfg: TrainConfig,
    run: RankRun,
    trainer: Trainer,
    loop: LoopResult,
    injected: Injection,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any] | None:
    """Gather every rank's counters and final parameters (collectives: call on every rank); rank 0 returns
    the record, the others None.

    The record holds ``name``, ``policy``, ``compression``, ``kind``, ``params``, ``workers``, ``wall_s``
    (s), ``samples``, ``samples_per_s``, ``test_acc`` (final), ``mb_sent`` / ``mb_received`` (MB,
    summed over ranks), ``bytes_per_step`` (mean bytes a rank sends per step), ``staleness_p50`` /
    ``staleness_p99`` / ``staleness_hist`` (of applied pushes, summed over owners; None unless pyasync),
    ``pushes_applied``, ``pushes_dropped``, ``nonfinite_skipped``, ``wait_s`` (summed over ranks),
    ``compression_ratio`` (mean over ranks), ``steps_per_rank``, ``sleep_s_per_rank`` (seconds each
    rank slept before its steps: injected slowdowns and the emulated device), ``replicas_equal``,
    ``device_ms`` (Note [Emulated device]; None without), ``straggler`` (rank, factor, ``delay_s``: how
    much longer its steps were made, in s), ``compute_s``, ``compute_s_per_rank``, ``config`` and
    ``curve`` (list of ``{"t": s, "samples": n, "acc": fraction}``, see Note [Timing and evaluation]).
    """
    own, hist = rank_counters(trainer)
    counts_bytes = "bytes_sent" in own
    own = {**own, "steps": loop.steps, "samples": loop.steps * cfg.batch_size,
           "straggler_delay_s": injected.delay_s, "slept_s": loop.slept_s}  # fmt: skip
    per_rank = gather_rank_stats(own, RANK_FIELDS)
    total_hist = gather_histogram(hist)
    final = flat_params(run.model)
    replicas = [torch.empty_like(final) for _ in range(run.world)]
    dist.all_gather(replicas, final)
    if run.rank != 0:
        return None

    if progress is not None:
        progress(run.budget * cfg.batch_size)
    curve = _curve(cfg, run, [*loop.snapshots, (loop.wall_s, run.budget * cfg.batch_size, final)])

    def total(field: str) -> float:
        return float(sum(r[field] for r in per_rank))

    samples = int(total("samples"))
    total_steps = int(total("steps"))
    record: dict[str, Any] = {
        "name": cfg.system.name,
        "policy": cfg.system.policy,
        "compression": cfg.system.compression,
        "kind": cfg.system.kind,
        "params": int(final.numel()),
        "workers": run.world,
        "wall_s": loop.wall_s,
        "samples": samples,
        "samples_per_s": samples / loop.wall_s,
        "test_acc": curve[-1]["acc"],
        "mb_sent": total("bytes_sent") / 1e6 if counts_bytes else None,
        "mb_received": total("bytes_received") / 1e6 if counts_bytes else None,
        "bytes_per_step": total("bytes_sent") / max(1, total_steps) if counts_bytes else None,
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
        "sleep_s_per_rank": [r["slept_s"] for r in per_rank],
        "replicas_equal": all(bool(torch.equal(r, final)) for r in replicas),
        "device_ms": cfg.device_ms,
        "straggler": None
        if cfg.straggler is None
        else {
            "rank": cfg.straggler[0],
            "factor": cfg.straggler[1],
            "delay_s": max(r["straggler_delay_s"] for r in per_rank),
        },
        "compute_s": injected.compute_s,
        "compute_s_per_rank": injected.measured,
        "config": _run_config(cfg, run, loop),
        "curve": curve,
    }
    if cfg.system.is_pyasync:
        record.update(
            staleness_p50=histogram_percentile(total_hist, 0.5),
            staleness_p99=histogram_percentile(total_hist, 0.99),
            staleness_hist={str(k): v for k, v in sorted(total_hist.items())},
            pushes_applied=int(total("pushes_applied")),
            pushes_dropped=int(total("pushes_dropped")),
            nonfinite_skipped=int(total("nonfinite_skipped")),
            wait_s=total("wait_seconds"),
            compression_ratio=total("compression_ratio") / run.world,
        )
    return record
