"""The reduce of one bucket in a BSP step on collectives (Note [BSP on collectives] in
engine/collective/engine.py): the buffers each bucket's all-to-all uses, and the two ways to fill them,
an all-to-all of scaled gradient chunks summed in rank order (uncompressed, Note [Reduce by
all-to-all]) or an all-to-all of encoded push frames (compressed). Both return, per bucket this rank
owns, (the mean gradient of its shard, the has-grad mask of its segments, how many ranks' pushes were
finite). The step's reduce, launched from the backward hooks, is engine/collective/overlap.py's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pyasync.engine import wire
from pyasync.engine.collective.group import StepGroup
from pyasync.engine.core.capture import dense
from pyasync.engine.core.shards import BucketLayout
from pyasync.engine.core.stats import Stats
from pyasync.errors import ProtocolError
from pyasync.ops import bucketing as ops_bucketing
from pyasync.ops import codecs as ops_codecs

__all__ = ["BucketReduce", "Launch"]


@dataclass
class Launch:
    """One bucket's reduce in flight: where its all-to-all lands, the work to wait on (None on one
    rank), and whether this rank's push of it was not finite (recorded once the reduce is final)."""

    b: int
    out: torch.Tensor
    work: object
    nonfinite: bool


class BucketReduce:
    """Each bucket's reduce: ``launch`` fills its send buffer from ``.grad`` and starts its all-to-all,
    ``finish`` waits for it and sums this rank's shard. Receives the parameters and layouts, the wire
    spec and compressor, this rank and the world size, the engine's counters (``st``), its collectives
    (``group``), ``record`` and ``on_nonfinite`` (its Failures') and ``version`` (bucket -> the version
    of this rank's shard, what its push frames carry). Counts the fp32 and encoded bytes of the slices
    it encodes (``raw_bytes``, ``enc_bytes``) and the ranks that pushed in the last step, as this rank's
    shards saw them (``seen_active``; -1 before any sum of the step).

    Note [Reduce by all-to-all]
        The uncompressed reduce of a bucket is an ``all_to_all`` of the n chunks (chunk r, this rank's
        gradient slice of shard r x 1/n and its extras, goes to rank r); each owner then sums the n
        chunks it got in rank order. This moves the same bytes as a ring reduce-scatter ((n-1)/n of the
        bucket out and in per rank) in one exchange instead of n-1 rounds, and on gloo it takes less than
        half the CPU of ``reduce_scatter_tensor`` (docs/benchmarks.md, "BSP: the reduce by
        all-to-all"); the sum is a few adds per element of one shard. The all-gather of the new values
        is a point-to-point send of the shard to every other rank (engine/collective/gather.py): no n
        copies of it to build an all-to-all's input, and on gloo less time than either that all-to-all or
        ``all_gather_into_tensor``; the reduce stays an all-to-all, which beat point-to-point there
        (``bench/collectives.py``). On NCCL, ring collectives would be the better calls; the collective
        engine runs on the optimizer's gloo group.
    """

    def __init__(
        self,
        *,
        params: list[torch.Tensor],
        layouts: list[BucketLayout],
        spec: wire.WireSpec,
        compressor,
        rank: int,
        world_size: int,
        st: Stats,
        group: StepGroup,
        record: Callable[[BaseException], None],
        on_nonfinite: Callable[[int, int], None],
        version: Callable[[int], int],
    ) -> None:
        self.params, self.layouts, self.spec, self.comp = params, layouts, spec, compressor
        self.codec = compressor.wire_params(1)[0]
        self.rank, self.n, self.st, self.group = rank, world_size, st, group
        self.record, self.on_nonfinite, self.version = record, on_nonfinite, version
        self.raw_bytes = 0  # fp32 bytes of the slices encoded (compressed pushes)
        self.enc_bytes = 0  # their encoded bytes
        self.seen_active = -1  # ranks that pushed in the last step, as this rank's shards saw it
        self._plan()

    # -- layout of one step's buffers -------------------------------------------------------------------
    def _plan(self) -> None:
        """Per bucket: the reduce-scatter chunks (values + extras) or the all-to-all frame sizes."""
        self.chunks: list[list[tuple[int, int, int]]] = []  # bucket -> per shard (offset, numel, extras)
        self.frames: list[list[int]] = []  # bucket -> per shard: push frame bytes
        self.stride: list[int] = []  # bucket -> chunk stride: every chunk padded to the largest
        for lay in self.layouts:
            # has-grad per segment, non-finite, active, clock x active
            sizes = [(sh.numel, len(sh.segments) + 3) for sh in lay.shards]
            stride = max(a + e for a, e in sizes)
            self.chunks.append([(r * stride, a, e) for r, (a, e) in enumerate(sizes)])
            self.stride.append(stride)
            self.frames.append(
                [
                    wire.HEADER_BYTES + self.spec.push_bytes(lay.index, r) if sh.numel else 0
                    for r, sh in enumerate(lay.shards)
                ]
            )
        # Every buffer of a step is kept across steps: no fresh tensor of a bucket's size per step (its
        # allocation and first touch cost more than the copies they hold).
        if self.codec == "none":
            # One tensor per bucket, n equal chunks: one all-to-all per bucket (Note [Reduce by
            # all-to-all]); its receive side; the rank-order sum of this rank's chunks.
            self.rs_buf = [torch.zeros(stride * self.n) for stride in self.stride]
            self.rs_recv = [torch.empty(stride * self.n) if self.n > 1 else None for stride in self.stride]
            self.rs_sum = [torch.empty(a + e) for a, e in (rows[self.rank][1:] for rows in self.chunks)]
        else:
            # The flat gradient, the push frames out and in, and the decoded sum of this rank's shard.
            self.enc_flat = [torch.zeros(lay.numel) for lay in self.layouts]
            self.enc_send = [torch.zeros(sum(sizes), dtype=torch.uint8) for sizes in self.frames]
            self.enc_recv = [torch.zeros(f[self.rank] * self.n, dtype=torch.uint8) for f in self.frames]
            self.enc_agg = [torch.empty(lay.shards[self.rank].numel) for lay in self.layouts]

    def _grads(self, b: int) -> list[torch.Tensor | None]:
        out = []
        for p in self.layouts[b].params:
            g = self.params[p].grad
            out.append(None if g is None else dense(g))
        return out

    # -- one bucket's reduce: launch, then finish ----------------------------------------------------
    def launch(self, b: int, scale: float, skip: bool, t: int, active: bool) -> Launch:
        """Fill bucket b's send buffer from ``.grad`` and start its all-to-all (async)."""
        if self.codec == "none":
            return self._launch_dense(b, scale, skip, t, active)
        return self._launch_encoded(b, scale, skip, t, active)

    def wait(self, la: Launch) -> None:
        """Wait for a launched all-to-all (and nothing else: the bucket is launched again)."""
        if la.work is not None:
            self.group.wait(la.work, "the gradient all-to-all")

    def undo(self, b: int) -> None:
        """Compressed: take back the residuals of bucket b's last encode (it is encoded again)."""
        if self.codec != "none":
            for r in range(self.n):
                self.comp.undo((b, r))

    def finish(self, la: Launch, t: int, active: bool) -> tuple | None:
        """Wait for a launched all-to-all and sum this rank's shard in rank order: (mean, mask, finite
        pushes), or None when this rank's shard of the bucket is empty."""
        self.wait(la)
        if la.nonfinite:
            self.on_nonfinite(la.b, t)
        if self.codec == "none":
            return self._sum_dense(la.b, la.out, t, active)
        return self._sum_encoded(la.b, la.out, t, active)

    def _launch_dense(self, b: int, scale: float, skip: bool, t: int, active: bool) -> Launch:
        """Uncompressed: the chunks (values x scale / n, then extras) and their all-to-all (Note [Reduce
        by all-to-all]). A rank that closed (``active`` False) joins with zeros and no gradient (Note
        [Joining])."""
        lay = self.layouts[b]
        buf, rows = self.rs_buf[b], self.chunks[b]
        grads = self._grads(b) if active else [None] * len(lay.params)
        if not active:
            buf.zero_()
        srcs, offs, lens = [], [], []
        for (off, _, _), sh in zip(rows, lay.shards):
            for seg in sh.segments:
                g = grads[seg.slot]
                srcs.append(
                    None if g is None else g.view(-1)[seg.param_begin : seg.param_begin + seg.end - seg.begin]
                )
                offs.append(off + seg.begin)
                lens.append(seg.end - seg.begin)
        flag = torch.zeros(1, dtype=torch.int32)
        if srcs:
            ops_bucketing.flatten(srcs, buf, offs, numels=lens, scale=scale / self.n, nonfinite=flag)
        bad_bucket = bool(flag[0]) or skip
        nonfinite = False
        for (off, numel, extras), sh in zip(rows, lay.shards):
            chunk = buf[off : off + numel]
            bad = skip or (bad_bucket and not bool(torch.isfinite(chunk).all()))
            if bad:
                chunk.zero_()  # counts as zeros in the mean, as in the point-to-point BSP
                nonfinite = nonfinite or not skip
            ex = buf[off + numel : off + numel + extras]
            ex[: len(sh.segments)] = torch.tensor([float(grads[s.slot] is not None) for s in sh.segments])
            ex[-3] = float(bad)
            ex[-2] = float(active)
            ex[-1] = float(t if active else 0)
        self.st.bytes_sent += 4 * self.stride[b] * (self.n - 1)  # what leaves this rank
        if self.n == 1:
            return Launch(b, buf, None, nonfinite)
        out = self.rs_recv[b]
        work = self.group.run("the gradient all-to-all", dist.all_to_all_single, out, buf, async_op=True)
        return Launch(b, out, work, nonfinite)

    def _sum_dense(self, b: int, out: torch.Tensor, t: int, active: bool) -> tuple | None:
        numel, extras = self.chunks[b][self.rank][1], self.chunks[b][self.rank][2]
        if numel == 0:
            return None
        # Rank r's chunk of this shard is row r: summed in rank order, ((row 0 + row 1) + row 2) + ...
        rows = out.view(self.n, self.stride[b])[:, : numel + extras]
        total = self.rs_sum[b]
        if self.n > 1:
            torch.add(rows[0], rows[1], out=total)
        else:
            total.copy_(rows[0])
        for r in range(2, self.n):
            total.add_(rows[r])
        ex = total[numel:]
        stepping = round(float(ex[-2]))
        if active and round(float(ex[-1])) != stepping * t:
            err = ProtocolError(
                f"pyasync: the ranks are not on the same step (this is step {t}, the clocks of the "
                f"{stepping} stepping ranks sum to {float(ex[-1]):g}); under BSP every rank steps "
                "together (a rank that stops early calls close())"
            )
            self.record(err)
            raise err
        bad = round(float(ex[-3]))
        mask = [bool(x > 0) for x in ex[: extras - 3].tolist()]
        self._count(b, bad, stepping)
        self.seen_active = stepping
        return total[:numel], mask, stepping - bad

    def _launch_encoded(self, b: int, scale: float, skip: bool, t: int, active: bool) -> Launch:
        """Compressed: every slice of the bucket encoded into a push frame (error feedback), then the
        frames' all-to-all. A rank that closed sends FINAL frames of zeros with no gradient, encoded
        without touching its residuals (Note [Joining])."""
        lay = self.layouts[b]
        flat = self.enc_flat[b]
        grads = self._grads(b) if active else [None] * len(lay.params)
        has = [g is not None for g in grads]
        if lay.numel and active:  # every element of the bucket: None grads as zeros
            ops_bucketing.flatten(grads, flat, lay.offsets, numels=lay.numels, scale=scale)
        elif lay.numel:
            flat.zero_()
        sizes = self.frames[b]
        send = self.enc_send[b]  # every frame is written whole (header, mask, payload) each step
        off = 0
        nonfinite = False
        for r, sh in enumerate(lay.shards):
            if sh.numel == 0:
                continue
            codec, block, k = self.comp.wire_params(sh.numel)
            fr = send[off : off + sizes[r]]
            out, mask_v, body = wire.push_views(fr, codec, sh.numel, block, k, len(sh.segments))
            if active:
                payload = self.comp.compress(flat[sh.begin : sh.end], key=(b, r), out=out)
            else:
                payload = self.comp.encode_once(flat[sh.begin : sh.end], out=out)
            self.raw_bytes += 4 * sh.numel
            self.enc_bytes += payload.nbytes
            if skip and active:
                self.comp.undo((b, r))
            elif not payload.finite:
                nonfinite = True
            mask_v.copy_(torch.tensor([has[s] for s in sh.slots], dtype=torch.uint8))
            h = wire.Header(
                kind=wire.PUSH,
                sender=self.rank,
                clock=t,
                version=self.version(b) if r == self.rank else 0,
                bucket=b,
                shard=r,
                codec=wire.CODEC_IDS[codec],
                numel=sh.numel,
                nbytes=0,
                k=k,
                block=block,
                flags=(wire.FLAG_FINITE if payload.finite and not skip else 0)
                | (0 if active else wire.FLAG_FINAL),
                count=len(sh.segments),
            )
            wire.seal(fr, h, body)
            off += sizes[r]
        mine = sizes[self.rank]
        self.st.bytes_sent += sum(sizes) - mine
        recv = self.enc_recv[b]
        if self.n == 1:
            recv.copy_(send)
            return Launch(b, recv, None, nonfinite)
        work = self.group.run(
            "the push all-to-all",
            dist.all_to_all_single,
            recv,
            send,
            output_split_sizes=[mine] * self.n,
            input_split_sizes=sizes,
            async_op=True,
        )
        return Launch(b, recv, work, nonfinite)

    def _sum_encoded(self, b: int, recv: torch.Tensor, t: int, active: bool) -> tuple | None:
        """This rank's n frames of bucket b, checked, decoded and summed in rank order (x 1/n)."""
        sh = self.layouts[b].shards[self.rank]
        if sh.numel == 0:
            return None
        mine = self.frames[b][self.rank]
        agg = self.enc_agg[b].zero_()
        mask = [False] * len(sh.segments)
        bad = stepping = 0
        for w in range(self.n):  # rank order: the sum does not depend on arrival
            frame = recv[w * mine : (w + 1) * mine]
            h = wire.frame_header(frame, w)
            self.spec.check_push(h, final_ok=True)
            if h.final:
                continue  # rank w closed and joins this step with nothing to push
            stepping += 1
            if active and h.clock != t:
                raise ProtocolError(f"PUSH from rank {w} carries step {h.clock}, this is step {t}")
            payload, m = wire.unpack_push(wire.frame_body(frame, h), h)
            if not payload.finite:
                bad += 1
                continue
            ops_codecs.decode(payload, out=agg, alpha=1.0 / self.n, accumulate=True, validate=False)
            mask = [a or bool(x) for a, x in zip(mask, m.tolist())]
        self._count(b, bad, stepping)
        self.seen_active = stepping
        return agg, mask, stepping - bad

    # -- counters -----------------------------------------------------------------------------------
    def _count(self, b: int, bad: int, stepping: int) -> None:
        self.st.nonfinite_skipped += bad
        self.st.pushes_applied += stepping - bad
        self.st.staleness[0] = self.st.staleness.get(0, 0) + stepping - bad
