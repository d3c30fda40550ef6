"""The benchmark's slowdowns on top of the demo's straggler: seeded transient slowdowns of any step of any
rank, per-rank speeds, and the compute time ``C`` (or the emulated device time ``D``) they are multiples
of.

Note [Transient slowdowns]
    ``BenchConfig.transient = (PROB, FACTOR)`` slows each step of every rank by ``FACTOR`` with
    probability ``PROB``, injected like the straggler (Note [Straggler injection] in
    ``pyasync/demo/straggler.py``): a sleep of ``(FACTOR - 1) * C`` before the forward pass, with ``C``
    the compute time (``compute_s``, or the median over ranks of the measured one). Whether step ``k``
    of rank ``r`` is slowed is one draw of a ``torch.Generator`` seeded from a hash of (seed, r, k)
    (:func:`transient_slow`), so it depends on nothing else: every system sees exactly the same slow
    steps, a rank's k-th step is slow in all of them or in none. Asynchronous systems let fast ranks
    take more steps than synchronous ones; the draws of the steps they have in common still agree.
    With an emulated device (Note [Emulated device] in ``pyasync/demo/straggler.py``) a slow step sleeps
    ``FACTOR`` times the rank's device time instead of it (``5 D`` for the 5x transient scenario).

Note [Rank speeds]
    ``BenchConfig.speeds = (f_0, ..., f_{n-1})`` makes every step of rank ``r`` ``f_r`` times as long:
    without an emulated device, rank ``r`` sleeps ``(f_r - 1) * C`` per step (on top of a straggler's
    delay, if any); with one, it sleeps ``f_r * D`` (times a straggler's factor, if any) instead of
    ``D``. The ``hetero`` scenario (``bench/harness/scenarios.py``) gives the factors.
"""

from __future__ import annotations

import hashlib
import statistics

import torch

from pyasync.demo.straggler import Injection, device_injection, measure_all_ranks, straggler_delay_s
from pyasync.demo.train import RankRun

from .workload import BenchConfig


def transient_slow(seed: int, rank: int, step: int, prob: float) -> bool:
    """Whether step ``step`` (0-based, of this rank) of ``rank`` is slowed; see Note [Transient slowdowns].

    One uniform draw of a ``torch.Generator`` seeded from a hash of (seed, rank, step), compared with
    ``prob``: a pure function of its arguments, identical for every system and every run.
    """
    key = hashlib.blake2b(f"transient/{seed}/{rank}/{step}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return bool(torch.rand(1, generator=g, dtype=torch.float64).item() < prob)


class StepSleeps:
    """The sleep before each step of one rank (the ``sleep_s`` of ``pyasync.demo.train.timed_loop``):
    ``base_s``, plus ``transient_s`` on the steps drawn slow. Counts the slow steps taken."""

    def __init__(self, base_s: float, transient_s: float, slow_at: list[bool]) -> None:
        self.base_s = base_s  # sleep before every step (s): straggler, speed, emulated device
        self.transient_s = transient_s  # extra sleep of a slow step (s)
        self.slow_at = slow_at  # slow_at[k]: step k of this rank is slow (drawn before the timed window)
        self.slow_steps = 0  # slow steps taken so far

    def __call__(self, step: int) -> float:
        pause = self.base_s
        if self.slow_at and self.slow_at[step]:
            pause += self.transient_s
            self.slow_steps += 1
        return pause


def plan_slowdowns(cfg: BenchConfig, run: RankRun) -> tuple[Injection, StepSleeps]:
    """This rank's injected slowdowns. Without an emulated device, ``C`` is ``cfg.compute_s``, or measured
    on every rank (a collective: call on every rank) when a slowdown needs it. See Note [Transient
    slowdowns] and Note [Rank speeds]."""
    speed = 1.0 if cfg.speeds is None else cfg.speeds[run.rank]
    transient = (0.0, 1.0) if cfg.transient is None else cfg.transient
    if cfg.device_ms is not None:
        injected = device_injection(cfg, run.rank, speed)
        base_s, transient_s = injected.sleep_s, (transient[1] - 1.0) * injected.sleep_s
    else:
        compute_s = cfg.compute_s
        measured = None
        if compute_s is None and (
            cfg.transient is not None
            or cfg.speeds is not None
            or (cfg.straggler is not None and cfg.straggler_delay_s is None)
        ):
            measured = measure_all_ranks(cfg, run.model, run.x, run.y)
            compute_s = statistics.median(measured)
        delay_s = straggler_delay_s(cfg, run.rank, measured, cfg.compute_s)
        base_s = delay_s + (speed - 1.0) * (compute_s or 0.0)
        injected = Injection(sleep_s=base_s, delay_s=delay_s, compute_s=compute_s, measured=measured)
        transient_s = (transient[1] - 1.0) * (compute_s or 0.0)
    slow_at: list[bool] = []
    if cfg.transient is not None:
        # Drawn before the timed window, for every step this rank could possibly take.
        steps = run.my_steps if cfg.system.synchronous else run.budget
        slow_at = [transient_slow(cfg.seed, run.rank, k, transient[0]) for k in range(steps)]
    return injected, StepSleeps(base_s, transient_s, slow_at)
