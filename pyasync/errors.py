"""pyasync's exception types, in one place (those users catch are re-exported by ``pyasync``)."""

from __future__ import annotations

__all__ = [
    "DivergedError",
    "EngineError",
    "NonFiniteGradientError",
    "PeerFailure",
    "ProtocolError",
    "WireError",
]


class EngineError(RuntimeError):
    """A background thread of the engine failed; the message names the thread and the cause."""


class WireError(ValueError):
    """A message that does not fit the protocol (corrupt, or a peer running something else)."""


class ProtocolError(WireError):
    """A well-formed message that arrives out of turn (a push after CLOSE, a clock out of order, ...)."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN/Inf under ``on_nonfinite="raise"``. The push was skipped by its owners (never
    applied) and the step completed, so training may go on after handling it."""


class DivergedError(NonFiniteGradientError):
    """Training diverged: this rank's gradients held NaN/Inf at every one of the last
    ``DIVERGED_STEPS`` steps (pyasync/engine/core/failures.py), under either ``on_nonfinite`` setting. None of
    those pushes was applied, so the parameters are the last finite ones; the message names the policy
    and what to change. Raised again at every later step whose gradients are still non-finite."""


class PeerFailure(RuntimeError):
    """Another rank of the job failed: it died (its connections closed without a goodbye), or it stopped
    answering. ``ranks``: the ranks in the group of the optimizer that failed, as far as this rank can
    tell (empty when unknown). Every surviving rank gets this exception, naming the same rank(s), from
    the call that first needs the dead rank (``step()``, ``close()``, ``barrier()``, a checkpoint)."""

    def __init__(self, message: str, ranks: tuple[int, ...] | list[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(sorted(set(ranks)))
