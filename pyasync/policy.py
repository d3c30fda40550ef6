"""Consistency policies: BSP, SSP(s), ASP and Quorum(k). Pure decision logic, no I/O.

Vocabulary (see docs/architecture.md):

* A worker's *clock* is the number of its completed ``step()`` calls; the push it makes during step
  ``t`` carries clock ``t``.
* An owner counts *versions* of each of its shards: the number of updates applied to that shard.
* ``included[w]`` (as seen by one shard) is the highest clock ``c`` such that every push of worker
  ``w`` with clock ``<= c`` has been processed by the shard (applied, dropped or skipped), ``-1`` when
  none has. A closed worker has pushed everything it ever will.

Each policy picks the round machine its owners run (:meth:`Policy.round`, see pyasync/engine/round.py)
and answers that machine's questions:

* SSP(s) and ASP run a :class:`~pyasync.engine.round.PushRound` (every push is its own update):
  :meth:`answer_now` (may the push of clock ``t`` be answered with the shard's current values? The
  worker waits for that answer, so this is where SSP's bound lives) and :meth:`lr_factor`.
* BSP and Quorum(k) run an :class:`~pyasync.engine.round.AggregateRound` (one update from the mean of
  several pushes): :meth:`update_ready` (is the aggregate complete?), :meth:`is_late` (was a push
  computed on a superseded version?) and :attr:`folds_late` (is a late push added to the next update
  rather than dropped?).

The worker side needs only :attr:`Policy.worker_waits`; :meth:`SSP.may_start` states SSP's rule from
the worker's point of view and is what the tests check the installed parameters against.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Union

from pyasync._validate import check_int
from pyasync.engine.round import AggregateRound, PushRound, Round

__all__ = ["ASP", "BSP", "SSP", "Policy", "Quorum", "parse_policy"]

_LR_SCALES = (None, "inverse")


class Policy:
    """Base class. Subclasses are small immutable dataclasses; ``spec()`` round-trips through
    :func:`parse_policy`."""

    #: Whether ``step()`` waits for the owners' answers to its pushes.
    worker_waits: bool = True
    #: ``max_grad_norm`` clips the mean gradient of a round (BSP, as DDP + clip_grad_norm_ does) rather
    #: than each worker's push.
    clips_mean: bool = False
    #: Every worker holds the same values between steps and no reply is in flight then, so what the
    #: workers hold can be saved and restored exactly (Note [Checkpoints and held values]).
    resumes_exactly: bool = False

    def spec(self) -> str:
        raise NotImplementedError

    def validate(self, world_size: int) -> None:
        """Raise ValueError when the policy cannot run with ``world_size`` workers."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")

    def round(self, world_size: int, n_segments: int, name: Hashable = 0, gated: bool = False) -> Round:
        """The state machine an owner runs for one shard (``n_segments`` parameters overlap it);
        ``gated``: complete aggregates wait for a release (only for policies that ``clips_mean``)."""
        raise NotImplementedError

    def divisor(self, world_size: int) -> int:
        """The mean's denominator: each push's gradient is scaled by 1 / divisor."""
        return world_size

    def __str__(self) -> str:
        return self.spec()


def _check_lr_scale(lr_scale: str | None) -> None:
    if lr_scale not in _LR_SCALES:
        raise ValueError(f"lr_scale must be None or 'inverse', got {lr_scale!r}")


class _PerPush(Policy):
    """SSP and ASP: every push is applied on arrival as one update (gradient scaled by 1/n)."""

    lr_scale: str | None = None

    def round(self, world_size: int, n_segments: int, name: Hashable = 0, gated: bool = False) -> Round:
        if gated:
            raise ValueError(f"{self.spec()} clips each push, not a round's mean: its rounds are never gated")
        return PushRound(self, world_size, n_segments, name)

    def answer_now(self, clock: int, included: Sequence[int], closed: Sequence[bool]) -> bool:
        """May a worker's push of clock ``clock`` be answered with the current shard values?

        ``included[w]``: highest clock of worker w fully processed by this shard (-1: none);
        ``closed[w]``: worker w has closed (it will push nothing more)."""
        raise NotImplementedError

    def lr_factor(self, staleness: int) -> float:
        """Factor on the learning rate of an update whose push is ``staleness`` versions old:
        1/max(1, staleness) with ``lr_scale="inverse"``, else 1."""
        return 1.0 / max(1, staleness) if self.lr_scale == "inverse" else 1.0


class _Aggregate(Policy):
    """BSP and Quorum: one update per version from the mean of several pushes."""

    #: A push computed on a superseded version is added to the next update (True) or dropped.
    folds_late: bool = False

    def round(self, world_size: int, n_segments: int, name: Hashable = 0, gated: bool = False) -> Round:
        return AggregateRound(self, world_size, n_segments, name, gated=gated)

    def update_ready(self, pushed: AbstractSet[int], absent: AbstractSet[int], world_size: int) -> bool:
        """Is the aggregate complete, given the workers ``pushed`` that contributed a push to it and the
        workers ``absent`` (closed, or paused in a barrier) that will push nothing for it?"""
        raise NotImplementedError

    def is_late(self, push_version: int, current_version: int) -> bool:
        """Was this push computed on a version the shard has already moved past?"""
        return False


@dataclass(frozen=True)
class BSP(_Aggregate):
    """Bulk-synchronous: for every clock t each owner applies ONE update from the mean of all n
    workers' gradients of clock t, and a worker starts step t+1 only on parameters that include update t
    from every owner. Equal to DDP with the same optimizer, up to float rounding.

    It runs on collectives (reduce-scatter or all-to-all, then all-gather: Note [BSP on collectives] in
    pyasync/engine/collective.py); ``p2p=True`` ("bsp:p2p") runs it on the point-to-point engine of the
    other policies instead, where workers may also take different numbers of steps (a worker that
    closed counts as zeros)."""

    p2p: bool = False
    clips_mean = True
    resumes_exactly = True

    def spec(self) -> str:
        return "bsp:p2p" if self.p2p else "bsp"

    def update_ready(self, pushed: AbstractSet[int], absent: AbstractSet[int], world_size: int) -> bool:
        # Every worker that can still push has pushed; workers that closed early count as zeros in the
        # mean (the divisor stays n).
        return bool(pushed) and all(w in pushed or w in absent for w in range(world_size))


@dataclass(frozen=True)
class SSP(_PerPush):
    """Stale-synchronous with bound ``staleness`` = s >= 0: every push is applied on arrival as one
    update (gradient scaled by 1/n); a worker may start step t only on parameters that include every
    worker's pushes of every clock <= t - s - 1. ``lr_scale="inverse"`` divides each update by
    max(1, staleness)."""

    staleness: int = 0
    lr_scale: str | None = None

    def __post_init__(self) -> None:
        check_int("SSP staleness", self.staleness, lo=0)
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


@dataclass(frozen=True)
class ASP(_PerPush):
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


@dataclass(frozen=True)
class Quorum(_Aggregate):
    """Backup workers: an owner applies one update for version v from the mean of the first k pushes
    computed on version v. Pushes computed on an older version are dropped and counted
    (``late="drop"``) or added to the next update with their staleness recorded (``late="fold"``).
    A worker that pushed for version v waits for a newer version; a superseded worker does not wait.
    Quorum(n) equals BSP."""

    k: int = 1
    late: str = "drop"

    def __post_init__(self) -> None:
        check_int("Quorum k", self.k, lo=1)
        if self.late not in ("drop", "fold"):
            raise ValueError(f"Quorum late must be 'drop' or 'fold', got {self.late!r}")

    @property
    def folds_late(self) -> bool:  # type: ignore[override]
        return self.late == "fold"

    def spec(self) -> str:
        return f"quorum:{self.k}" + (":fold" if self.late == "fold" else "")

    def validate(self, world_size: int) -> None:
        super().validate(world_size)
        if self.k > world_size:
            raise ValueError(
                f"Quorum k={self.k} exceeds the number of workers ({world_size}); use 1 <= k <= {world_size}"
            )

    def update_ready(self, pushed: AbstractSet[int], absent: AbstractSet[int], world_size: int) -> bool:
        # k pushes, or fewer when nobody else can push any more (workers closed or paused): never stall.
        if len(pushed) >= min(self.k, world_size):
            return True
        return bool(pushed) and all(w in pushed or w in absent for w in range(world_size))

    def divisor(self, world_size: int) -> int:
        return min(self.k, world_size)

    def is_late(self, push_version: int, current_version: int) -> bool:
        return push_version < current_version


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
        if name == "bsp" and args == ["p2p"]:
            return BSP(p2p=True)
        if name == "asp" and len(args) <= 1:
            return ASP(lr_scale=args[0] if args else None)
        if name == "ssp" and 1 <= len(args) <= 2:
            return SSP(int(args[0]), lr_scale=args[1] if len(args) == 2 else None)
        if name == "quorum" and 1 <= len(args) <= 2:
            return Quorum(int(args[0]), late=args[1] if len(args) == 2 else "drop")
    except ValueError as e:
        raise ValueError(f"bad policy string {x!r}: {e}") from None
    raise ValueError(
        f"unknown policy string {x!r}; use 'bsp', 'bsp:p2p', 'asp', 'asp:inverse', 'ssp:<s>', "
        "'ssp:<s>:inverse', 'quorum:<k>' or 'quorum:<k>:fold'"
    )

