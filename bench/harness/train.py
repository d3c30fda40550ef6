"""One benchmark run on one rank: the demo's set-up, timed loop and record (``pyasync.demo.train``,
``pyasync.demo.record``) with the benchmark's systems (DDP hooks, hivemind), slowdowns and emulated link.

Note [Emulated link]
    With ``BenchConfig.bandwidth_gbps`` set, every rank's sends go through one emulated link of that
    bandwidth (one :class:`linkemu.Link` per process): the harness hands pyasync's DistributedOptimizer
    a transport factory that wraps gloo in ``ThrottledTransport``, BSP on collectives (whose reduce and
    gather bypass the transport) returns from each step() no earlier than its bytes would have left
    the link (``steps_behind_link``), and DDP's hook delays each all-reduce's future by the wire time of
    what this rank sends. See Note [Link emulation] in
    ``bench/linkemu.py``.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from linkemu import Link, ThrottledTransport, steps_behind_link
from torch import nn

from pyasync.demo.data import Digits, flat_params
from pyasync.demo.local import run_local
from pyasync.demo.record import gather_rank_stats, make_record
from pyasync.demo.straggler import measure_all_ranks
from pyasync.demo.systems import Trainer
from pyasync.demo.train import LoopResult, RankRun, setup, timed_loop
from pyasync.engine.collective.engine import CollectiveEngine
from pyasync.transport.gloo import GlooTransport

from . import peers
from .ddp import DdpCommState, ddp_comm_hook
from .lmtask import held_out_loss
from .slowdowns import plan_slowdowns
from .workload import (
    MODELS,
    TORCHFT_LOCAL_KINDS,
    BenchConfig,
    make_optimizer,
    optimizer_config,
    powersgd_warmup,
)


def gloo_behind_link(link: Link):
    """A transport factory for pyasync: gloo behind the emulated ``link`` (see Note [Emulated link])."""
    return lambda group, timeout: ThrottledTransport(GlooTransport(group, timeout), link)


def build_ddp(model: nn.Module, cfg: BenchConfig, state: DdpCommState, **ddp_kwargs: Any) -> Trainer:
    """``model`` under DistributedDataParallel with :func:`ddp_comm_hook` and ``cfg``'s optimizer
    (``workload.make_optimizer``); ``ddp_kwargs`` go to DistributedDataParallel."""
    net = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    net.register_comm_hook(state, ddp_comm_hook)
    return Trainer(net=net, opt=make_optimizer(cfg, model.parameters()), ddp_bytes=state)


def build_pyasync(model: nn.Module, cfg: BenchConfig, transport=None) -> Trainer:
    """``pyasync.DistributedOptimizer`` around ``cfg``'s optimizer (``workload.make_optimizer``) with
    ``cfg.system``'s policy and compression; ``transport`` is its transport factory (None: gloo)."""
    import pyasync

    opt = pyasync.DistributedOptimizer(
        make_optimizer(cfg, model.parameters()),
        policy=cfg.system.policy,
        compression=cfg.system.compression,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        transport=transport,
    )
    return Trainer(net=model, opt=opt)


def build_trainer(cfg: BenchConfig, run: RankRun, store: dist.Store, link: Link | None) -> Trainer:
    """DDP with ``cfg.system``'s hook, pyasync, hivemind or torchft (DDP-style, DiLoCo or LocalSGD), each
    stepping ``cfg``'s optimizer; behind ``link`` when given (except hivemind, see Note [Peers and the
    link] in peers.py)."""
    if cfg.system.is_ddp:
        warmup = None
        if cfg.system.ddp_hook == "powersgd":
            warmup = cfg.powersgd_warmup if cfg.powersgd_warmup is not None else powersgd_warmup(run.my_steps)
        state = DdpCommState(
            cfg.system.ddp_hook,
            run.world,
            link=link,
            powersgd_rank=cfg.system.powersgd_rank or 2,
            powersgd_warmup=warmup or 10,
            seed=cfg.seed,
        )
        ddp_kwargs: dict[str, Any] = {}
        if state.kind == "powersgd":
            # PowerSGD issues its Q all-reduce from the P all-reduce's completion callback: with two
            # buckets in flight on gloo, ranks may then order their collectives differently (gloo
            # aborts with a size mismatch). One bucket holding every gradient keeps the order fixed.
            nbytes = sum(p.numel() * p.element_size() for p in run.model.parameters())
            ddp_kwargs["bucket_cap_mb"] = max(25.0, nbytes / 2**20 + 1.0)
        return build_ddp(run.model, cfg, state, **ddp_kwargs)
    if cfg.system.is_pyasync:
        trainer = build_pyasync(run.model, cfg, transport=None if link is None else gloo_behind_link(link))
        if link is not None and isinstance(trainer.opt.engine, CollectiveEngine):
            steps_behind_link(trainer.opt, link)  # its collectives bypass the transport
        return trainer
    if cfg.system.kind == "torchft":
        return peers.torchft_trainer(cfg, run.model, run.rank, store, link)
    if cfg.system.kind in TORCHFT_LOCAL_KINDS:
        return peers.torchft_local_trainer(cfg, run.model, run.rank, store, link)
    if cfg.system.kind == "hivemind":
        return peers.hivemind_trainer(cfg, run.model, run.rank, store)
    raise ValueError(f"system {cfg.system.name!r}: unknown kind {cfg.system.kind!r}")


def bench_worker(
    cfg: BenchConfig,
    rank: int,
    store: dist.Store,
    progress: Callable[[int], None] | None = None,
    data: Digits | None = None,
) -> dict[str, Any] | None:
    """Train ``cfg`` on this rank, as ``pyasync.demo.train.train_worker`` does, with the benchmark's
    systems, slowdowns and link; rank 0 returns the record (None elsewhere).

    The record is the demo's (``pyasync.demo.record.make_record``) plus ``model``, ``transient`` (prob,
    factor, ``delay_s``: the extra sleep of a slow step, ``slow_steps_per_rank``), ``bandwidth_gbps``,
    ``ddp_hook`` (kind, buckets per step, PowerSGD rank, warm-up and compressed buckets), ``speeds``
    (each rank's slowdown factor, see Note [Rank speeds]), ``optimizer`` and ``metric`` (the workload's,
    "acc" or "loss") and ``config.model`` / ``config.data`` / ``config.optimizer`` (with AdamW's
    ``betas`` and ``weight_decay``) / ``config.optimizer_class`` (the torch optimizer the system really
    stepped, :func:`stepped_optimizer`). For a workload scored by its loss (lm) every curve point also
    has ``loss``, the held-out loss (:func:`add_losses`).
    """
    run = setup(cfg, rank, data)
    injected, sleeps = plan_slowdowns(cfg, run)
    link = None if cfg.bandwidth_gbps is None else Link(cfg.bandwidth_gbps)
    trainer = build_trainer(cfg, run, store, link)
    loop = timed_loop(cfg, run, trainer, store, sleeps, progress)
    slow = gather_rank_stats({"slow_steps": sleeps.slow_steps}, ("slow_steps",))
    slow_steps = [int(r["slow_steps"]) for r in slow]
    record = make_record(cfg, run, trainer, loop, injected, progress)
    if record is None:
        return None
    comm = trainer.ddp_bytes if cfg.system.is_ddp else None  # peers count in their own ByteCount
    transient = (
        None
        if cfg.transient is None
        else {
            "prob": cfg.transient[0],
            "factor": cfg.transient[1],
            "delay_s": sleeps.transient_s,
            "slow_steps_per_rank": slow_steps,
        }
    )
    ddp_hook = (
        None
        if comm is None
        else {
            "kind": comm.kind,
            "buckets_per_step": comm.buckets / max(1, loop.steps),
            "powersgd_rank": cfg.system.powersgd_rank,
            "powersgd_warmup": None if comm.powersgd is None else comm.powersgd.start_powerSGD_iter,
            "powersgd_compressed_buckets": comm.compressed_buckets if comm.powersgd is not None else None,
        }
    )
    record["config"] = {
        "model": cfg.model,
        "data": MODELS[cfg.model].data,
        **record["config"],
        **optimizer_config(cfg),
        "optimizer_class": stepped_optimizer(trainer.opt),
    }
    if MODELS[cfg.model].metric == "loss":
        add_losses(cfg, run, loop, record["curve"])
    peer = trainer.peer_info() if hasattr(trainer, "peer_info") else None
    if peer is not None and cfg.system.kind == "hivemind":
        if peer["bytes"] is None:  # no socket counts here: say so rather than report 0
            record.update(mb_sent=None, mb_received=None, bytes_per_step=None)
        else:  # socket counts: what was sent (received bytes are another socket's sent bytes)
            record["mb_received"] = record["mb_sent"]
        if link is not None:  # Note [Peers and the link]: the run's bandwidth, but not behind it
            peer["link"] = "not emulated"
            record["link_emulated"] = False
    extras = {  # placed after the demo's field they follow, in the order the benchmark has always used
        "kind": {"model": cfg.model, "optimizer": cfg.optimizer, "metric": MODELS[cfg.model].metric},
        "straggler": {"transient": transient, "speeds": None if cfg.speeds is None else list(cfg.speeds)},
        "compute_s_per_rank": {
            "bandwidth_gbps": None if link is None else link.gbps,
            "ddp_hook": ddp_hook,
            **({} if peer is None else {"peer": peer}),
        },
    }
    out: dict[str, Any] = {}
    for key, value in record.items():
        out[key] = value
        out.update(extras.get(key, {}))
    return out


def stepped_optimizer(opt: Any) -> str:
    """The class name of the torch optimizer that ``opt`` steps: ``opt``'s own, or for a wrapper (pyasync's
    DistributedOptimizer, torchft's Optimizer, hivemind's) the one it wraps. What the record says the
    run really used, whatever it was asked for."""
    for path in (("optimizer",), ("optim",), ("state_averager", "optimizer")):
        inner = opt
        for attr in path:
            inner = getattr(inner, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            return type(inner).__name__
    return type(opt).__name__


def add_losses(cfg: BenchConfig, run: RankRun, loop: LoopResult, curve: list[dict[str, Any]]) -> None:
    """Rank 0: add ``"loss"``, the held-out loss (``lmtask.held_out_loss``), to every point of ``curve``,
    the curve ``make_record`` evaluated from ``loop.snapshots`` and the final parameters (``run.model``'s
    now). See Note [Loss as the metric] in ``lmtask``."""
    flats = [flat for _, _, flat in loop.snapshots] + [flat_params(run.model)]
    if len(flats) != len(curve):
        raise RuntimeError(f"the curve has {len(curve)} points but there are {len(flats)} snapshots")
    probe = cfg.build_model(run.data)
    for point, flat in zip(curve, flats, strict=True):
        nn.utils.vector_to_parameters(flat, probe.parameters())
        point["loss"] = held_out_loss(probe, run.data.x_test, run.data.y_test)


def calibrate_worker(
    cfg: BenchConfig,
    rank: int,
    store: dist.Store,
    progress: Callable[[int], None] | None = None,
    data: Digits | None = None,
) -> list[float] | None:
    """Every rank times local steps of ``cfg``'s model at the same time (no communication, see
    ``pyasync.demo.straggler.measure_compute_s``); rank 0 returns each rank's median step time in
    seconds, others None."""
    run = setup(cfg, rank, data)
    dist.barrier()
    measured = measure_all_ranks(cfg, run.model, run.x, run.y)
    return measured if rank == 0 else None


def run_bench(
    cfg: BenchConfig,
    store: dist.TCPStore,
    prefix: str,
    progress: Callable[[int], None] | None = None,
    run_timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Train ``cfg`` with spawned local processes (``pyasync.demo.local.run_local`` running
    :func:`bench_worker`); returns rank 0's record. Raises ``WorkerError`` like ``run_local``."""
    return run_local(cfg, store, prefix, progress, run_timeout_s, worker=bench_worker)


def calibrate_local(
    cfg: BenchConfig, store: dist.TCPStore, prefix: str, run_timeout_s: float = 900.0
) -> list[float]:
    """Each of ``cfg.workers`` spawned local processes times steps of ``cfg``'s model at the same time
    (the CPU contention of training, no communication); returns every rank's median step time (s).
    See Note [Straggler injection]. Raises ``WorkerError`` like ``run_local``."""
    label = f"calibration of model {cfg.model!r}"
    return run_local(cfg, store, prefix, None, run_timeout_s, worker=calibrate_worker, label=label)
