"""What both engines (p2p/engine.py, collective/engine.py) do alike with failures and non-finite pushes,
as one object each engine owns (``Failures``): one error slot (the first failure wins; every later call
raises it), the reason a rank that stops tells its peers, and non-finite gradients (logged once per
rank, raised by step() under on_nonfinite="raise")."""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable

from pyasync.engine.core.clock import as_raised
from pyasync.engine.core.shards import BucketLayout
from pyasync.errors import DivergedError, NonFiniteGradientError

__all__ = ["DIVERGED_STEPS", "Failures"]

#: Steps in a row with a non-finite push after which step() raises DivergedError (Note [Saying so when
#: a run diverges]).
DIVERGED_STEPS = 20

_log = logging.getLogger("pyasync")


class Failures:
    """The error slot and the non-finite pushes of one engine: each engine owns one, and hands its parts
    the calls they need (``record``, ``fail``, ``on_nonfinite``, ``err``). It receives what it uses: the
    engine's condition (held while the slot changes, and notified so every waiter wakes), this rank, the
    parameter names and bucket layouts (to name a bad bucket's parameters), the policy (the advice of
    DivergedError) and ``closed``, which tells whether the engine was closed (``require_open``)."""

    def __init__(
        self,
        *,
        cond: threading.Condition,
        rank: int,
        names: list[str],
        layouts: list[BucketLayout],
        policy,
        closed: Callable[[], bool],
    ) -> None:
        self.cond, self.rank, self.names, self.layouts, self.policy = cond, rank, names, layouts, policy
        self.closed = closed
        self.error: BaseException | None = None  # the first failure (every later call raises it)
        self.error_trace: str | None = None  # the traceback of a background failure (``fail``)
        self.reported = False  # the recorded failure was raised to the caller at least once
        self.timed_out: TimeoutError | None = None  # the first timeout of a step still in flight
        self.nonfinite: list[tuple[int, int]] = []  # (bucket, clock) of non-finite pushes not yet raised
        self.nonfinite_logged = False
        self.nonfinite_streak = 0  # steps in a row with a non-finite push of this rank

    # -- the error slot ---------------------------------------------------------------------------------
    def err(self) -> BaseException | None:
        """The recorded failure, if any (what the engine's bounded waits poll)."""
        return self.error

    def check(self) -> None:
        """Raise the recorded failure, if any (see clock.as_raised)."""
        if self.error is not None:
            self.reported = True
            raise as_raised(self.error)

    def record(self, e: BaseException) -> None:
        """A call failed while the engine was mid-step: later calls keep failing with this cause."""
        with self.cond:
            if self.error is None:
                self.error = e
            self.reported = True
            self.cond.notify_all()

    def fail(self, where: str, e: BaseException) -> None:
        """Record a background failure (first one wins; ``where`` names the thread) and wake every waiter."""
        with self.cond:
            if self.error is None:
                self.error = e
                e.args = (f"{where}: {e}",) if not e.args else (f"{where}: {e.args[0]}", *e.args[1:])
                self.error_trace = traceback.format_exc()
            self.cond.notify_all()

    def require_open(self, what: str) -> None:
        """Raise when the engine is closed (``what`` names the call) or has failed."""
        if self.closed():
            raise RuntimeError(f"{what} after close(): call it before close()")
        self.check()

    def abort_reason(self, reason: str | None) -> str | None:
        """What a rank that stops tells its peers: ``reason``, else its failure (the first timeout of the
        step in flight first), so a rank that gives up is not mistaken for the first failure."""
        if reason is None and self.error is not None:
            reason = f"{type(self.error).__name__}: {self.error}"
            if self.timed_out is not None and self.timed_out is not self.error:
                reason = f"TimeoutError: {self.timed_out}; then {reason}"
        return reason

    # -- non-finite pushes ------------------------------------------------------------------------------
    def nonfinite_text(self, b: int, clock: int) -> str:
        """Bucket ``b``'s non-finite push of step ``clock``, in words (its parameters named)."""
        names = [self.names[p] for p in self.layouts[b].params]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        return (
            f"non-finite gradient (NaN or Inf) in bucket {b} at step {clock} on rank {self.rank} "
            f"(parameters: {shown})"
        )

    def on_nonfinite(self, b: int, clock: int) -> None:
        """A shard of bucket b held NaN/Inf: the owners skip that push. Logged once per rank; under
        on_nonfinite="raise", step() raises it (``raise_nonfinite``)."""
        with self.cond:
            if (b, clock) in self.nonfinite:
                return
            self.nonfinite.append((b, clock))
            first = not self.nonfinite_logged
            self.nonfinite_logged = True
        if first:
            _log.warning(
                "pyasync: %s; the push is skipped, not applied (counted in stats().nonfinite_skipped; "
                "logged once per rank)",
                self.nonfinite_text(b, clock),
            )

    def take_nonfinite(self, t: int) -> list[tuple[int, int]]:
        """The non-finite pushes of step ``t`` (caller holds cond); forgets every recorded one."""
        bad = [(b, c) for b, c in self.nonfinite if c == t]
        self.nonfinite = []
        return bad

    def raise_nonfinite(self, bad: list[tuple[int, int]], on_nonfinite: str) -> None:
        """Raise what step ``bad``'s non-finite pushes call for (after the step completed).

        Note [Saying so when a run diverges]
            A skipped push loses one step, which a GradScaler's first steps or a rare bad batch make
            harmless. A run whose gradients stay non-finite step after step has diverged (its loss blew
            up, or a parameter is already inf): skipping would go on silently while the model learns
            nothing. So after DIVERGED_STEPS such steps in a row step() raises DivergedError, under
            "skip" too, naming the policy and the settings that bring a diverging asynchronous run back
            (docs/benchmarks.md, "Why asynchrony hurt")."""
        self.nonfinite_streak = self.nonfinite_streak + 1 if bad else 0
        if self.nonfinite_streak >= DIVERGED_STEPS:
            raise DivergedError(
                f"pyasync: training diverged on rank {self.rank}: its gradients held NaN or Inf at each of "
                f"the last {self.nonfinite_streak} steps (none of them was applied: the parameters are the "
                f"last finite ones). {_advice(self.policy)}"
            )
        if bad and on_nonfinite == "raise":
            raise NonFiniteGradientError(
                "pyasync: "
                + "; ".join(self.nonfinite_text(b, c) for b, c in bad)
                + "; the push was skipped (not applied) and the step completed. Fix the loss or lower the "
                "learning rate, or pass on_nonfinite='skip' to skip such pushes silently"
            )


def _advice(policy) -> str:
    """What to change when a run under ``policy`` diverged."""
    spec = policy.spec()
    text = f"Policy {spec!r}: lower the learning rate, or clip gradients (max_grad_norm=...)"
    if getattr(policy, "max_unanswered", 0) != 0:
        text += "; bound the pushes a worker leaves unanswered ('asp:unanswered=0')"
    if hasattr(policy, "lr_scale") and policy.lr_scale is None:
        text += "; shrink the steps of stale pushes ('asp:delay', 'ssp:<s>:delay')"
    if spec.startswith("ssp") or spec.startswith("asp"):
        text += "; or bound staleness harder (a smaller SSP bound, or BSP)"
    return text
