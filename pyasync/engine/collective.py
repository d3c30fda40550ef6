"""BSP on collectives: every step is a reduce-scatter (or an all-to-all of encoded pushes), the fused
update of the shard this rank owns, and an all-gather of the new shard values. No engine thread, no
point-to-point message: the training thread runs the step's collectives on the optimizer's own gloo
group (the same code would run on an NCCL group), pipelined across buckets.

Note [BSP on collectives]
    Under BSP every worker's push of clock t is needed before any owner may apply, and every worker waits
    for every owner's update: that is a reduce-scatter followed by an all-gather, which the collective
    libraries do with no round trip per message and no thread hand-off. Per bucket b:

    * uncompressed: each rank lays its gradient x 1/n out as one chunk per shard, each chunk followed by
      a few extra elements: one has-grad flag per parameter segment of that shard, a non-finite flag,
      and the rank's clock. ``reduce_scatter`` (SUM) leaves shard r's chunk on rank r: the mean
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
    * ``all_gather`` of the new shard values (each padded to the largest shard) installs them on every
      rank, so replicas are equal after every step.

    The gradient is read from ``.grad`` in ``step()``, so what the caller leaves there is what is
    reduced (Note [What step() pushes]); every rank must take the same number of steps, as with DDP.
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pyasync.engine import wire
from pyasync.engine.access import ShardAccess, initial_masters
from pyasync.engine.capture import Capture, check_grads
from pyasync.engine.clock import as_raised
from pyasync.engine.meet import collective_failure
from pyasync.engine.rule import UpdateRule
from pyasync.engine.shards import BucketLayout
from pyasync.engine.stats import Stats
from pyasync.errors import NonFiniteGradientError, PeerFailure, ProtocolError
from pyasync.ops import bucketing as ops_bucketing
from pyasync.ops import codecs as ops_codecs

__all__ = ["CollectiveEngine"]

_log = logging.getLogger("pyasync")


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


class CollectiveEngine:
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
        self.error: BaseException | None = None
        self.reported = False
        self.clock = 0
        self.closed = False
        self.grad_norm: float | None = None
        self.wait_seconds = 0.0
        self.st = Stats()
        self.logged = False
        self.bad: list[tuple[int, int]] = []  # (bucket, step) of this rank's non-finite pushes, for "raise"
        masters = initial_masters(params, layouts, rank)
        self.owned = {
            b: _Owned(_Book(0, [0] * world_size), rule.new_state(layouts[b].shards[rank], masters[b]))
            for b in masters
        }
        self.shards = ShardAccess(_Here(self.owned), rule, layouts, params, rank, timeout, self._require_open)
        self.capture = Capture(params, layouts, self.cond, lambda b: None)  # no_sync(); nothing early
        self._plan()

    # -- layout of one step's buffers -------------------------------------------------------------------
    def _plan(self) -> None:
        """Per bucket: the reduce-scatter chunks (values + extras) or the all-to-all frame sizes, and the
        padded all-gather width."""
        self.chunks: list[list[tuple[int, int, int]]] = []  # bucket -> per shard (offset, numel, extras)
        self.frames: list[list[int]] = []  # bucket -> per shard: push frame bytes
        for lay in self.layouts:
            off, rows = 0, []
            for sh in lay.shards:
                extras = len(sh.segments) + 2  # has-grad per segment, non-finite flag, clock
                rows.append((off, sh.numel, extras))
                off += sh.numel + extras
            self.chunks.append(rows)
            self.frames.append(
                [wire.HEADER_BYTES + self.spec.push_bytes(lay.index, r) if sh.numel else 0
                 for r, sh in enumerate(lay.shards)]
            )
        self.rs_buf = [torch.zeros(rows[-1][0] + rows[-1][1] + rows[-1][2]) for rows in self.chunks]
        self.width = [max(sh.numel for sh in lay.shards) for lay in self.layouts]

    # -- errors -------------------------------------------------------------------------------------
    def check(self) -> None:
        if self.error is not None:
            self.reported = True
            raise as_raised(self.error)

    def _sticky(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        self.reported = True

    def _require_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{what} after close(): call it before close()")
        self.check()

    def _collective(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, group=self.control, **kwargs)
        except Exception as e:  # noqa: BLE001 - a dead or stalled peer: name it when the transport saw it
            err = collective_failure(e, self.transport, f"{what} of step {self.clock}")
            if not isinstance(err, PeerFailure):
                err = TimeoutError(
                    f"pyasync: {what} of step {self.clock} failed ({e}); a rank may be hung, late or taking "
                    "another number of steps (under BSP every rank takes the same steps, as with DDP)"
                )
            self._sticky(err)
            raise err from e

    # -- step ---------------------------------------------------------------------------------------
    def step(self, grad_scale: float | None = None, found_inf: bool = False) -> None:
        """Reduce, apply and gather every bucket of this step (Note [BSP on collectives])."""
        if self.closed:
            raise RuntimeError("step() called after close(); create a new DistributedOptimizer")
        self.check()
        check_grads(self.params, self.names)
        scale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        t = self.clock
        if self.codec == "none":
            means = self._reduce_dense(scale, found_inf, t)
        else:
            means = self._reduce_encoded(scale, found_inf, t)
        if self.max_grad_norm is not None:
            self._clip(means)
        for b, (values, mask, applied) in means.items():
            own = self.owned[b]
            if applied and any(mask):
                self.rule.apply(own.state, dense=values, seg_mask=mask)
                own.round.version += 1
                self.st.updates_applied += 1
            own.round.processed = [t + 1] * self.n
        self._gather(t)
        with self.cond:
            self.capture.next_clock()
        self.clock = t + 1
        self.st.pushes_sent += sum(1 for lay in self.layouts for sh in lay.shards if sh.numel)
        bad, self.bad = [b for b, c in self.bad if c == t], []
        if bad and self.on_nonfinite == "raise":
            raise NonFiniteGradientError(
                f"pyasync: non-finite gradient (NaN or Inf) in buckets {bad} at step {t} on rank {self.rank}; "
                "the push was skipped (not applied) and the step completed. Fix the loss or lower the learning "
                "rate, or pass on_nonfinite='skip' to skip such pushes silently"
            )

    def _grads(self, b: int) -> list[torch.Tensor | None]:
        out = []
        for p in self.layouts[b].params:
            g = self.params[p].grad
            out.append(None if g is None else (g.to_dense() if g.layout != torch.strided else g).contiguous())
        return out

    def _reduce_dense(self, scale: float, skip: bool, t: int) -> dict[int, tuple]:
        """Uncompressed: per bucket, the reduce-scatter of chunks (values x scale / n, then extras)."""
        works = []
        for b, lay in enumerate(self.layouts):
            buf, rows = self.rs_buf[b], self.chunks[b]
            grads = self._grads(b)
            srcs, offs, lens = [], [], []
            for (off, _, _), sh in zip(rows, lay.shards):
                for seg in sh.segments:
                    g = grads[seg.slot]
                    srcs.append(None if g is None else g.view(-1)[seg.param_begin : seg.param_begin + seg.end - seg.begin])
                    offs.append(off + seg.begin)
                    lens.append(seg.end - seg.begin)
            flag = torch.zeros(1, dtype=torch.int32)
            if srcs:
                ops_bucketing.flatten(srcs, buf, offs, numels=lens, scale=scale / self.n, nonfinite=flag)
            bad_bucket = bool(flag[0]) or skip
            for r, ((off, numel, extras), sh) in enumerate(zip(rows, lay.shards)):
                chunk = buf[off : off + numel]
                bad = skip or (bad_bucket and not bool(torch.isfinite(chunk).all()))
                if bad:
                    chunk.zero_()  # counts as zeros in the mean, as in the point-to-point BSP
                    if not skip:
                        self._nonfinite(b, t)
                ex = buf[off + numel : off + numel + extras]
                ex[: len(sh.segments)] = torch.tensor([float(grads[s.slot] is not None) for s in sh.segments])
                ex[-2] = float(bad)
                ex[-1] = float(t)
            inputs = [buf[off : off + numel + extras] for off, numel, extras in rows]
            self.st.bytes_sent += 4 * (buf.numel() - inputs[self.rank].numel())  # what leaves this rank
            mine = rows[self.rank]
            out = torch.empty(mine[1] + mine[2])
            if self.n > 1:
                works.append((b, out, self._collective("the gradient reduce-scatter", dist.reduce_scatter, out,
                                                       inputs, async_op=True)))
            else:
                out.copy_(inputs[0])
                works.append((b, out, None))
        means = {}
        for b, out, work in works:
            if work is not None:
                self._wait(work, "the gradient reduce-scatter")
            numel, extras = self.chunks[b][self.rank][1], self.chunks[b][self.rank][2]
            if numel == 0:
                continue
            ex = out[numel:]
            if int(round(float(ex[-1]))) != self.n * t:
                err = ProtocolError(
                    f"pyasync: the ranks are not on the same step (this is step {t}, the clocks sum to "
                    f"{float(ex[-1]):g}); under BSP every rank takes the same number of steps"
                )
                self._sticky(err)
                raise err
            bad = int(round(float(ex[-2])))
            mask = [bool(x > 0) for x in ex[: extras - 2].tolist()]
            self._count(b, bad)
            means[b] = (out[:numel], mask, self.n - bad)
        return means

    def _reduce_encoded(self, scale: float, skip: bool, t: int) -> dict[int, tuple]:
        """Compressed: per bucket, every slice encoded into a push frame, an all-to-all, then this rank's
        frames decoded and summed in rank order."""
        means = {}
        for b, lay in enumerate(self.layouts):
            flat = torch.empty(lay.numel)
            grads = self._grads(b)
            has = [g is not None for g in grads]
            if lay.numel:
                ops_bucketing.flatten(grads, flat, lay.offsets, numels=lay.numels, scale=scale)
            sizes = self.frames[b]
            send = torch.zeros(sum(sizes), dtype=torch.uint8)
            off = 0
            for r, sh in enumerate(lay.shards):
                if sh.numel == 0:
                    continue
                codec, block, k = self.comp.wire_params(sh.numel)
                fr = send[off : off + sizes[r]]
                out, mask_v, body = wire.push_views(fr, codec, sh.numel, block, k, len(sh.segments))
                payload = self.comp.compress(flat[sh.begin : sh.end], key=(b, r), out=out)
                if skip:
                    self.comp.undo((b, r))
                elif not payload.finite:
                    self._nonfinite(b, t)
                mask_v.copy_(torch.tensor([has[s] for s in sh.slots], dtype=torch.uint8))
                h = wire.Header(kind=wire.PUSH, sender=self.rank, clock=t, version=self.owned_version(b, r),
                                bucket=b, shard=r, codec=wire.CODEC_IDS[codec], numel=sh.numel, nbytes=0, k=k,
                                block=block, flags=wire.FLAG_FINITE if payload.finite and not skip else 0,
                                count=len(sh.segments))
                wire.seal(fr, h, body)
                off += sizes[r]
            mine = sizes[self.rank]
            self.st.bytes_sent += sum(sizes) - mine
            recv = torch.empty(mine * self.n, dtype=torch.uint8)
            if self.n > 1:
                self._collective("the push all-to-all", dist.all_to_all_single, recv, send,
                                 output_split_sizes=[mine] * self.n, input_split_sizes=sizes)
            else:
                recv.copy_(send)
            sh = lay.shards[self.rank]
            if sh.numel == 0:
                continue
            agg = torch.zeros(sh.numel)
            mask = [False] * len(sh.segments)
            bad = 0
            for w in range(self.n):  # rank order: the sum does not depend on arrival
                frame = recv[w * mine : (w + 1) * mine]
                h = wire.frame_header(frame, w)
                self.spec.check_push(h)
                if h.clock != t:
                    raise ProtocolError(f"PUSH from rank {w} carries step {h.clock}, this is step {t}")
                payload, m = wire.unpack_push(wire.frame_body(frame, h), h)
                if not payload.finite:
                    bad += 1
                    continue
                ops_codecs.decode(payload, out=agg, alpha=1.0 / self.n, accumulate=True, validate=False)
                mask = [a or bool(x) for a, x in zip(mask, m.tolist())]
            self._count(b, bad)
            means[b] = (agg, mask, self.n - bad)
        return means

    def owned_version(self, b: int, r: int) -> int:
        own = self.owned.get(b) if r == self.rank else None
        return own.round.version if own is not None else 0

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            err = collective_failure(e, self.transport, f"{what} of step {self.clock}")
            self._sticky(err)
            raise err from e

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

    def _gather(self, t: int) -> None:
        """All-gather every bucket's new shard values and write them into the parameters."""
        works = []
        for b, lay in enumerate(self.layouts):
            width = self.width[b]
            if width == 0:
                continue
            mine = torch.zeros(width)
            own = self.owned.get(b)
            if own is not None:
                mine[: own.state.master.numel()].copy_(own.state.master)
            out = torch.empty(width * self.n)
            self.st.bytes_sent += 4 * width * (self.n - 1)  # this rank's shard, to every other rank
            if self.n > 1:
                works.append((b, out, self._collective("the all-gather of the new values",
                                                        dist.all_gather_into_tensor, out, mine, async_op=True)))
            else:
                out.copy_(mine)
                works.append((b, out, None))
        with torch.no_grad():
            for b, out, work in works:
                if work is not None:
                    self._wait(work, "the all-gather of the new values")
                lay, width = self.layouts[b], self.width[b]
                dst = [self.params[p].data for p in lay.params]
                for r, sh in enumerate(lay.shards):
                    if sh.numel:
                        ops_bucketing.unflatten(out[r * width : r * width + sh.numel].to(self.device), dst,
                                                lay.offsets, begin=sh.begin)

    # -- counters -----------------------------------------------------------------------------------
    def _count(self, b: int, bad: int) -> None:
        self.st.nonfinite_skipped += bad
        self.st.pushes_applied += self.n - bad
        self.st.staleness[0] = self.st.staleness.get(0, 0) + self.n - bad

    def _nonfinite(self, b: int, t: int) -> None:
        if (b, t) in self.bad:
            return
        self.bad.append((b, t))
        if not self.logged:
            self.logged = True
            names = [self.names[p] for p in self.layouts[b].params][:8]
            _log.warning("pyasync: non-finite gradient (NaN or Inf) in bucket %d at step %d on rank %d "
                         "(parameters: %s); the push is skipped, not applied (counted in "
                         "stats().nonfinite_skipped; logged once per rank)", b, t, self.rank, ", ".join(names))

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
        """Nothing to wait for: every step's update is applied before step() returns."""
        self.check()

    @property
    def in_flight(self) -> None:
        return None

    def installed_versions(self) -> dict[tuple[int, int], int]:
        return {(b, self.rank): own.round.version for b, own in self.owned.items()}

    def threads(self) -> list[threading.Thread]:
        return []

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
                self._collective("close()'s barrier", dist.monitored_barrier, timeout=self.timeout,
                                 wait_all_ranks=True)
        finally:
            if self.transport is not None:
                (self.transport.close if self.error is None else self.transport.abort)()

    def abort(self) -> None:
        self.closed = True
        self.capture.remove()
        if self.transport is not None:
            self.transport.abort()

    def stats(self) -> Stats:
        st = Stats(**{k: v for k, v in vars(self.st).items() if k != "staleness"})
        st.staleness = dict(self.st.staleness)
        st.clock = self.clock
        st.min_included_clock = self.clock - 1
        st.grad_norm = self.grad_norm
        return st
