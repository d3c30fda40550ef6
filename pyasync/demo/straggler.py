"""The demo's straggler: one rank slowed by a sleep per step, and the compute time it is measured against;
and the emulated device (a sleep per step on every rank).

Note [Straggler injection]
    The straggler rank sleeps ``(FACTOR - 1) * C`` seconds at the start of every step (before the
    forward pass), so that its step takes ``FACTOR`` times its own compute time ``C``. ``C`` is the
    median time of one local step (forward, loss, backward, ``torch.optim.SGD.step``) on a private
    copy of the model, with no communication, measured by every rank at the same time before training
    (so the CPU contention matches training) and taken from the straggler rank. It is measured once,
    by the first run of a demo, and the same number of seconds is reused for every later run, so each
    system gets exactly the same injected delay. Sleeping instead of repeating the compute frees the
    CPU for the other workers, which matters on a machine with fewer cores than workers. A caller may
    fix ``C`` instead (``compute_s`` of :func:`straggler_delay_s`; the end-to-end benchmark measures it
    once per model, all ranks at once, and takes the median over ranks); the delay is then
    ``(FACTOR - 1) * C``.

Note [Emulated device]
    ``TrainConfig.device_ms = D`` (``--device-ms``) adds ``D`` ms of emulated device compute to every
    step of every rank: a sleep before the forward pass, as a GPU leaves the host CPU free while it
    computes, so the workers stop competing for the cores while they wait for their "device". The
    straggler then sleeps ``FACTOR * D`` per step instead of ``D`` (``C`` is neither measured nor used,
    and ``straggler_delay_s`` may not be given), so its steps are ``FACTOR`` times as long on the
    emulated device. The real forward and backward pass still run on the CPU after the sleep; choose
    ``D`` well above their time so that the emulated device dominates a step. What it does not model:
    real kernels, host-device copies, device memory, several workers sharing one accelerator, and
    overlap of compute with communication beyond what the host threads do during the sleep. Without
    ``device_ms`` nothing changes (Note [Straggler injection]).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pyasync.demo.config import TrainConfig


def parse_straggler(text: str, workers: int) -> tuple[int, float] | None:
    """Parse ``RANK:FACTOR`` (e.g. ``3:3``) or ``none``; FACTOR >= 1 is the slowdown of that rank's steps."""
    if text.strip().lower() == "none":
        return None
    rank_s, sep, factor_s = text.partition(":")
    try:
        rank, factor = int(rank_s), float(factor_s)
    except ValueError:
        rank, factor = -1, float("nan")
    if not sep or not 0 <= rank < workers or not factor >= 1.0 or math.isinf(factor):
        raise ValueError(
            f"--straggler {text!r}: use RANK:FACTOR with 0 <= RANK < workers={workers} and a finite "
            "FACTOR >= 1 (e.g. 3:3), or 'none'"
        )
    return rank, factor


def measure_compute_s(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    lr: float,
    momentum: float,
    warmup: int = 5,
    reps: int = 20,
) -> float:
    """Median seconds of one local SGD step on a private copy of ``model`` (no communication)."""
    local = copy.deepcopy(model)
    opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=momentum)
    xb, yb = x[:batch_size], y[:batch_size]
    times = []
    for i in range(warmup + reps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(local(xb), yb).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_all_ranks(cfg: TrainConfig, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Every rank of the default group times local steps of ``model`` at the same time
    (:func:`measure_compute_s` on its shard ``x, y``); returns every rank's median step time (s)."""
    own = measure_compute_s(model, x, y, cfg.batch_size, cfg.lr, cfg.momentum)
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([own], dtype=torch.float64))
    return [float(t) for t in gathered]


@dataclasses.dataclass(frozen=True)
class Injection:
    """The slowdown injected on one rank, as the run's record reports it."""

    sleep_s: float  # this rank's sleep before every step (s): its straggler delay, or D x its factor
    delay_s: float  # how much longer the straggler's steps are made than the others' (s); 0 elsewhere
    compute_s: float | None  # C (s): the fixed one, or the median over ranks of the measured ones
    measured: list[float] | None  # every rank's measured C (s); None when nothing was measured


def straggler_delay_s(
    cfg: TrainConfig, rank: int, measured: list[float] | None, compute_s: float | None = None
) -> float:
    """The sleep per step of ``rank`` (s): ``cfg.straggler_delay_s`` when fixed, else ``(FACTOR - 1)``
    times ``compute_s`` or, without it, the straggler's own measured compute time; 0 for other ranks.
    See Note [Straggler injection]."""
    if cfg.straggler is None or rank != cfg.straggler[0]:
        return 0.0
    factor = rank_factor(cfg, rank)
    if cfg.straggler_delay_s is not None:
        return cfg.straggler_delay_s
    if compute_s is not None:
        return (factor - 1.0) * compute_s
    if measured is None:
        raise ValueError("the straggler's delay needs its measured compute time or a fixed compute_s")
    return (factor - 1.0) * measured[rank]


def rank_factor(cfg: TrainConfig, rank: int) -> float:
    """How many times longer than the others ``rank``'s steps are made: the straggler's FACTOR, else 1."""
    return cfg.straggler[1] if cfg.straggler is not None and rank == cfg.straggler[0] else 1.0


def device_injection(cfg: TrainConfig, rank: int, factor: float = 1.0) -> Injection:
    """With an emulated device (``cfg.device_ms = D``): this rank sleeps ``D`` times its straggler factor
    and ``factor`` per step (see Note [Emulated device])."""
    device_s = cfg.device_ms / 1e3
    straggler = rank_factor(cfg, rank)
    return Injection(
        sleep_s=device_s * straggler * factor,
        delay_s=(straggler - 1.0) * device_s,
        compute_s=None,
        measured=None,
    )


def plan_straggler(
    cfg: TrainConfig, rank: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Injection:
    """Measure ``C`` on every rank when the straggler needs it (a collective: call on every rank), and
    give this rank's sleep. See Note [Straggler injection] and Note [Emulated device]."""
    if cfg.device_ms is not None:
        return device_injection(cfg, rank)
    measured = None
    if cfg.straggler is not None and cfg.straggler_delay_s is None:
        measured = measure_all_ranks(cfg, model, x, y)
    delay_s = straggler_delay_s(cfg, rank, measured)
    return Injection(
        sleep_s=delay_s,
        delay_s=delay_s,
        compute_s=None if measured is None else statistics.median(measured),
        measured=measured,
    )
