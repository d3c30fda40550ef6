"""The training loop every system runs, and the record rank 0 makes of it.

Note [Timing and evaluation]
    Wall time runs from a barrier after set-up to a barrier after the last step (after
    ``DistributedOptimizer.close()`` for pyasync, so it includes draining every push). Evaluation never
    runs inside that window: every ``eval_every`` steps rank 0 copies its parameters (one memcpy, 1.2 MB
    for the default model) with a timestamp and the global sample count; the copies are evaluated on
    the test set after training. So the accuracy-against-time curve costs every system the same and
    excludes evaluation time.

Note [Bytes sent]
    pyasync reports its own ``bytes_sent`` per rank (``Stats``, headers included). For DDP a
    communication hook counts the bytes of every all-reduce bucket and multiplies by ``2 (n - 1) / n``,
    what one rank sends in a ring all-reduce (reduce-scatter plus all-gather), whatever algorithm gloo
    picks; the fp16 and PowerSGD hooks count what they all-reduce (see Note [DDP bytes and link time]
    in ``pyasync.experiments.ddp``). Records report the sum over ranks in MB (1e6 bytes) and
    ``bytes_per_step``: that sum over the total number of steps of all ranks, i.e. the mean bytes one
    rank sends per step. hivemind reports no byte counts (null).

Note [Emulated link]
    With ``PYASYNC_LINK_GBPS`` set in the workers (``TrainConfig.bandwidth_gbps`` in local runs), every
    rank's sends go through one emulated link of that bandwidth: the harness hands pyasync's
    DistributedOptimizer a transport factory that wraps gloo in ``ThrottledTransport``, and DDP's hook delays each all-reduce's future by the wire time
    of what this rank sends. See Note [Link emulation] in ``pyasync.transport.throttle``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pyasync.experiments.ddp import DdpCommState, ddp_comm_hook
from pyasync.experiments.report import histogram_percentile
from pyasync.experiments.workload import (
    MODELS,
    Digits,
    TrainConfig,
    _batches,
    accuracy,
    load_split,
    make_model,
    measure_compute_s,
    powersgd_warmup,
    shard_indices,
    steps_per_epoch,
    transient_slow,
)
from pyasync.transport.throttle import link_from_env

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
    "slow_steps",
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


def _inject_fault(kind: str, rank: int, step: int) -> None:
    """For tests of the failure paths: this rank raises, dies, or stops answering (see TrainConfig.fault)."""
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        time.sleep(24 * 3600)  # the peers' collectives time out after TrainConfig.timeout_s
    raise RuntimeError(f"injected fault on rank {rank} at step {step}")


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _throttled(link):
    """A transport factory: gloo behind the emulated ``link`` (see Note [Emulated link])."""
    from pyasync.transport.gloo import GlooTransport
    from pyasync.transport.throttle import ThrottledTransport

    return lambda group, timeout: ThrottledTransport(GlooTransport(group, timeout), link)


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
    ``policy``, ``compression``, ``kind``, ``model``, ``params``, ``wall_s`` (s), ``samples``,
    ``samples_per_s``, ``test_acc`` (final), ``mb_sent`` / ``mb_received`` (MB, summed over ranks),
    ``bytes_per_step`` (mean bytes a rank sends per step), ``staleness_p50`` / ``staleness_p99`` /
    ``staleness_hist`` (of applied pushes, summed over owners; None unless pyasync),
    ``pushes_applied``, ``pushes_dropped``, ``nonfinite_skipped``, ``wait_s`` (summed over ranks),
    ``compression_ratio`` (mean over ranks), ``steps_per_rank``, ``replicas_equal``, ``straggler``,
    ``transient``, ``compute_s``, ``bandwidth_gbps``, ``ddp_hook``, ``config`` and ``curve`` (list of
    ``{"t": s, "samples": n, "acc": fraction}``, see Note [Timing and evaluation]). ``data`` defaults to
    ``load_split(cfg.model, cfg.seed)``.
    """
    world = dist.get_world_size()
    if world != cfg.workers:
        raise ValueError(f"the process group has {world} ranks but the config says workers={cfg.workers}")
    data = load_split(cfg.model, cfg.seed) if data is None else data
    features = data.x_train.shape[1]
    idx = shard_indices(len(data.x_train), rank, world, cfg.seed)
    x, y = data.x_train[idx], data.y_train[idx]
    per_pass = steps_per_epoch(len(data.x_train), world, cfg.batch_size)
    budget = cfg.epochs * per_pass * world  # worker-steps for the whole cluster
    my_steps = cfg.epochs * per_pass  # per rank, synchronous systems
    model = make_model(cfg.hidden, cfg.seed, features)

    # See Note [Straggler injection] and Note [Transient slowdowns].
    compute_s = cfg.compute_s
    measured: list[float] | None = None
    if compute_s is None and (
        cfg.transient is not None or (cfg.straggler is not None and cfg.straggler_delay_s is None)
    ):
        own_c = measure_compute_s(model, x, y, cfg.batch_size, cfg.lr, cfg.momentum)
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor([own_c], dtype=torch.float64))
        measured = [float(t) for t in gathered]
        compute_s = statistics.median(measured)
    delay_s = 0.0
    if cfg.straggler is not None and rank == cfg.straggler[0]:
        factor = cfg.straggler[1]
        if cfg.straggler_delay_s is not None:
            delay_s = cfg.straggler_delay_s
        elif cfg.compute_s is not None:
            delay_s = (factor - 1.0) * cfg.compute_s
        else:
            delay_s = (factor - 1.0) * measured[rank]  # the straggler's own compute time
    slow_at: list[bool] = []
    transient_s = 0.0
    if cfg.transient is not None:
        prob, tfactor = cfg.transient
        transient_s = (tfactor - 1.0) * compute_s
        # Drawn before the timed window, for every step this rank could possibly take.
        slow_at = [
            transient_slow(cfg.seed, rank, k, prob)
            for k in range(my_steps if cfg.system.synchronous else budget)
        ]

    link = link_from_env()  # see Note [Emulated link]
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    comm = None
    hivemind_parts = None
    if cfg.system.is_ddp:
        warmup = None
        if cfg.system.ddp_hook == "powersgd":
            warmup = cfg.powersgd_warmup if cfg.powersgd_warmup is not None else powersgd_warmup(my_steps)
        comm = DdpCommState(
            cfg.system.ddp_hook,
            world,
            link=link,
            powersgd_rank=cfg.system.powersgd_rank or 2,
            powersgd_warmup=warmup or 10,
            seed=cfg.seed,
        )
        ddp_kwargs: dict[str, Any] = {}
        if comm.kind == "powersgd":
            # PowerSGD issues its Q all-reduce from the P all-reduce's completion callback: with two
            # buckets in flight on gloo, ranks may then order their collectives differently (gloo
            # aborts with a size mismatch). One bucket holding every gradient keeps the order fixed.
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            ddp_kwargs["bucket_cap_mb"] = max(25.0, nbytes / 2**20 + 1.0)
        net: nn.Module = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        net.register_comm_hook(comm, ddp_comm_hook)
        opt: Any = sgd
    elif cfg.system.is_pyasync:
        import pyasync

        net = model
        opt = pyasync.DistributedOptimizer(
            sgd,
            policy=cfg.system.policy,
            compression=cfg.system.compression,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            transport=None if link is None else _throttled(link),
        )
    else:
        net = model
        hivemind_parts = _hivemind_optimizer(cfg, model, rank, store)
        opt = hivemind_parts[1]

    eval_every = max(1, my_steps // max(1, cfg.eval_points))
    snapshots = [(0.0, 0, _flat_params(model))] if rank == 0 else []
    key = "steps_claimed"
    batches = _batches(x, y, per_pass, cfg.batch_size, cfg.seed, rank)
    steps = 0
    slow_steps = 0
    last_report = 0.0
    dist.barrier()
    t0 = time.perf_counter()
    while True:
        if cfg.system.synchronous and steps >= my_steps:
            break
        claimed = store.add(key, 1)
        if not cfg.system.synchronous and claimed > budget:
            break
        pause = delay_s
        if slow_at and slow_at[steps]:
            pause += transient_s
            slow_steps += 1
        if pause:
            time.sleep(pause)  # emulated slowdown, see Note [Straggler injection]
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
    if cfg.system.is_pyasync:
        opt.close()
    dist.barrier()
    wall_s = time.perf_counter() - t0
    if hivemind_parts is not None:
        hivemind_parts[1].shutdown()
        hivemind_parts[0].shutdown()

    hist: dict[int, int] = {}
    if cfg.system.is_ddp:
        own = {"bytes_sent": comm.bytes_sent, "bytes_received": comm.bytes_sent}
    elif cfg.system.is_pyasync:
        st = opt.stats()
        own = {f: float(getattr(st, f)) for f in _RANK_FIELDS[2:9]}
        hist = {int(k): int(v) for k, v in st.staleness.items()}
    else:
        own = {}
    own.update(
        steps=steps,
        samples=steps * cfg.batch_size,
        straggler_delay_s=delay_s,
        slow_steps=slow_steps,
    )
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
    probe = make_model(cfg.hidden, cfg.seed, features)
    curve = []
    for t, samples, flat in snapshots:
        nn.utils.vector_to_parameters(flat, probe.parameters())
        curve.append(
            {"t": round(t, 4), "samples": int(samples), "acc": accuracy(probe, data.x_test, data.y_test)}
        )

    def total(field: str) -> float:
        return float(sum(r[field] for r in per_rank))

    samples = int(total("samples"))
    total_steps = int(total("steps"))
    counts_bytes = not cfg.system.kind == "hivemind"
    record: dict[str, Any] = {
        "name": cfg.system.name,
        "policy": cfg.system.policy,
        "compression": cfg.system.compression,
        "kind": cfg.system.kind,
        "model": cfg.model,
        "params": int(final.numel()),
        "workers": world,
        "wall_s": wall_s,
        "samples": samples,
        "samples_per_s": samples / wall_s,
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
        "replicas_equal": all(bool(torch.equal(r, final)) for r in replicas),
        "straggler": None
        if cfg.straggler is None
        else {
            "rank": cfg.straggler[0],
            "factor": cfg.straggler[1],
            "delay_s": max(r["straggler_delay_s"] for r in per_rank),
        },
        "transient": None
        if cfg.transient is None
        else {
            "prob": cfg.transient[0],
            "factor": cfg.transient[1],
            "delay_s": transient_s,
            "slow_steps_per_rank": [int(r["slow_steps"]) for r in per_rank],
        },
        "compute_s": compute_s,
        "compute_s_per_rank": measured,
        "bandwidth_gbps": None if link is None else link.gbps,
        "ddp_hook": None
        if comm is None
        else {
            "kind": comm.kind,
            "buckets_per_step": comm.buckets / max(1, steps),
            "powersgd_rank": cfg.system.powersgd_rank,
            "powersgd_warmup": None if comm.powersgd is None else comm.powersgd.start_powerSGD_iter,
            "powersgd_compressed_buckets": comm.compressed_buckets if comm.powersgd is not None else None,
        },
        "config": {
            "model": cfg.model,
            "data": MODELS[cfg.model].data,
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
    if cfg.system.is_pyasync:
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


def calibrate_worker(cfg: TrainConfig, rank: int, data: Digits | None = None) -> list[float] | None:
    """Every rank times local steps of ``cfg``'s model at the same time (no communication, see
    :func:`measure_compute_s`); rank 0 returns each rank's median step time in seconds, others None."""
    world = dist.get_world_size()
    data = load_split(cfg.model, cfg.seed) if data is None else data
    idx = shard_indices(len(data.x_train), rank, world, cfg.seed)
    model = make_model(cfg.hidden, cfg.seed, data.x_train.shape[1])
    dist.barrier()
    own = measure_compute_s(model, data.x_train[idx], data.y_train[idx], cfg.batch_size, cfg.lr, cfg.momentum)
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([own], dtype=torch.float64))
    return [float(t) for t in gathered] if rank == 0 else None


def _hivemind_optimizer(cfg: TrainConfig, model: nn.Module, rank: int, store: dist.Store):
    """(dht, hivemind.Optimizer) for ``model``: rank 0 starts a DHT on loopback, the others join it.

    hivemind's default (synchronous) mode: gradients are accumulated until the swarm has processed
    ``batch_size * workers`` samples, then averaged by an all-reduce among the peers found by
    matchmaking, as one global step of the same size as DDP's. Needs ``import hivemind``.
    """
    import hivemind

    host = ["/ip4/127.0.0.1/tcp/0"]
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=host, start=True)
        peers = [str(a) for a in dht.get_visible_maddrs()]
        run_id = f"pyasync-{cfg.system.name}-{os.getpid()}-{time.time_ns()}"
        store.set("hivemind", json.dumps({"peers": peers, "run_id": run_id}))
    else:
        store.wait(["hivemind"], datetime.timedelta(seconds=cfg.timeout_s))
        info = json.loads(store.get("hivemind"))
        run_id = info["run_id"]
        dht = hivemind.DHT(host_maddrs=host, initial_peers=info["peers"], start=True)
    lr, momentum = cfg.lr, cfg.momentum
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=run_id,
        batch_size_per_step=cfg.batch_size,
        target_batch_size=cfg.batch_size * cfg.workers,
        params=model.parameters(),
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum),
        matchmaking_time=1.0,
        averaging_timeout=cfg.timeout_s,
        verbose=False,
    )
    return dht, opt


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
