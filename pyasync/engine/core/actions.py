"""The actions a shard's round (engine/core/round.py) returns for its owner to carry out, in order, and the
counters of what happened to the shard's pushes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Action", "Answer", "Apply", "Counters", "Gate", "Release", "Sum", "Update"]


# -- actions -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Apply:
    """Apply push ``item`` on its own as one update (gradient x 1/n, learning rate x ``lr_factor``);
    ``implicit``: the momentum the asynchrony adds (Note [Momentum correction] in pyasync/policy.py),
    taken off the optimizer's explicit momentum (0: none)."""

    item: Any
    lr_factor: float = 1.0
    implicit: float = 0.0
    per_round: bool = False  # moments advance per round of n pushes (Note [Moments per round])
    dc: float = 0.0  # the delay compensation's lambda (Note [Delay compensation]); 0: none
    clip: float | str = 0.0  # x the shard's running norm (Note [Spike clipping]); 0: none; or "auto"
    gap: bool = False  # the gap-aware penalty (Note [Gap-aware penalty] in pyasync/policy.py)


@dataclass(frozen=True)
class Sum:
    """Decode push ``item`` into the aggregate (x 1/divisor)."""

    item: Any


@dataclass(frozen=True)
class Update:
    """Apply ``scale`` x the aggregate as one update on the segments whose ``mask`` entry is True; then
    zero it."""

    mask: tuple[bool, ...]
    scale: float = 1.0


@dataclass(frozen=True)
class Gate:
    """The aggregate of ``version`` is complete and waits for ``release(scale)``."""

    version: int


@dataclass(frozen=True)
class Release:
    """Push ``item`` is not (or no longer) needed: give its buffer back."""

    item: Any


@dataclass(frozen=True)
class Answer:
    """Send the current values to each (worker, clock answered); ``final``: after every worker closed.
    ``ahead``: per dest, the updates to look ahead by (Note [Look-ahead replies] in pyasync/policy.py);
    empty: none."""

    dests: tuple[tuple[int, int], ...]
    final: bool = False
    ahead: tuple[int, ...] = ()


Action = Apply | Sum | Update | Gate | Release | Answer


@dataclass
class Counters:
    """What happened to the pushes of one shard (the owner's part of Stats)."""

    applied: int = 0  # pushes applied (alone or in an aggregate)
    dropped: int = 0  # late pushes dropped by policy (Quorum late="drop")
    nonfinite: int = 0  # pushes holding NaN/Inf: never applied
    updates: int = 0  # optimizer updates of the shard (= version)
    staleness: dict[int, int] = field(default_factory=dict)  # staleness -> applied pushes

    def stale(self, s: int, count: int = 1) -> None:
        self.staleness[s] = self.staleness.get(s, 0) + count
