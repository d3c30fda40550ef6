"""BSP's clipping of the mean gradient (``max_grad_norm`` under policies that ``clips_mean``).

Every owner's complete round waits (a gated round, engine/core/round.py): its applier reports the squared
norm of the shard's mean gradient to the rank's ClipGate; the training thread, once every owned shard
reported, all-reduces the ranks' sums on the optimizer's own gloo group and releases every round with
``min(1, max_norm / (norm + 1e-6))``, as DDP followed by ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import datetime
import math
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from pyasync.engine.core.clock import wait_until
from pyasync.session.meet import collective_failure

__all__ = ["ClipGate", "MeanClip"]


class ClipGate:
    """Collects, per version, the squared norm of every owned shard's complete aggregate. Applier threads
    report; the training thread takes a complete version (MeanClip.run)."""

    def __init__(self, buckets: list[int], notify: Callable[[], None]) -> None:
        self.buckets = set(buckets)
        self.notify = notify
        self.lock = threading.Lock()
        self.parts: dict[int, dict[int, float]] = {}  # version -> bucket -> squared norm

    def report(self, version: int, bucket: int, sq: float) -> None:
        with self.lock:
            self.parts.setdefault(version, {})[bucket] = sq
        self.notify()

    def complete(self) -> int | None:
        """The oldest version every owned shard reported, or None."""
        with self.lock:
            done = [v for v, p in self.parts.items() if set(p) == self.buckets]
        return min(done) if done else None

    def take(self, version: int) -> float:
        with self.lock:
            return sum(self.parts.pop(version).values())

    def missing(self) -> list[int]:
        """Owned buckets whose oldest open version has not reported (for error messages)."""
        with self.lock:
            v = min(self.parts, default=None)
            return (
                sorted(self.buckets - set(self.parts.get(v, {}))) if v is not None else sorted(self.buckets)
            )


class MeanClip:
    """The training thread's side of the gate: wait for this rank's norms, agree with the others, release."""

    def __init__(
        self,
        gate: ClipGate,
        group,
        transport,
        max_norm: float,
        timeout: datetime.timedelta,
        progress: Callable[[], int],
        release: Callable[[int, float], None],
    ) -> None:
        self.gate, self.group, self.transport = gate, group, transport
        self.max_norm, self.timeout, self.progress, self.release = max_norm, timeout, progress, release

    def ready(self) -> bool:
        return self.gate.complete() is not None

    def wait(self, cond: threading.Condition, error) -> float:
        """Wait (``cond`` held) until every owned shard reported a version; the seconds waited."""
        return wait_until(
            cond,
            self.ready,
            self.timeout,
            lambda: f"every worker's push to complete the rounds of buckets {self.gate.missing()}",
            error,
            progress=self.progress,
        )

    def run(self) -> float:
        """All-reduce the oldest complete version's squared norm, release its rounds; the norm."""
        v = self.gate.complete()
        total = torch.tensor([self.gate.take(v)], dtype=torch.float64)
        try:
            dist.all_reduce(total, group=self.group)
        except Exception as e:
            raise collective_failure(e, self.transport, "the gradient norm's all-reduce") from e
        norm = math.sqrt(float(total))
        coef = min(1.0, self.max_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        self.release(v, coef)
        return norm
