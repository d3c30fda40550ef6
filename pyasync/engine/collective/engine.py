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
    * the owner applies the mean with the fused kernel (engine/rule.py) on its shard, clipped first
      under ``max_grad_norm`` (one all-reduce of the ranks' squared norms: the mean gradient's norm,
      as DDP + ``clip_grad_norm_``);
    * an all-gather of the new shard values (each padded to the largest shard; on gloo point-to-point
      sends of the shard to every rank, engine/gather.py) installs them on every rank, so replicas are
      equal after every step.

    Each bucket's reduce is launched from the backward hooks, as DDP's all-reduce is, and what the
    caller leaves in ``.grad`` when ``step()`` is called is still what is reduced: a bucket edited after
    its hook on any rank is reduced again by every rank (Note [Reduces launched from backward] in
    engine/overlap.py).

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
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pyasync.engine import wire
from pyasync.engine.collective.gather import StepGather
from pyasync.engine.collective.overlap import StepOverlap
from pyasync.engine.core.access import ShardAccess, initial_masters
from pyasync.engine.core.capture import Capture, check_grads
from pyasync.engine.core.failures import EngineBase
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import BucketLayout
from pyasync.engine.core.stats import Stats
from pyasync.errors import PeerFailure
from pyasync.session.meet import collective_failure, roll_call

__all__ = ["CollectiveEngine"]

# torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_ROLL_CALL = datetime.timedelta(seconds=5)  # how long survivors wait for each other to name the absent


@dataclass
class _Book:
    """Versions and clocks of one owned shard (what checkpoints record)."""

    version: int
    processed: list[int]


@dataclass
class _Owned:
    round: _Book
    state: object  # rule.ShardState


class _Here:
    """Runs ShardAccess's calls in the calling thread: there is no applier thread to hand them to."""

    def __init__(self, shards: dict[int, _Owned]) -> None:
        self.shards = shards

    def call(self, fn, timeout) -> list:
        return [fn(self)]

    def loaded(self, bucket: int) -> None:
        """Nothing to forget: the replica takes the values the load installs (CollectiveEngine._touched)."""


#: What a survivor of a dead rank can do under BSP on collectives (it cannot go on without it).
_RESUME = (
    "BSP on collectives cannot go on without a rank: resume from the last checkpoint "
    "(pyasync.load_checkpoint), or train with elastic=True under bsp:p2p, SSP, ASP or Quorum"
)


class CollectiveEngine(StepOverlap, StepGather, EngineBase):
    """BSP for one rank over collectives (Note [BSP on collectives]); the Engine's narrow API."""

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
        self.comp, self.spec, self.names = compressor, spec, names
        self.rank, self.n, self.timeout = rank, world_size, timeout
        self.transport, self.control = transport, control
        self.on_nonfinite, self.max_grad_norm, self.grad_edits = on_nonfinite, max_grad_norm, grad_edits
        self.device = params[0].device
        self.codec = compressor.wire_params(1)[0]
        self.cond = threading.Condition()
        self.init_failures()
        self.rounds = 0  # step collectives run (steps and joins)
        self.seen_active = -1  # ranks that pushed in the last step, as this rank's shards saw it
        self.clock = 0
        self.closed = False
        self.grad_norm: float | None = None
        self.wait_seconds = 0.0
        self.st = Stats()
        self.raw_bytes = 0  # fp32 bytes of the slices encoded (compressed pushes)
        self.enc_bytes = 0  # their encoded bytes
        masters = initial_masters(params, layouts, rank)
        self.owned = {
            b: _Owned(_Book(0, [0] * world_size), rule.new_state(layouts[b].shards[rank], masters[b]))
            for b in masters
        }
        self.shards = ShardAccess(_Here(self.owned), rule, layouts, params, rank, timeout, self._require_open)
        self.capture = Capture(params, layouts, self.cond, self._hand_over)
        self._plan()
        self._init_overlap()
        self._init_replies()
        self.shards.written = self._touched  # a load gave the parameters new values: the replica's too
        if self.compress_replies:  # Note [Checkpoints and held values] in pyasync/checkpoint/save.py
            self.shards.held_rows = self._held_rows

    # -- errors -------------------------------------------------------------------------------------
    def _collective(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, group=self.control, **kwargs)
        except Exception as e:
            raise self._failure(what, e) from e

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except Exception as e:
            raise self._failure(what, e) from e

    def _failure(self, what: str, e: BaseException) -> BaseException:
        """A collective of this step failed: a PeerFailure naming the ranks that died (seen by the
        transport) or that did not come (a roll call through the store), kept for every later call."""
        # A dead rank's connections end at once (its kernel closes them): a short look suffices
        # before the roll call, which then names ranks that hang.
        err = collective_failure(e, self.transport, f"{what} of step {self.clock}", wait=1.0)
        if not isinstance(err, PeerFailure):
            missing = roll_call(self.control, f"round{self.rounds}", min(self.timeout, _ROLL_CALL))
            if missing:
                err = PeerFailure(
                    f"pyasync: ranks {missing} did not reach step {self.clock} ({what}) within "
                    f"{self.timeout.total_seconds():g} s: late, hung or dead (under BSP every rank steps "
                    "together; a rank that stops early must call close())",
                    missing,
                )
            else:
                err = RuntimeError(f"pyasync: {what} of step {self.clock} failed: {e}")
        if isinstance(err, PeerFailure) and _RESUME not in str(err):
            err.args = (f"{err.args[0]}; {_RESUME}", *err.args[1:])
        self._sticky(err)
        return err

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
            bad = self._take_nonfinite(t)
        self._raise_nonfinite(bad, self.on_nonfinite)

    def _run(self, scale: float, skip: bool, active: bool) -> int:
        """One step's collectives: reduce, clip, apply the owned shards, gather. ``active`` False: this
        rank closed and joins the others' step with nothing to push (Note [Joining]). Returns how many
        ranks pushed in this step (every rank learns it from the gather)."""
        t = self.clock
        self.seen_active = -1
        self.rounds += 1  # the same sequence on every rank, stepping or joining (roll-call tags)
        means = self._reduce(scale, skip, t, active)
        if self.max_grad_norm is not None:
            self._clip(means)
        for b, (values, mask, applied) in means.items():
            own = self.owned[b]
            if applied and any(mask):
                self.rule.apply(own.state, dense=values, seg_mask=mask)
                own.round.version += 1
                self.st.updates_applied += 1
            own.round.processed = [t + 1] * self.n
        return self._gather_step(t)

    def owned_version(self, b: int, r: int) -> int:
        own = self.owned.get(b) if r == self.rank else None
        return own.round.version if own is not None else 0

    def _clip(self, means: dict[int, tuple]) -> None:
        """Clip the mean gradient to max_grad_norm: one all-reduce of the ranks' squared norms."""
        sq = sum(float(torch.dot(v, v)) for v, _, _ in means.values())
        total = torch.tensor([sq], dtype=torch.float64)
        if self.n > 1:
            self._collective("the gradient norm's all-reduce", dist.all_reduce, total)
        norm = math.sqrt(float(total))
        self.grad_norm = norm
        coef = min(1.0, self.max_grad_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        if coef < 1.0:
            for v, _, _ in means.values():
                v.mul_(coef)

    # -- counters -----------------------------------------------------------------------------------
    def _count(self, b: int, bad: int, stepping: int) -> None:
        self.st.nonfinite_skipped += bad
        self.st.pushes_applied += stepping - bad
        self.st.staleness[0] = self.st.staleness.get(0, 0) + stepping - bad

    # -- the rest of the engine's narrow API ------------------------------------------------------------
    def no_sync(self) -> Iterator[None]:
        """Context: gradients accumulate over several backward() calls (nothing is read before step())."""
        return self.capture.paused()

    def pause(self) -> None:
        """Nothing to do: no round of this engine can be open between steps."""
        self._require_open("pause()")

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
        return {(b, self.rank): own.round.version for b, own in self.owned.items()}

    def threads(self) -> list[threading.Thread]:
        return []

    def _touched(self, values: dict[tuple[int, int], torch.Tensor]) -> None:
        """The parameters were given ``values`` ({(bucket, owner): shard values}, exact fp32) by a load:
        the replica (what every rank holds) takes them too, bit for bit."""
        if not self.compress_replies:
            return
        if self.replica_stale:
            self._read_replica()  # the rest of the replica: the parameters as they are
        for (b, r), v in values.items():
            sh = self.layouts[b].shards[r]
            self.replica[b][sh.begin : sh.end].copy_(v.reshape(-1))

    def close(self) -> None:
        """Every rank leaves together (a bounded barrier on the optimizer's group); replicas are already
        equal after every step. After a failure: raise it unless a call already did."""
        if self.closed:
            return
        self.closed = True
        self.capture.remove()
        try:
            if self.error is not None:
                if not self.reported:
                    self.check()
                return
            if self.n > 1:
                while self._run(1.0, False, active=False) > 0:
                    pass  # serve the ranks still stepping until every rank closed (Note [Joining])
            if self.compress_replies:
                self._gather(self.clock)  # end on the exact masters (Note [Compressed replies])
            if self.n > 1:
                self._collective(
                    "close()'s barrier", dist.monitored_barrier, timeout=self.timeout, wait_all_ranks=True
                )
        finally:
            if self.error is not None:
                self.abort()
            elif self.transport is not None:
                self.transport.close()

    def abort(self, reason: str | None = None) -> None:
        """Stop (after a failure or without close()); the peers are told ``reason`` or this rank's failure."""
        self.closed = True
        self.capture.remove()
        if self.transport is not None:
            self.transport.abort(self.abort_reason(reason), getattr(self.error, "ranks", None))

    def stats(self) -> Stats:
        st = Stats(**{k: v for k, v in vars(self.st).items() if k != "staleness"})
        st.staleness = dict(self.st.staleness)
        st.clock = self.clock
        st.min_included_clock = self.clock - 1
        st.grad_norm = self.grad_norm
        st.compression_ratio = self.raw_bytes / self.enc_bytes if self.enc_bytes else 1.0
        return st
