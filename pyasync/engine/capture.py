"""Gradient capture: post-accumulate-grad hooks count ready parameters per bucket; the last one hands the
bucket to the push thread at once, so packing, compression and the push overlap the rest of backward.

``step()`` flushes the buckets no hook handed over (parameters without a gradient count as zeros, with
a has-grad mask). Several backward passes per step need ``opt.no_sync()``: a gradient that arrives for
a bucket already handed over is reported by the next ``step()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from pyasync.engine.shards import BucketLayout

__all__ = ["Capture"]


class Capture:
    """The hooks of one engine. ``hand_over(b)`` is called (with ``cond`` held) when bucket b is ready."""

    def __init__(
        self,
        params: list[torch.Tensor],
        layouts: list[BucketLayout],
        cond: threading.Condition,
        hand_over: Callable[[int], None],
    ) -> None:
        self.layouts = layouts
        self.cond = cond
        self.hand_over = hand_over
        self.slot: dict[int, tuple[int, int]] = {}  # param index -> (bucket, slot)
        for b, lay in enumerate(layouts):
            for slot, p in enumerate(lay.params):
                self.slot[p] = (b, slot)
        self.ready: dict[int, set[int]] = {b: set() for b in range(len(layouts))}
        self.handed: set[int] = set()  # buckets handed over this clock
        self.late_grad: str | None = None
        self.no_sync = False
        self.enabled = True
        self.hooks = [params[i].register_post_accumulate_grad_hook(self._hook(i)) for i in self.slot]

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._grad_ready(i)

        return hook

    def _grad_ready(self, i: int) -> None:
        if self.no_sync or not self.enabled:
            return
        b, slot = self.slot[i]
        with self.cond:
            if b in self.handed:
                self.late_grad = (
                    f"parameter {i} got a gradient after its bucket {b} was already pushed in this "
                    "step (several backward() calls per step?); accumulate inside "
                    "`with opt.no_sync():` and leave the last backward() outside it"
                )
                return
            self.ready[b].add(slot)
            if len(self.ready[b]) == len(self.layouts[b].params):
                self._hand(b)

    def _hand(self, b: int) -> None:
        self.handed.add(b)
        self.hand_over(b)

    def flush(self) -> int:
        """Hand over every bucket not handed over yet (caller holds cond); returns the bucket count."""
        for b in range(len(self.layouts)):
            if b not in self.handed:
                self._hand(b)
        return len(self.layouts)

    def next_clock(self) -> None:
        """The step is over: every bucket may be handed over again (caller holds cond)."""
        self.handed = set()
        for b in self.ready:
            self.ready[b] = set()

    def take_late_grad(self) -> str | None:
        msg, self.late_grad = self.late_grad, None
        return msg

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """``opt.no_sync()``: gradients accumulate, nothing is handed over."""
        prev = self.no_sync
        self.no_sync = True
        try:
            yield
        finally:
            self.no_sync = prev

    def remove(self) -> None:
        self.enabled = False
        for h in self.hooks:
            h.remove()
        self.hooks = []
