"""What the demo trains under (``ddp`` or a pyasync policy, optionally with compression) and the options of
one training run (:class:`TrainConfig`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from torch import nn

from pyasync.demo.data import Digits, budget_steps, load_digits_split, make_model


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One system to train under, parsed from a name like ``ddp``, ``ssp:2`` or ``asp+int8``."""

    name: str  # the name as given, used in tables and plots
    policy: str | None  # pyasync policy string (see pyasync.parse_policy); None for DDP
    compression: str | None  # pyasync compression string (see pyasync.compression.from_spec) or None
    synchronous: bool  # every rank takes the same number of steps (DDP, BSP); see Note [Work budget]
    kind: str = "pyasync"  # "pyasync" or "ddp" (DistributedDataParallel); benchmarks may add kinds

    @property
    def is_ddp(self) -> bool:
        """True for torch's DistributedDataParallel."""
        return self.kind == "ddp"

    @property
    def is_pyasync(self) -> bool:
        """True for :class:`pyasync.DistributedOptimizer`."""
        return self.kind == "pyasync"


def parse_system(token: str, workers: int) -> SystemSpec:
    """Parse one system name: ``ddp``, or a pyasync policy string optionally followed by ``+COMPRESSION``.

    ``ddp`` is DistributedDataParallel with its default all-reduce. Policies as ``pyasync.parse_policy``
    reads them (``bsp``, ``asp``, ``ssp:2``, ``quorum:3``, ...), compressions as
    ``pyasync.compression.from_spec`` does (``int8``, ``fp16``, ``topk:0.01``, ...); a quorum may not
    exceed ``workers``. Raises ValueError naming the token.
    """
    name = token.strip()
    base, plus, codec = name.lower().partition("+")
    if base == "ddp":
        if plus:
            raise ValueError(
                f"system {name!r}: ddp runs with its default all-reduce here; compression {codec!r} applies "
                "to pyasync policies, not to ddp (bench/e2e.py also runs ddp+fp16 and ddp+powersgd)"
            )
        return SystemSpec(name=name, policy=None, compression=None, synchronous=True, kind="ddp")
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
    k = policy.k if isinstance(policy, (pyasync.Quorum, pyasync.Local)) else 0
    if k > workers:
        raise ValueError(f"system {name!r}: quorum size must be in 1..workers={workers}")
    return SystemSpec(
        name=name,
        policy=base,
        compression=codec if plus else None,
        synchronous=isinstance(policy, pyasync.BSP),
    )


def parse_systems(
    text: str, workers: int, parse: Callable[[str, int], SystemSpec] = parse_system
) -> list[SystemSpec]:
    """Parse a comma-separated list of system names with ``parse(name, workers)`` (default
    :func:`parse_system`; a benchmark passes its own, which knows more systems); names must be unique."""
    specs = [parse(t, workers) for t in text.split(",") if t.strip()]
    if not specs:
        raise ValueError("--policies: give at least one system, e.g. ddp,bsp,ssp:2,asp,quorum:3")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--policies: system names must be unique, got {names}")
    return specs


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
    straggler_delay_s: float | None = None  # fixed injected delay per step (s); None: measured
    device_ms: float | None = None  # emulated device compute per step (ms), see Note [Emulated device]
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
        if self.device_ms is not None and not 0 < self.device_ms < math.inf:
            raise ValueError(f"device_ms must be a finite number > 0 of milliseconds, got {self.device_ms}")
        if self.device_ms is not None and self.straggler_delay_s is not None:
            raise ValueError(
                "straggler_delay_s fixes the straggler's delay of the CPU-only mode; with device_ms the "
                "straggler sleeps FACTOR x device_ms per step (see Note [Emulated device])"
            )

    def load_data(self) -> Digits:
        """The data set this run trains on (the digits, split with ``seed``)."""
        return load_digits_split(self.seed)

    def build_model(self, data: Digits) -> nn.Module:
        """The replica every rank trains (the same on every rank) and the probe the curve is evaluated
        with: the MLP of ``pyasync.demo.data.make_model`` with ``hidden`` and ``seed``, as wide as
        ``data``'s features."""
        return make_model(self.hidden, self.seed, data.x_train.shape[1])

    def budget(self, n_train: int) -> int:
        """Gradient steps of the whole cluster for a training set of ``n_train`` (Note [Work budget])."""
        return budget_steps(n_train, self.workers, self.batch_size, self.epochs)
