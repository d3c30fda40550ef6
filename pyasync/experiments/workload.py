"""The demo workload: systems, options, the digits data split, the MLP and the straggler's calibration.

Note [Straggler injection]
    The straggler rank sleeps ``(FACTOR - 1) * C`` seconds at the start of every step (before the
    forward pass), so that its step takes ``FACTOR`` times its own compute time ``C``. ``C`` is the
    median time of one local step (forward, loss, backward, ``torch.optim.SGD.step``) on a private
    copy of the model, with no communication, measured by every rank at the same time before training
    (so the CPU contention matches training) and taken from the straggler rank. It is measured once,
    by the first run of a demo, and the same number of seconds is reused for every later run, so each
    system gets exactly the same injected delay. Sleeping instead of repeating the compute frees the
    CPU for the other workers, which matters on a machine with fewer cores than workers.

Note [Work budget]
    ``epochs`` fixes the total work, not each worker's: the cluster computes ``epochs *
    steps_per_epoch * workers`` gradient steps of ``batch_size`` samples, where ``steps_per_epoch =
    (n_train // workers) // batch_size``. Every rank claims each step from a shared counter in the
    rendezvous store before computing it. Synchronous systems (DDP, BSP) must take equal numbers of
    steps, so each rank takes exactly ``epochs * steps_per_epoch``; asynchronous policies (SSP, ASP,
    Quorum) stop when the counter is spent, so fast workers take more steps than a straggler, which is
    the point of them. The counter round trip is paid by every system alike. A rank draws its batches
    from its own shard only, reshuffled each pass with a seed of (seed, rank, pass).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One system to train under, parsed from a name like ``ddp``, ``ssp:2`` or ``asp+int8``."""

    name: str  # the name as given, used in tables and plots
    policy: str | None  # pyasync policy string (see pyasync.parse_policy); None for DDP
    compression: str | None  # pyasync compression string (see pyasync.compression.from_spec) or None
    synchronous: bool  # every rank takes the same number of steps (DDP, BSP); see Note [Work budget]

    @property
    def is_ddp(self) -> bool:
        """True for torch's DistributedDataParallel, False for pyasync."""
        return self.policy is None


def parse_system(token: str, workers: int) -> SystemSpec:
    """Parse one system name: ``ddp``, or a pyasync policy string optionally followed by ``+COMPRESSION``.

    Policies as ``pyasync.parse_policy`` reads them (``bsp``, ``asp``, ``ssp:2``, ``quorum:3``, ...),
    compressions as ``pyasync.compression.from_spec`` does (``int8``, ``fp16``, ``topk:0.01``, ...);
    a quorum may not exceed ``workers``. Raises ValueError naming the token.
    """
    name = token.strip()
    base, plus, codec = name.lower().partition("+")
    if base == "ddp":
        if plus:
            raise ValueError(f"system {name!r}: compression applies to pyasync policies, not to ddp")
        return SystemSpec(name=name, policy=None, compression=None, synchronous=True)
    import pyasync

    try:
        policy = pyasync.parse_policy(base)
    except (ValueError, TypeError) as e:
        raise ValueError(f"system {name!r}: {e}, or 'ddp' for DistributedDataParallel") from None
    try:
        if plus:
            pyasync.compression.from_spec(codec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"system {name!r}: {e}") from None
    if isinstance(policy, pyasync.Quorum) and policy.k > workers:
        raise ValueError(f"system {name!r}: quorum size must be in 1..workers={workers}")
    return SystemSpec(
        name=name,
        policy=base,
        compression=codec if plus else None,
        synchronous=isinstance(policy, pyasync.BSP),
    )


def parse_systems(text: str, workers: int) -> list[SystemSpec]:
    """Parse a comma-separated list of system names (see :func:`parse_system`); names must be unique."""
    specs = [parse_system(t, workers) for t in text.split(",") if t.strip()]
    if not specs:
        raise ValueError("--policies: give at least one system, e.g. ddp,bsp,ssp:2,asp,quorum:3")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--policies: system names must be unique, got {names}")
    return specs


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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; identical on every rank."""

    system: SystemSpec  # what to train under
    workers: int  # number of ranks
    epochs: int = 20  # total work in passes over the training set, see Note [Work budget]
    batch_size: int = 64  # samples per step per rank
    hidden: int = 512  # width of the MLP's two hidden layers
    lr: float = 0.2  # SGD learning rate
    momentum: float = 0.0  # SGD momentum (stale asynchronous pushes and momentum mix badly)
    seed: int = 0  # data split, model init and batch order
    straggler: tuple[int, float] | None = None  # (rank, factor) or None, see Note [Straggler injection]
    straggler_delay_s: float | None = None  # fixed injected delay per step (s); None: measure it
    eval_points: int = 40  # about how many accuracy snapshots rank 0 takes
    timeout_s: float = 60.0  # every collective, store and optimizer wait (seconds)
    fault: tuple[int, int, str] | None = None  # tests: (rank, step, "raise"|"exit"|"hang") fails that rank

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1 or self.hidden < 1:
            raise ValueError(f"batch_size and hidden must be >= 1, got {self.batch_size}, {self.hidden}")
        if not self.lr > 0 or not self.momentum >= 0 or self.eval_points < 1:
            raise ValueError(
                f"lr must be > 0, momentum >= 0 and eval_points >= 1, got {self.lr}, {self.momentum}, "
                f"{self.eval_points}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.fault is not None and self.fault[2] not in ("raise", "exit", "hang"):
            raise ValueError(f"fault kind must be 'raise', 'exit' or 'hang', got {self.fault[2]!r}")
        if self.straggler_delay_s is not None and not self.straggler_delay_s >= 0:
            raise ValueError(f"straggler_delay_s must be >= 0 seconds, got {self.straggler_delay_s}")


# ---------------------------------------------------------------------------------------------------
# Data and model
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Digits:
    """The standardised digits data set, split once with a fixed seed."""

    x_train: torch.Tensor  # (n_train, 64) float32, standardised with the training set's statistics
    y_train: torch.Tensor  # (n_train,) int64 class labels 0..9
    x_test: torch.Tensor  # (n_test, 64) float32, standardised with the training set's statistics
    y_test: torch.Tensor  # (n_test,) int64


@functools.lru_cache(maxsize=4)
def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> Digits:
    """scikit-learn's ``load_digits`` (1797 8x8 images shipped with scikit-learn), stratified split.

    Features are standardised with the training set's per-pixel mean and standard deviation (pixels
    that are constant in the training set keep scale 1).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    x_tr = torch.as_tensor(x_tr, dtype=torch.float32)
    x_te = torch.as_tensor(x_te, dtype=torch.float32)
    mean = x_tr.mean(0)
    std = x_tr.std(0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return Digits(
        (x_tr - mean) / std,
        torch.as_tensor(y_tr, dtype=torch.int64),
        (x_te - mean) / std,
        torch.as_tensor(y_te, dtype=torch.int64),
    )


def shard_indices(n: int, rank: int, world: int, seed: int) -> torch.Tensor:
    """Indices of ``rank``'s shard: a seeded permutation of ``range(n)`` dealt round-robin to ranks.

    Shards are disjoint and together cover every index; sizes differ by at most one.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[rank::world]


def steps_per_epoch(n_train: int, workers: int, batch_size: int) -> int:
    """Steps one rank takes per pass over its shard (full batches of the smallest shard)."""
    steps = (n_train // workers) // batch_size
    if steps < 1:
        raise ValueError(
            f"batch_size={batch_size} is larger than a shard ({n_train // workers} samples with "
            f"{workers} workers): use a smaller batch size or fewer workers"
        )
    return steps


def make_model(hidden: int, seed: int) -> nn.Module:
    """The MLP 64 -> hidden -> hidden -> 10 (ReLU), initialised from ``seed`` (same on every rank)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y``."""
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


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


def _batches(x: torch.Tensor, y: torch.Tensor, steps: int, batch_size: int, seed: int, rank: int):
    """Endless batches from one shard: ``steps`` per pass, reshuffled each pass from (seed, rank, pass)."""
    n_pass = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + n_pass)
        perm = torch.randperm(len(x), generator=g)
        for s in range(steps):
            idx = perm[s * batch_size : (s + 1) * batch_size]
            yield x[idx], y[idx]
        n_pass += 1
