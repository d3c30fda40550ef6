"""The engine's exception types, in one place (re-exported by pyasync where users catch them)."""

from __future__ import annotations

__all__ = ["EngineError", "NonFiniteGradientError", "ProtocolError", "WireError"]


class EngineError(RuntimeError):
    """A background thread of the engine failed; the message names the thread and the cause."""


class WireError(ValueError):
    """A message that does not fit the protocol (corrupt, or a peer running something else)."""


class ProtocolError(WireError):
    """A well-formed message that arrives out of turn (a push after CLOSE, a clock out of order, ...)."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN/Inf under ``on_nonfinite="raise"``. The push was skipped by its owners (never
    applied) and the step completed, so training may go on after handling it."""
