"""The training loop every system runs on one rank: joining the run, set-up, and the timed loop.

:func:`train_worker` is the demo's whole run on one rank: :func:`setup` (shard, model, budget), the
straggler's plan, the system (``pyasync.demo.systems``), :func:`timed_loop`, and the record
(``pyasync.demo.record``). Benchmarks compose the same pieces with their own systems and slowdowns.

Note [Timing and evaluation]
    Wall time runs from a barrier after set-up to a barrier after the last step (after
    ``DistributedOptimizer.close()`` for pyasync, so it includes draining every push). Evaluation never
    runs inside that window: every ``eval_every`` steps rank 0 copies its parameters (one memcpy, 1.2 MB
    for the default model) with a timestamp and the global sample count; the copies are evaluated on
    the test set after training. So the accuracy-against-time curve costs every system the same and
    excludes evaluation time.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F

from pyasync.demo.config import TrainConfig
from pyasync.demo.data import Digits, batches, flat_params, shard_indices, steps_per_epoch
from pyasync.demo.record import make_record
from pyasync.demo.run import LoopResult, RankRun
from pyasync.demo.straggler import plan_straggler
from pyasync.demo.systems import Trainer, build_trainer


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


def setup(cfg: TrainConfig, rank: int, data: Digits | None = None) -> RankRun:
    """This rank's shard, model and budget (the default process group must be initialised).

    ``data`` defaults to ``cfg.load_data()``."""
    world = dist.get_world_size()
    if world != cfg.workers:
        raise ValueError(f"the process group has {world} ranks but the config says workers={cfg.workers}")
    data = cfg.load_data() if data is None else data
    idx = shard_indices(len(data.x_train), rank, world, cfg.seed)
    per_pass = steps_per_epoch(len(data.x_train), world, cfg.batch_size)
    return RankRun(
        rank=rank,
        world=world,
        data=data,
        x=data.x_train[idx],
        y=data.y_train[idx],
        per_pass=per_pass,
        budget=cfg.budget(len(data.x_train)),
        my_steps=cfg.epochs * per_pass,
        model=cfg.build_model(data),
    )


def _inject_fault(kind: str, rank: int, step: int) -> None:
    """For tests of the failure paths: this rank raises, dies, or stops answering (see TrainConfig.fault)."""
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        time.sleep(24 * 3600)  # the peers' collectives time out after TrainConfig.timeout_s
    raise RuntimeError(f"injected fault on rank {rank} at step {step}")


def timed_loop(
    cfg: TrainConfig,
    run: RankRun,
    trainer: Trainer,
    store: dist.Store,
    sleep_s: Callable[[int], float],
    progress: Callable[[int], None] | None = None,
) -> LoopResult:
    """Train ``run.model`` with ``trainer`` between two barriers (see Note [Timing and evaluation]).

    Every step is claimed from ``store`` first (Note [Work budget]); before its forward pass, step ``k``
    of this rank sleeps ``sleep_s(k)`` seconds (the injected slowdown and the emulated device, see Note
    [Straggler injection] and Note [Emulated device]).
    ``progress(samples)`` is called on rank 0 now and then with the samples the cluster has claimed.
    """
    synchronous = cfg.system.synchronous
    eval_every = max(1, run.my_steps // max(1, cfg.eval_points))
    snapshots = [(0.0, 0, flat_params(run.model))] if run.rank == 0 else []
    draw = batches(run.x, run.y, run.per_pass, cfg.batch_size, cfg.seed, run.rank)
    net, opt = trainer.net, trainer.opt
    steps = 0
    slept_s = 0.0
    last_report = 0.0
    dist.barrier()
    t0 = time.perf_counter()
    while True:
        if synchronous and steps >= run.my_steps:
            break
        claimed = store.add("steps_claimed", 1)
        if not synchronous and claimed > run.budget:
            break
        pause = sleep_s(steps)
        if pause:
            time.sleep(pause)  # see Note [Straggler injection] and Note [Emulated device]
            slept_s += pause
        if cfg.fault is not None and cfg.fault[:2] == (run.rank, steps):
            _inject_fault(cfg.fault[2], run.rank, steps)
        xb, yb = next(draw)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(xb), yb).backward()
        opt.step()
        steps += 1
        if run.rank == 0:
            now = time.perf_counter() - t0
            if steps % eval_every == 0:
                snapshots.append((now, min(claimed, run.budget) * cfg.batch_size, flat_params(run.model)))
            if progress is not None and now - last_report >= 0.1:
                progress(min(claimed, run.budget) * cfg.batch_size)
                last_report = now
    if cfg.system.is_pyasync:
        opt.close()
    dist.barrier()
    wall_s = time.perf_counter() - t0
    trainer.shutdown()
    return LoopResult(steps=steps, slept_s=slept_s, wall_s=wall_s, eval_every=eval_every, snapshots=snapshots)


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
    whole cluster has claimed. The record (rank 0 only; None on other ranks) is described in
    :func:`pyasync.demo.record.make_record`. ``data`` defaults to ``cfg.load_data()``.
    """
    run = setup(cfg, rank, data)
    injected = plan_straggler(cfg, rank, run.model, run.x, run.y)
    trainer = build_trainer(cfg, run.model, run.world)
    loop = timed_loop(cfg, run, trainer, store, lambda step: injected.sleep_s, progress)
    return make_record(cfg, run, trainer, loop, injected, progress)
