"""Consistency policies: BSP, SSP(s), ASP and Quorum(k). Pure decision logic, no I/O.

Vocabulary (see docs/architecture.md):

* A worker's *clock* is the number of its completed ``step()`` calls; the push it makes during step
  ``t`` carries clock ``t``.
* An owner counts *versions* of each of its shards: the number of updates applied to that shard.
* ``included[w]`` (as seen by one shard) is the highest clock ``c`` such that every push of worker
  ``w`` with clock ``<= c`` has been processed by the shard (applied, dropped or skipped), ``-1`` when
  none has. A closed worker has pushed everything it ever will.

Each owner asks the policy three questions:

* :meth:`Policy.answer_now` (SSP/ASP): may the push of clock ``t`` from a worker be answered with the
  shard's current values? The worker waits for that answer, so this is where SSP's bound lives.
* :meth:`Policy.update_ready` (BSP/Quorum): is the aggregate for the current clock/version complete?
* :meth:`Policy.is_late` (Quorum): was a push computed on a superseded version?

The worker side needs only :attr:`Policy.worker_waits`; :meth:`Policy.may_start` states SSP's rule from
the worker's point of view and is what the tests check the installed parameters against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Union

__all__ = ["ASP", "BSP", "SSP", "Policy", "Quorum", "parse_policy"]

_LR_SCALES = (None, "inverse")


class Policy:
    """Base class. Subclasses are small immutable dataclasses; ``spec()`` round-trips through
    :func:`parse_policy`."""

    #: "each": every push is its own update, scaled by 1/n (SSP, ASP);
    #: "aggregate": one update from the mean of several pushes (BSP, Quorum).
    mode: str = "each"
    #: Whether ``step()`` waits for the owners' answers to its pushes.
    worker_waits: bool = True

    def spec(self) -> str:
        raise NotImplementedError

    def validate(self, world_size: int) -> None:
        """Raise ValueError when the policy cannot run with ``world_size`` workers."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")

    # -- owner side, mode "each" -------------------------------------------------------------------
    def answer_now(self, clock: int, included: Sequence[int], closed: Sequence[bool]) -> bool:
        """May a worker's push of clock ``clock`` be answered with the current shard values?

        ``included[w]``: highest clock of worker w fully processed by this shard (-1: none);
        ``closed[w]``: worker w has closed (it will push nothing more)."""
        raise NotImplementedError

    def lr_factor(self, staleness: int) -> float:
        """Factor on the learning rate of an update whose push is ``staleness`` versions old."""
        return 1.0

    # -- owner side, mode "aggregate" --------------------------------------------------------------
    def quorum(self, world_size: int) -> int:
        """Pushes that complete one aggregate update (all workers for BSP, k for Quorum)."""
        return world_size

    def update_ready(self, pushed: AbstractSet[int], closed: AbstractSet[int], world_size: int) -> bool:
        """Is the aggregate complete, given the workers ``pushed`` that contributed a push to it and the
        workers ``closed`` that will push nothing more?"""
        raise NotImplementedError

    def divisor(self, world_size: int) -> int:
        """The mean's denominator: each push's gradient is scaled by 1 / divisor."""
        return world_size

    def is_late(self, push_version: int, current_version: int) -> bool:
        """Was this push computed on a version the shard has already moved past?"""
        return False

    def __str__(self) -> str:
        return self.spec()


def _check_lr_scale(lr_scale: str | None) -> None:
    if lr_scale not in _LR_SCALES:
        raise ValueError(f"lr_scale must be None or 'inverse', got {lr_scale!r}")


@dataclass(frozen=True)
class BSP(Policy):
    """Bulk-synchronous: for every clock t each owner applies ONE update from the mean of all n
    workers' gradients of clock t, and a worker starts step t+1 only on parameters that include update t
    from every owner. Equal to DDP with the same optimizer, up to float rounding."""

    mode = "aggregate"

    def spec(self) -> str:
        return "bsp"

    def update_ready(self, pushed: AbstractSet[int], closed: AbstractSet[int], world_size: int) -> bool:
        # Every worker that can still push has pushed; workers that closed early count as zeros in the
        # mean (the divisor stays n).
        return bool(pushed) and all(w in pushed or w in closed for w in range(world_size))

    def answer_now(self, clock: int, included: Sequence[int], closed: Sequence[bool]) -> bool:
        return SSP(0).answer_now(clock, included, closed)


@dataclass(frozen=True)
class SSP(Policy):
    """Stale-synchronous with bound ``staleness`` = s >= 0: every push is applied on arrival as one
    update (gradient scaled by 1/n); a worker may start step t only on parameters that include every
    worker's pushes of every clock <= t - s - 1. ``lr_scale="inverse"`` divides each update by
    max(1, staleness)."""

    staleness: int = 0
    lr_scale: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.staleness, int) or isinstance(self.staleness, bool) or self.staleness < 0:
            raise ValueError(f"SSP staleness must be an int >= 0, got {self.staleness!r}")
        _check_lr_scale(self.lr_scale)

    def spec(self) -> str:
        return f"ssp:{self.staleness}" + (f":{self.lr_scale}" if self.lr_scale else "")

    def may_start(self, clock: int, included: Sequence[int]) -> bool:
        """May a worker start step ``clock`` on parameters whose shards include, for every worker w,
        all pushes of clocks <= included[w]?"""
        need = clock - self.staleness - 1
        return all(c >= need for c in included)

    def answer_now(self, clock: int, included: Sequence[int], closed: Sequence[bool]) -> bool:
        # The answer to push `clock` is what the worker starts step clock+1 on.
        need = clock - self.staleness
        return all(done or c >= need for c, done in zip(included, closed))

    def lr_factor(self, staleness: int) -> float:
        return 1.0 / max(1, staleness) if self.lr_scale == "inverse" else 1.0


@dataclass(frozen=True)
class ASP(Policy):
    """Asynchronous: every push is applied on arrival (gradient scaled by 1/n) and answered at once;
    a worker never waits, it installs whatever shard values have arrived."""

    lr_scale: str | None = None
    worker_waits = False

    def __post_init__(self) -> None:
        _check_lr_scale(self.lr_scale)

    def spec(self) -> str:
        return "asp" + (f":{self.lr_scale}" if self.lr_scale else "")

    def may_start(self, clock: int, included: Sequence[int]) -> bool:
        return True

    def answer_now(self, clock: int, included: Sequence[int], closed: Sequence[bool]) -> bool:
        return True

    def lr_factor(self, staleness: int) -> float:
        return 1.0 / max(1, staleness) if self.lr_scale == "inverse" else 1.0


@dataclass(frozen=True)
class Quorum(Policy):
    """Backup workers: an owner applies one update for version v from the mean of the first k pushes
    computed on version v. Pushes computed on an older version are dropped and counted
    (``late="drop"``) or added to the next update with their staleness recorded (``late="fold"``).
    A worker that pushed for version v waits for a newer version; a superseded worker does not wait.
    Quorum(n) equals BSP."""

    k: int = 1
    late: str = "drop"
    mode = "aggregate"

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"Quorum k must be an int >= 1, got {self.k!r}")
        if self.late not in ("drop", "fold"):
            raise ValueError(f"Quorum late must be 'drop' or 'fold', got {self.late!r}")

    def spec(self) -> str:
        return f"quorum:{self.k}" + (":fold" if self.late == "fold" else "")

    def validate(self, world_size: int) -> None:
        super().validate(world_size)
        if self.k > world_size:
            raise ValueError(
                f"Quorum k={self.k} exceeds the number of workers ({world_size}); use 1 <= k <= {world_size}"
            )

    def quorum(self, world_size: int) -> int:
        return min(self.k, world_size)

    def update_ready(self, pushed: AbstractSet[int], closed: AbstractSet[int], world_size: int) -> bool:
        # k pushes, or fewer when nobody else can push any more (workers closed): never stall.
        if len(pushed) >= min(self.k, world_size):
            return True
        return bool(pushed) and all(w in pushed or w in closed for w in range(world_size))

    def divisor(self, world_size: int) -> int:
        return min(self.k, world_size)

    def is_late(self, push_version: int, current_version: int) -> bool:
        return push_version < current_version

    def answer_now(self, clock: int, included: Sequence[int], closed: Sequence[bool]) -> bool:
        return False  # answered when a newer version exists (see owner.py)


PolicyLike = Union[Policy, str, None]  # noqa: UP007 - a runtime alias, kept readable on 3.10


def parse_policy(x: PolicyLike) -> Policy:
    """A Policy from a Policy, None (BSP) or a spec string: "bsp", "asp", "asp:inverse", "ssp:2",
    "ssp:2:inverse", "quorum:3", "quorum:3:fold"."""
    if x is None:
        return BSP()
    if isinstance(x, Policy):
        return x
    if not isinstance(x, str):
        raise TypeError(
            f"policy must be a pyasync Policy (BSP(), SSP(s), ASP(), Quorum(k)) or a string, got "
            f"{type(x).__name__}"
        )
    parts = x.strip().lower().split(":")
    name, args = parts[0], parts[1:]
    try:
        if name == "bsp" and not args:
            return BSP()
        if name == "asp" and len(args) <= 1:
            return ASP(lr_scale=args[0] if args else None)
        if name == "ssp" and 1 <= len(args) <= 2:
            return SSP(int(args[0]), lr_scale=args[1] if len(args) == 2 else None)
        if name == "quorum" and 1 <= len(args) <= 2:
            return Quorum(int(args[0]), late=args[1] if len(args) == 2 else "drop")
    except ValueError as e:
        raise ValueError(f"bad policy string {x!r}: {e}") from None
    raise ValueError(
        f"unknown policy string {x!r}; use 'bsp', 'asp', 'asp:inverse', 'ssp:<s>', 'ssp:<s>:inverse', "
        f"'quorum:<k>' or 'quorum:<k>:fold'"
    )


def min_included(included: Mapping[int, int] | Sequence[int]) -> int:
    """The clock up to which every worker's pushes are included (-1: not every worker has one)."""
    vals = list(included.values()) if isinstance(included, Mapping) else list(included)
    return min(vals) if vals else -1
