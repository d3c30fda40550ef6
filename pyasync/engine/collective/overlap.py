"""BSP on collectives, with each bucket's reduce launched from the backward hooks (Note [Reduces launched
from backward]): the step's reduce, from hook to the rank-order sums (each bucket's own reduce is
engine/collective/reduce.py's BucketReduce)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from pyasync.engine.collective.group import StepGroup
from pyasync.engine.collective.reduce import BucketReduce, Launch
from pyasync.engine.core.capture import Capture, forbid_error
from pyasync.engine.core.shards import BucketLayout
from pyasync.engine.core.stats import Stats

__all__ = ["Reducer"]

#: Rounds without hook launches after a step that had to reduce a bucket again (an edit after
#: backward, a GradScaler, a second backward): every rank counts the same rounds.
_BACKOFF = 50


class Reducer:
    """The reduce of a step: the buckets launched from the hooks (``hand_over``), then ``reduce`` in
    step(). Receives each bucket's reduce (``buckets``), the engine's Capture (which buckets changed
    since their hook), the layouts and parameter names, the world size and the parameters' device, the
    ``grad_edits`` setting, the engine's counters, its collectives and ``record`` (its Failures').

    Note [Reduces launched from backward]
        As DDP's all-reduce, a bucket's reduce (Note [Reduce by all-to-all]) starts inside
        ``backward()``: when the hook of a bucket's last gradient fires (engine/core/capture.py), the bucket
        is flattened (or encoded) into its send buffer and its all-to-all is launched asynchronously;
        ``step()`` launches the buckets no hook handed over, then waits for them all. Launches go in
        bucket order on every rank (a bucket that is ready before a lower one waits for it), so the
        ranks issue the same sequence of collectives whatever order their hooks fire in.

        What is reduced must still be what ``.grad`` holds when ``step()`` is called (Note [What step()
        pushes]). An edit after the hook (``mul_``, ``clip_grad_norm_``, a second ``backward()``) bumps
        a version counter that ``step()`` checks, but one rank's edit must change every rank's
        sequence of collectives, so the ranks first agree: one all-reduce (MAX) of a flag per bucket,
        set where this rank's early reduce no longer holds (the bucket changed, or the step divides out
        a GradScaler's scale or skips a non-finite step, which the hooks cannot know). Every rank then
        waits out the flagged buckets' reduces and launches them again from ``.grad`` (compressed:
        after ``Compressor.undo`` takes the early encode's residual back). So an edit is never raced,
        only seen, and every rank reduces the same buckets again. The price is that tiny all-reduce per
        step. A model whose gradients are edited every step would pay twice for each reduce; after a
        step that reduced anything again, the hooks launch nothing for ``_BACKOFF`` rounds (counted by
        every rank alike, so they agree without a message) and ``step()`` reduces what ``.grad``
        holds, with no flags, as before. ``grad_edits="forbid"`` skips the flags: an edit makes
        ``step()`` raise (the step is lost), as under the point-to-point engine.

        On one rank nothing is launched early (there is nothing to overlap), nor for parameters off the
        CPU: the engine's gloo group reduces host buffers, and a flatten inside a hook would wait for
        the device there; the reduce of device parameters launches in ``step()`` until it is measured
        on a GPU.
    """

    def __init__(
        self,
        *,
        buckets: BucketReduce,
        capture: Capture,
        layouts: list[BucketLayout],
        names: list[str],
        world_size: int,
        device: torch.device,
        grad_edits: str,
        st: Stats,
        group: StepGroup,
        record: Callable[[BaseException], None],
    ) -> None:
        self.buckets, self.capture, self.layouts, self.names = buckets, capture, layouts, names
        self.n, self.device, self.grad_edits = world_size, device, grad_edits
        self.st, self.group, self.record = st, group, record
        self.early: dict[int, Launch] = {}  # buckets launched from hooks this step: 0, 1, ..., k-1
        self.early_ready: set[int] = set()  # handed over by the hooks, not launched yet
        self.early_off = 0  # rounds left without hook launches (_BACKOFF)
        self.st.buckets_early = 0

    def _may_launch_early(self) -> bool:
        return self.n > 1 and self.device.type == "cpu" and self.early_off == 0

    def hand_over(self, b: int, clock: int) -> None:
        """Capture's hook, through the open engine: bucket b's gradients of step ``clock`` are all in
        (called in backward, cond held). Launch every ready bucket in bucket order."""
        if not self._may_launch_early():
            return
        self.early_ready.add(b)
        while len(self.early) in self.early_ready:  # the next bucket in bucket order is ready
            nb = len(self.early)
            try:
                self.early[nb] = self.buckets.launch(nb, 1.0, False, clock, True)
            except Exception as e:  # not raised inside backward(): step() raises it
                self.record(e)
                return
            self.st.buckets_early += 1

    def reduce(self, scale: float, skip: bool, t: int, active: bool) -> dict[int, tuple]:
        """Per bucket this rank owns: (mean gradient of its shard, has-grad mask, finite pushes)."""
        self.buckets.seen_active = -1
        armed = self._may_launch_early()  # as it was for this step's hooks: early_off changes only here
        launches, early = dict(self.early), set(self.early)
        self.early, self.early_ready = {}, set()
        for b in range(len(self.layouts)):
            if b not in launches:
                launches[b] = self.buckets.launch(b, scale, skip, t, active)
        if armed:
            again = self._agree_again(early, scale, skip)
            for b in again:
                self.buckets.wait(launches[b])
                if active:
                    self.buckets.undo(b)
                launches[b] = self.buckets.launch(b, scale, skip, t, active)
            self.st.buckets_reencoded += len(again)
            self.early_off = _BACKOFF if again else 0
        else:
            self.early_off = max(0, self.early_off - 1)
        means = {}
        for b in range(len(self.layouts)):
            m = self.buckets.finish(launches[b], t, active)
            if m is not None:
                means[b] = m
        return means

    def _agree_again(self, early: set[int], scale: float, skip: bool) -> list[int]:
        """The buckets every rank reduces again: those whose early reduce no longer holds on some rank."""
        changed = set(self.capture.changed()) & early
        stale = sorted(early) if scale != 1.0 or skip else sorted(changed)
        if self.grad_edits == "forbid":
            if stale:
                err = forbid_error(self.names, self.layouts, stale, "reduced them")
                self.record(err)
                raise err
            return []
        flags = torch.zeros(len(self.layouts), dtype=torch.int32)
        for b in stale:
            flags[b] = 1
        self.group.run("the edit flags' all-reduce", dist.all_reduce, flags, op=dist.ReduceOp.MAX)
        return [b for b, f in enumerate(flags.tolist()) if f]
