"""The workloads: systems, options, the data sets (digits, a synthetic teacher task), the MLPs, and the
injected slowdowns (a persistent straggler, seeded transient slowdowns) with their calibration.

Note [Straggler injection]
    The straggler rank sleeps ``(FACTOR - 1) * C`` seconds at the start of every step (before the
    forward pass), so that its step takes ``FACTOR`` times its own compute time ``C``. ``C`` is the
    median time of one local step (forward, loss, backward, ``torch.optim.SGD.step``) on a private
    copy of the model, with no communication, measured by every rank at the same time before training
    (so the CPU contention matches training) and taken from the straggler rank. It is measured once,
    by the first run of a demo, and the same number of seconds is reused for every later run, so each
    system gets exactly the same injected delay. Sleeping instead of repeating the compute frees the
    CPU for the other workers, which matters on a machine with fewer cores than workers.
    ``TrainConfig.compute_s`` fixes ``C`` instead (``python bench/e2e.py`` measures it once per model,
    all ranks at once, and takes the median over ranks); the delay is then ``(FACTOR - 1) * C``.

Note [Transient slowdowns]
    ``TrainConfig.transient = (PROB, FACTOR)`` slows each step of every rank by ``FACTOR`` with
    probability ``PROB``, injected like the straggler: a sleep of ``(FACTOR - 1) * C`` before the
    forward pass, with ``C`` the compute time above (``compute_s``, or the median over ranks of the
    measured one). Whether step ``k`` of rank ``r`` is slowed is one draw of a ``torch.Generator``
    seeded from a hash of (seed, r, k) (:func:`transient_slow`), so it depends on nothing else: every
    system sees exactly the same slow steps, a rank's k-th step is slow in all of them or in none.
    Asynchronous systems let fast ranks take more steps than synchronous ones; the draws of the steps
    they have in common still agree.

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
import hashlib
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
    kind: str = "pyasync"  # "pyasync", "ddp" (DistributedDataParallel) or "hivemind" (hivemind.Optimizer)

    @property
    def is_ddp(self) -> bool:
        """True for torch's DistributedDataParallel (with any of its communication hooks)."""
        return self.kind == "ddp"

    @property
    def is_pyasync(self) -> bool:
        """True for :class:`pyasync.DistributedOptimizer`."""
        return self.kind == "pyasync"

    @property
    def ddp_hook(self) -> str | None:
        """DDP's communication hook: "allreduce", "fp16" or "powersgd"; None for other systems."""
        if not self.is_ddp:
            return None
        return "allreduce" if self.compression is None else self.compression.split(":")[0]

    @property
    def powersgd_rank(self) -> int | None:
        """PowerSGD's matrix approximation rank (``ddp+powersgd:RANK``, default 2); None otherwise."""
        if self.ddp_hook != "powersgd":
            return None
        _, _, rank = self.compression.partition(":")
        return int(rank) if rank else DEFAULT_POWERSGD_RANK


#: PowerSGD rank of ``ddp+powersgd`` (rank 2 keeps ~99% of this MLP's bytes off the wire).
DEFAULT_POWERSGD_RANK = 2


def _parse_ddp_hook(name: str, codec: str) -> str:
    """The normalised DDP hook spec of ``ddp+CODEC``: "fp16" or "powersgd:RANK"."""
    head, colon, arg = codec.partition(":")
    if head == "fp16" and not colon:
        return "fp16"
    if head == "powersgd":
        try:
            rank = int(arg) if colon else DEFAULT_POWERSGD_RANK
        except ValueError:
            rank = 0
        if rank >= 1:
            return f"powersgd:{rank}"
        raise ValueError(f"system {name!r}: PowerSGD rank must be an int >= 1, e.g. ddp+powersgd:2")
    raise ValueError(
        f"system {name!r}: ddp takes +fp16 or +powersgd[:RANK] (its communication hooks); compression "
        f"{codec!r} applies to pyasync policies, not to ddp"
    )


def parse_system(token: str, workers: int) -> SystemSpec:
    """Parse one system name: ``ddp``, ``ddp+fp16``, ``ddp+powersgd[:RANK]``, ``hivemind``, or a pyasync
    policy string optionally followed by ``+COMPRESSION``.

    ``ddp+fp16`` and ``ddp+powersgd`` are DDP with torch's ``fp16_compress_hook`` and ``powerSGD_hook``
    (rank 2 unless given). Policies as ``pyasync.parse_policy`` reads them (``bsp``, ``asp``,
    ``ssp:2``, ``quorum:3``, ...), compressions as ``pyasync.compression.from_spec`` does (``int8``,
    ``fp16``, ``topk:0.01``, ...); a quorum may not exceed ``workers``. Raises ValueError naming the
    token.
    """
    name = token.strip()
    base, plus, codec = name.lower().partition("+")
    if base == "ddp":
        hook = _parse_ddp_hook(name, codec) if plus else None
        return SystemSpec(name=name, policy=None, compression=hook, synchronous=True, kind="ddp")
    if base == "hivemind":
        if plus:
            raise ValueError(f"system {name!r}: hivemind runs without compression here")
        return SystemSpec(name=name, policy=None, compression=None, synchronous=False, kind="hivemind")
    import pyasync

    try:
        policy = pyasync.parse_policy(base)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"system {name!r}: {e}, or 'ddp' for DistributedDataParallel (also 'ddp+fp16', "
            "'ddp+powersgd'), or 'hivemind'"
        ) from None
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
    model: str = "mlp"  # workload, a key of MODELS: "mlp" (digits) or "wide" (synthetic teacher task)
    epochs: int = 20  # total work in passes over the training set, see Note [Work budget]
    batch_size: int = 64  # samples per step per rank
    hidden: int = 512  # width of the MLP's two hidden layers
    lr: float = 0.2  # SGD learning rate
    momentum: float = 0.0  # SGD momentum (stale asynchronous pushes and momentum mix badly)
    seed: int = 0  # data split, model init and batch order
    straggler: tuple[int, float] | None = None  # (rank, factor) or None, see Note [Straggler injection]
    straggler_delay_s: float | None = None  # fixed injected delay per step (s); None: from compute_s
    transient: tuple[float, float] | None = None  # (prob, factor), see Note [Transient slowdowns]
    compute_s: float | None = None  # compute time C of one step (s) for injected delays; None: measure
    powersgd_warmup: int | None = None  # ddp+powersgd: all-reduce steps first; None: see powersgd_warmup
    bandwidth_gbps: float | None = None  # local runs: PYASYNC_LINK_GBPS of the workers (Gbit/s); None: unset
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
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        if self.transient is not None:
            prob, factor = self.transient
            if not 0 <= prob <= 1 or not 1 <= factor < math.inf:
                raise ValueError(
                    f"transient must be (prob, factor) with 0 <= prob <= 1 and a finite factor >= 1, got "
                    f"{self.transient}"
                )
        if self.compute_s is not None and not self.compute_s >= 0:
            raise ValueError(f"compute_s must be >= 0 seconds, got {self.compute_s}")
        if self.bandwidth_gbps is not None and not 0 < self.bandwidth_gbps < math.inf:
            raise ValueError(
                f"bandwidth_gbps must be a finite number > 0 (Gbit/s), got {self.bandwidth_gbps}"
            )
        if self.powersgd_warmup is not None and self.powersgd_warmup < 2:
            raise ValueError(
                f"powersgd_warmup must be >= 2 steps (PowerSGD's rule), got {self.powersgd_warmup}"
            )


# ---------------------------------------------------------------------------------------------------
# Data and model
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Digits:
    """A classification data set split once with a fixed seed: the standardised digits, or the teacher
    task of :func:`load_teacher_split` (same fields, 256 features)."""

    x_train: torch.Tensor  # (n_train, features) float32 (digits: standardised with the training statistics)
    y_train: torch.Tensor  # (n_train,) int64 class labels 0..9
    x_test: torch.Tensor  # (n_test, features) float32
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


@functools.lru_cache(maxsize=4)
def load_teacher_split(
    seed: int = 0,
    n_train: int = 8192,
    n_test: int = 2048,
    features: int = 256,
    latent: int = 16,
    ambiguous: float = 0.25,
) -> Digits:
    """A synthetic 10-class task whose labels come from a fixed random teacher network (``seed``).

    Inputs are ``x = z A + 0.1 e`` with ``z`` of ``latent`` standard normal coordinates, ``A`` a fixed
    random ``latent x features`` map and ``e`` standard normal noise in every feature. The teacher is a
    random MLP ``latent -> 32 (tanh) -> 10`` on ``z``; its logits are centred over the data and the
    label is their argmax. The ``ambiguous`` fraction of samples with the smallest gap between the two
    largest teacher logits is dropped, so the task has margins and high accuracy is reachable (a
    single-process run of the default wide MLP with the same global batch reaches ~0.90 test accuracy in
    2 epochs and ~0.96 in 4). Deterministic for a given seed.
    """
    if not 0 <= ambiguous < 1:
        raise ValueError(f"ambiguous must be in [0, 1), got {ambiguous}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7919)
    a = torch.randn(latent, features, generator=g) / math.sqrt(latent)
    w1 = torch.randn(latent, 32, generator=g) / math.sqrt(latent)
    w2 = torch.randn(32, 10, generator=g) / math.sqrt(32)
    need = n_train + n_test
    n = int(math.ceil(need / (1 - ambiguous))) + 16
    z = torch.randn(n, latent, generator=g)
    x = z @ a + 0.1 * torch.randn(n, features, generator=g)
    logits = torch.tanh(0.5 * (z @ w1)) @ w2
    logits = logits - logits.mean(0)
    top2 = logits.topk(2, dim=1).values
    gap = top2[:, 0] - top2[:, 1]
    keep = torch.argsort(gap, descending=True, stable=True)[:need]
    keep = keep.sort().values  # original (random) order
    x, y = x[keep].contiguous(), logits[keep].argmax(1)
    return Digits(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One workload of the benchmarks: a data set and the MLP trained on it."""

    name: str  # key of MODELS
    features: int  # input width of the MLP
    hidden: int  # default width of its two hidden layers
    lr: float  # default SGD learning rate
    target: float  # default target test accuracy for time-to-target (reachable in the default budget)
    epochs: int  # default budget of python bench/e2e.py (passes over the training set)
    data: str  # what it trains on, in words


#: The workloads. "mlp" is the demo's (digits, ~300K parameters, 1.2 MB); "wide" has ~4.7M parameters
#: (19 MB of fp32 gradients per step) on the teacher task, where the wire starts to matter.
MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", 64, 512, 0.2, 0.95, 20, "scikit-learn digits (8x8 images)"),
    "wide": ModelSpec("wide", 256, 2048, 0.05, 0.90, 6, "synthetic teacher task (256 features)"),
}


def load_split(model: str, seed: int = 0) -> Digits:
    """The data set of workload ``model`` (a key of MODELS), split with ``seed``."""
    if model == "mlp":
        return load_digits_split(seed)
    if model == "wide":
        return load_teacher_split(seed)
    raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")


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


def make_model(hidden: int, seed: int, features: int = 64) -> nn.Module:
    """The MLP features -> hidden -> hidden -> 10 (ReLU), initialised from ``seed`` (same on every rank)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )


def transient_slow(seed: int, rank: int, step: int, prob: float) -> bool:
    """Whether step ``step`` (0-based, of this rank) of ``rank`` is slowed; see Note [Transient slowdowns].

    One uniform draw of a ``torch.Generator`` seeded from a hash of (seed, rank, step), compared with
    ``prob``: a pure function of its arguments, identical for every system and every run.
    """
    key = hashlib.blake2b(f"transient/{seed}/{rank}/{step}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return bool(torch.rand(1, generator=g, dtype=torch.float64).item() < prob)


def powersgd_warmup(steps_per_rank: int) -> int:
    """Default ``start_powerSGD_iter`` of ``ddp+powersgd``: 10 plain all-reduce steps, at most ~10% of
    the run, at least 2 (PowerSGD requires > 1 with error feedback). They are timed and counted."""
    return max(2, min(10, steps_per_rank // 10))


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
