"""BSP on collectives: every step is a reduce (an all-to-all of gradient chunks or of encoded pushes),
the fused update of the shard this rank owns, and an all-gather of the new shard values. No engine thread, no
point-to-point message: the training thread runs the step's collectives on the optimizer's own gloo
group (the same code would run on an NCCL group), pipelined across buckets.

Note [BSP on collectives]
    Under BSP every worker's push of clock t is needed before any owner may apply, and every worker waits
    for every owner's update: that is a reduce-scatter followed by an all-gather, which the collective
    libraries do with no round trip per message and no thread hand-off. Per bucket b:

    * uncompressed: each rank lays its gradient x 1/n out as one chunk per shard, each chunk followed by
      a few extra elements: one has-grad flag per parameter segment of that shard, a non-finite flag,
      and the rank's clock. ``all_to_all`` hands rank r every rank's chunk r, and rank r sums them in
      rank order (Note [Reduce by all-to-all]: on gloo it costs less than ``reduce_scatter``): the mean
      gradient, how many ranks had a gradient for each segment (the mask of the update), how many
      pushes were not finite (counted as zeros in the mean, as the point-to-point BSP does) and n x the
      clock (a rank on another step is an error, not a silent mix);
    * compressed: each rank encodes slice r into a wire push frame (engine/wire) with error feedback,
      as the point-to-point engine does, and ``all_to_all`` hands every owner the n frames of its
      shard; the owner validates each header, decodes and sums them in rank order (x 1/n; the sum
      does not depend on arrival order, Note [Rank-order sum]);
    * the owner applies the mean with the fused kernel (engine/core/rule.py) on its shard, clipped first
      under ``max_grad_norm`` (one all-reduce of the ranks' squared norms: the mean gradient's norm,
      as DDP + ``clip_grad_norm_``);
    * an all-gather of the new shard values (each padded to the largest shard; on gloo point-to-point
      sends of the shard to every rank, engine/collective/gather.py) installs them on every rank, so
      replicas are equal after every step.

    Each bucket's reduce is launched from the backward hooks, as DDP's all-reduce is, and what the
    caller leaves in ``.grad`` when ``step()`` is called is still what is reduced: a bucket edited after
    its hook on any rank is reduced again by every rank (Note [Reduces launched from backward] in
    engine/collective/overlap.py).

    The engine is built from objects that receive what they use: its Failures (engine/core/failures.py),
    the step's collectives on the optimizer's group (StepGroup, group.py), the shards it owns
    (OwnedShards, owned.py), the reduce (Reducer, overlap.py, over each bucket's BucketReduce,
    reduce.py) and the gather (Gatherer, gather.py).

Note [Joining]
    The contract of close() holds under BSP too: a rank may stop early, and its close() returns once
    every rank closed, its shards served until then. Every chunk of the reduce carries an "active" flag
    (and the clock x active): a closed rank joins each step the others still take with zeros, no
    has-grad and active 0 (compressed: a FINAL push frame of zeros, encoded without its residuals), and
    keeps applying and gathering its shards. The mean still divides by n (a closed worker counts as
    zeros, as in the point-to-point BSP), and only the stepping ranks' pushes are counted. Every rank
    puts the count of stepping ranks its shards saw at the end of its gather slot, so every rank learns
    it; the first step in which it is 0 (every rank in close()) ends the joining. Like DDP's Join, with
    no extra collective per step.
"""

from __future__ import annotations

import datetime
import math
import threading
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from pyasync.engine import wire
from pyasync.engine.collective.gather import Gatherer
from pyasync.engine.collective.group import StepGroup
from pyasync.engine.collective.overlap import Reducer
from pyasync.engine.collective.owned import OwnedShards
from pyasync.engine.collective.reduce import BucketReduce
from pyasync.engine.core.access import ShardAccess, initial_masters
from pyasync.engine.core.capture import Capture, check_grads
from pyasync.engine.core.failures import Failures
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import BucketLayout
from pyasync.engine.core.stats import Stats

__all__ = ["CollectiveEngine"]


class CollectiveEngine:
    """BSP for one rank over collectives (Note [BSP on collectives]); the EngineProtocol of
    engine/core/protocol.py."""

    def __init__(
        self,
        *,
        params: list[torch.Tensor],
        layouts: list[BucketLayout],
        policy,
        compressor,
        rule: UpdateRule,
        transport,
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        spec: wire.WireSpec,
        names: list[str],
        on_nonfinite: str = "skip",
        max_grad_norm: float | None = None,
        control=None,
        grad_edits: str = "detect",
    ) -> None:
        self.params, self.layouts, self.policy, self.rule = params, layouts, policy, rule
        self.spec, self.names = spec, names
        self.rank, self.n, self.timeout = rank, world_size, timeout
        self.transport = transport
        self.on_nonfinite, self.max_grad_norm = on_nonfinite, max_grad_norm
        self.lost: set[int] = set()  # no rank leaves BSP on collectives: it fails instead
        self.drained = False  # no epoch change here (elastic needs the point-to-point engine)
        self.cond = threading.Condition()
        self.failures = Failures(
            cond=self.cond, rank=rank, names=names, layouts=layouts, policy=policy, closed=lambda: self.closed
        )
        self.clock = 0
        self.closed = False
        self.grad_norm: float | None = None
        self.wait_seconds = 0.0
        self.st = Stats()
        self.group = StepGroup(
            control=control,
            transport=transport,
            timeout=timeout,
            clock=lambda: self.clock,
            record=self.failures.record,
        )
        self.owned = OwnedShards(rule, layouts, initial_masters(params, layouts, rank), rank, world_size)
        self.shards = ShardAccess(
            self.owned, rule, layouts, params, rank, timeout, self.failures.require_open
        )
        self.capture = Capture(params, layouts, self.cond, self._hand_over)
        self.reducer = self._make_reducer(compressor, grad_edits)
        self.gatherer = Gatherer(
            params=params,
            layouts=layouts,
            owned=self.owned,
            rank=rank,
            world_size=world_size,
            spec=spec,
            compressor=compressor,
            st=self.st,
            group=self.group,
            frames=self.reducer.buckets.frames,
        )
        # A load gave the parameters new values: the replica's too.
        self.shards.written = self.gatherer.touched
        if self.gatherer.compress_replies:  # Note [Checkpoints and held values] in pyasync/checkpoint/save.py
            self.shards.held_rows = self.gatherer.held_rows

    def _make_reducer(self, compressor, grad_edits: str) -> Reducer:
        """The step's reduce (overlap.py) over each bucket's (reduce.py)."""
        buckets = BucketReduce(
            params=self.params,
            layouts=self.layouts,
            spec=self.spec,
            compressor=compressor,
            rank=self.rank,
            world_size=self.n,
            st=self.st,
            group=self.group,
            record=self.failures.record,
            on_nonfinite=self.failures.on_nonfinite,
            version=self.owned.version,
        )
        return Reducer(
            buckets=buckets,
            capture=self.capture,
            layouts=self.layouts,
            names=self.names,
            world_size=self.n,
            device=self.params[0].device,
            grad_edits=grad_edits,
            st=self.st,
            group=self.group,
            record=self.failures.record,
        )

    @property
    def control(self):
        """The optimizer's own gloo group the step's collectives run on (None: one rank, or dropped)."""
        return self.group.control

    @control.setter
    def control(self, group) -> None:
        self.group.control = group  # the optimizer drops it after close(): no reference may keep it alive

    # -- errors (kept by self.failures) --------------------------------------------------------------
    def check(self) -> None:
        """Raise the recorded failure, if any (see clock.as_raised)."""
        self.failures.check()

    def record_failure(self, e: BaseException) -> None:
        """A call failed mid-step (or a caller's collective failed): later calls keep failing with it."""
        self.failures.record(e)


    def abort_reason(self, reason: str | None) -> str | None:
        """What a rank that stops tells its peers (Failures.abort_reason)."""
        return self.failures.abort_reason(reason)

    def _hand_over(self, b: int) -> None:
        """Capture's hook: bucket b's gradients are all in (in backward, cond held); the reducer may
        launch its reduce now (Note [Reduces launched from backward] in overlap.py)."""
        if self.closed or self.failures.error is not None:
            return
        self.reducer.hand_over(b, self.clock)

    # -- step ---------------------------------------------------------------------------------------
    def step(self, grad_scale: float | None = None, found_inf: bool = False) -> None:
        """Reduce, apply and gather every bucket of this step (Note [BSP on collectives])."""
        if self.closed:
            raise RuntimeError("step() called after close(); create a new DistributedOptimizer")
        self.check()
        check_grads(self.params, self.names)
        t = self.clock
        self._run(1.0 if grad_scale is None else 1.0 / float(grad_scale), found_inf, active=True)
        with self.cond:
            self.capture.next_clock()
        self.clock = t + 1
        self.st.pushes_sent += sum(1 for lay in self.layouts for sh in lay.shards if sh.numel)
        with self.cond:
            bad = self.failures.take_nonfinite(t)
        self.failures.raise_nonfinite(bad, self.on_nonfinite)

    def finish(self) -> None:
        """Nothing: a step of this engine that times out is final (it raised), none stays in flight."""
        self.check()

    def _run(self, scale: float, skip: bool, active: bool) -> int:
        """One step's collectives: reduce, clip, apply the owned shards, gather. ``active`` False: this
        rank closed and joins the others' step with nothing to push (Note [Joining]). Returns how many
        ranks pushed in this step (every rank learns it from the gather)."""
        t = self.clock
        self.group.begin_round()  # the same sequence on every rank, stepping or joining (roll-call tags)
        means = self.reducer.reduce(scale, skip, t, active)
        if self.max_grad_norm is not None:
            self._clip(means)
        for b, (values, mask, applied) in means.items():
            if self.owned.apply(b, values, mask, applied, t):
                self.st.updates_applied += 1
        if self.gatherer.compress_replies:
            return self.gatherer.deltas(t, self.reducer.buckets.seen_active)
        return self._gather(t)

    def _gather(self, t: int) -> int:
        """The uncompressed gather of step ``t``'s new values (Gatherer.values); how many ranks pushed."""
        return self.gatherer.values(t, self.reducer.buckets.seen_active)

    def _clip(self, means: dict[int, tuple]) -> None:
        """Clip the mean gradient to max_grad_norm: one all-reduce of the ranks' squared norms."""
        sq = sum(float(torch.dot(v, v)) for v, _, _ in means.values())
        total = torch.tensor([sq], dtype=torch.float64)
        if self.n > 1:
            self.group.run("the gradient norm's all-reduce", dist.all_reduce, total)
        norm = math.sqrt(float(total))
        self.grad_norm = norm
        coef = min(1.0, self.max_grad_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        if coef < 1.0:
            for v, _, _ in means.values():
                v.mul_(coef)

    # -- the rest of the engine's narrow API ------------------------------------------------------------
    def no_sync(self) -> AbstractContextManager[None]:
        """Context: gradients accumulate over several backward() calls (nothing is read before step())."""
        return self.capture.paused()

    def pause(self) -> None:
        """Nothing to do: no round of this engine can be open between steps."""
        self.failures.require_open("pause()")

    def resume(self) -> None:
        return None

    def drain(self, want: list[int]) -> None:
        """Nothing to wait for: every step's update is applied before step() returns. With compressed
        replies the replica is left as it is: a checkpoint saves it (Note [Checkpoints and held values]
        in pyasync/checkpoint/save.py), so saving does not change the run."""
        self.check()

    @property
    def in_flight(self) -> None:
        return None

    def installed_versions(self) -> dict[tuple[int, int], int]:
        """{(bucket, owner rank): version} of the values installed: this rank's own shards'."""
        return {(b, self.rank): v for b, v in self.owned.versions().items()}

    def threads(self) -> list[threading.Thread]:
        """None: the training thread runs every collective."""
        return []

    def close(self) -> None:
        """Every rank leaves together (a bounded barrier on the optimizer's group); replicas are already
        equal after every step. After a failure: raise it unless a call already did."""
        if self.closed:
            return
        self.closed = True
        self.capture.remove()
        try:
            if self.failures.error is not None:
                if not self.failures.reported:
                    self.check()
                return
            if self.n > 1:
                while self._run(1.0, False, active=False) > 0:
                    pass  # serve the ranks still stepping until every rank closed (Note [Joining])
            if self.gatherer.compress_replies:
                self._gather(self.clock)  # end on the exact masters (Note [Compressed replies])
            if self.n > 1:
                self.group.run(
                    "close()'s barrier", dist.monitored_barrier, timeout=self.timeout, wait_all_ranks=True
                )
        finally:
            if self.failures.error is not None:
                self.abort()
            elif self.transport is not None:
                self.transport.close()

    def abort(self, reason: str | None = None) -> None:
        """Stop (after a failure or without close()); the peers are told ``reason`` or this rank's failure."""
        self.closed = True
        self.capture.remove()
        if self.transport is not None:
            self.transport.abort(self.abort_reason(reason), getattr(self.failures.error, "ranks", None))

    def stats(self) -> Stats:
        st = Stats(**{k: v for k, v in vars(self.st).items() if k != "staleness"})
        st.staleness = dict(self.st.staleness)
        st.clock = self.clock
        st.min_included_clock = self.clock - 1
        st.grad_norm = self.grad_norm
        raw = self.reducer.buckets.raw_bytes + self.gatherer.raw_bytes
        enc = self.reducer.buckets.enc_bytes + self.gatherer.enc_bytes
        st.compression_ratio = raw / enc if enc else 1.0
        return st
