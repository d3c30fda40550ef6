"""The gather half of a BSP step on collectives (Note [BSP on collectives] in engine/collective/engine.py):
every owner's new shard values reach every rank, as fp32 values (uncompressed) or as compressed deltas
(Note [Compressed replies])."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pyasync.engine import wire
from pyasync.engine.collective.group import StepGroup
from pyasync.engine.collective.owned import OwnedShard, OwnedShards
from pyasync.engine.core.shards import BucketLayout
from pyasync.engine.core.stats import Stats
from pyasync.errors import ProtocolError
from pyasync.ops import bucketing as ops_bucketing
from pyasync.ops import codecs as ops_codecs

__all__ = ["Gatherer"]

_TAG = 0x6A7000  # + bucket: the gather's point-to-point tags on the engine's group


class Gatherer:
    """The gather of a step: every owner's new shard values (``values``) or encoded deltas (``deltas``)
    reach every rank and are written into the parameters. Receives the parameters and layouts, this
    rank's shards (``owned``), this rank and the world size, the wire spec and compressor, the engine's
    counters and collectives, and ``frames`` (bucket -> per shard: push frame bytes, BucketReduce's),
    which size the compressed replies' frames. Counts the fp32 and encoded bytes of the deltas it
    encodes (``raw_bytes``, ``enc_bytes``).

    Note [Compressed replies]
        With a lossy compressor, replies are compressed too: each owner sends every rank the change that
        takes the values all ranks hold (the replica, the same on every rank under BSP) towards its fp32
        master: delta = master - replica, encoded once (no residual of its own: what the encoding drops
        stays in the next delta, since the replica is what was decoded, so the error feeds back by
        construction). An all-gather (point-to-point, as the uncompressed one) of one push-layout
        frame per owner (the header says owner, step and codec, and is checked on receipt), then every
        rank decodes every owner's frame in the same way into its replica and installs it: the
        replicas stay bit-identical across ranks; they trail the masters by what the codec dropped.
        ``close()`` gathers the exact masters once, so a run ends on the masters, as uncompressed BSP
        does. A checkpoint leaves the replica alone (saving does not change the run) and saves each
        owner's slice of it; a load into the same world size puts it back, so a resumed run is
        bit-identical to one that never saved (Note [Checkpoints and held values] in
        pyasync/checkpoint/save.py). The replica costs one fp32 copy of the parameters per rank; it is
        read from the parameters at the first step, and a load writes the values it installs into it.
    """

    def __init__(
        self,
        *,
        params: list[torch.Tensor],
        layouts: list[BucketLayout],
        owned: OwnedShards,
        rank: int,
        world_size: int,
        spec: wire.WireSpec,
        compressor,
        st: Stats,
        group: StepGroup,
        frames: list[list[int]],
    ) -> None:
        self.params, self.layouts, self.owned = params, layouts, owned
        self.rank, self.n, self.device = rank, world_size, params[0].device
        self.spec, self.comp, self.st, self.group = spec, compressor, st, group
        self.raw_bytes = 0  # fp32 bytes of the deltas encoded (compressed replies)
        self.enc_bytes = 0  # their encoded bytes
        # The gather of the values (every step uncompressed; compressed, at close() and checkpoints):
        # this rank's slot + the pushing ranks seen, and every rank's (kept across steps).
        self.width = [max(sh.numel for sh in lay.shards) for lay in layouts]
        self.ag_send = [torch.zeros(w + 1) for w in self.width]
        self.ag_recv = [torch.empty((w + 1) * self.n) for w in self.width]
        self.compress_replies = compressor.replies
        self.replica: list[torch.Tensor] = []
        self.replica_stale = True
        if self.compress_replies:
            self.replica = [torch.zeros(lay.numel) for lay in self.layouts]
            self.reply_width = [max(sizes) if sizes else 0 for sizes in frames]
            # Kept across steps: this rank's frame (+ the pushing ranks seen, a float64), the gathered
            # frames, and the delta of its own shard.
            self.dl_send = [torch.zeros(w + 8, dtype=torch.uint8) for w in self.reply_width]
            self.dl_recv = [torch.zeros((w + 8) * self.n, dtype=torch.uint8) for w in self.reply_width]
            self.dl_delta = [torch.empty(lay.shards[self.rank].numel) for lay in self.layouts]

    def _read_replica(self) -> None:
        """The replica from the parameters (at start, and after state access changed them)."""
        for b, lay in enumerate(self.layouts):
            if lay.numel:
                src = [self.params[p].detach().reshape(-1).float().cpu() for p in lay.params]
                ops_bucketing.flatten(src, self.replica[b], lay.offsets, numels=lay.numels)
        self.replica_stale = False

    def held_rows(self, b: int) -> torch.Tensor:
        """What every rank holds of this rank's shard of bucket ``b`` (a copy, [1, numel]), for a
        checkpoint."""
        if self.replica_stale:
            self._read_replica()
        sh = self.layouts[b].shards[self.rank]
        return self.replica[b][sh.begin : sh.end].clone().unsqueeze(0)

    def _launch_gather(self, out: torch.Tensor, mine: torch.Tensor, tag: int) -> list:
        """All-gather into ``out`` (rank r's slot at row r) as point-to-point sends of this rank's slot
        ``mine`` to every other rank: no copies of it on the sending side, and on gloo less time than
        an all-to-all of n copies or ``all_gather_into_tensor`` (Note [Reduce by all-to-all] in
        engine/collective/reduce.py). ``tag`` tells this bucket's messages from another's in flight.
        Returns the works to wait on (none on one rank)."""
        rows = out.view(self.n, -1)
        rows[self.rank].copy_(mine)
        if self.n == 1:
            return []
        ops = []
        for i in range(1, self.n):
            dst, src = (self.rank + i) % self.n, (self.rank - i) % self.n
            ops.append(dist.P2POp(dist.irecv, rows[src], group=self.group.control, tag=tag, group_peer=src))
            ops.append(dist.P2POp(dist.isend, mine, group=self.group.control, tag=tag, group_peer=dst))
        try:
            return dist.batch_isend_irecv(ops)
        except Exception as e:
            raise self.group.failure("the all-gather of the new values", e) from e

    def _tail(self, out: torch.Tensor, stride: int) -> int:
        """The largest count of pushing ranks any owner saw: every rank's slot of a gather ends with
        its count (a float64, as 8 bytes in the compressed gather)."""
        rows = out.view(self.n, stride)
        cells = rows[:, -8:].contiguous().view(torch.float64) if out.dtype == torch.uint8 else rows[:, -1:]
        return round(float(cells.max()))

    def deltas(self, t: int, seen_active: int) -> int:
        """All-gather every owner's encoded delta (Note [Compressed replies]); decode into the replica and
        install it. ``seen_active``: the ranks that pushed in step ``t`` as this rank's shards saw them;
        returns how many ranks pushed in this step, the largest count any owner saw (Note [Joining])."""
        if self.replica_stale:
            self._read_replica()
        works = []
        for b in range(len(self.layouts)):
            width = self.reply_width[b]
            if width == 0:
                continue
            mine, out = self.dl_send[b], self.dl_recv[b]  # kept across steps
            own = self.owned.shards.get(b)
            if own is not None:
                self._encode_delta(b, t, own, mine[:width])
            mine[width:].copy_(torch.tensor([float(seen_active)], dtype=torch.float64).view(torch.uint8))
            self.st.bytes_sent += width * (self.n - 1)
            works.append((b, out, self._launch_gather(out, mine, _TAG + b)))
        with torch.no_grad():
            for b, out, pending in works:
                for work in pending:
                    self.group.wait(work, "the all-gather of the new values")
                self._install_deltas(b, t, out)
        return self._tail(works[0][1], self.reply_width[works[0][0]] + 8)

    def _encode_delta(self, b: int, t: int, own: OwnedShard, frame: torch.Tensor) -> None:
        sh = self.layouts[b].shards[self.rank]
        delta = torch.sub(
            own.state.master.view(-1).float().cpu(), self.replica[b][sh.begin : sh.end], out=self.dl_delta[b]
        )
        codec, block, k = self.comp.wire_params(sh.numel)
        out, mask_v, body = wire.push_views(frame, codec, sh.numel, block, k, len(sh.segments))
        payload = self.comp.encode_once(delta, out=out)
        if not payload.finite:
            raise ProtocolError(
                f"pyasync: the values of bucket {b} shard {self.rank} are not finite after step {t} "
                "(a diverged update: lower the learning rate)"
            )
        mask_v.fill_(1)
        h = wire.Header(
            kind=wire.PUSH,
            sender=self.rank,
            clock=self.group.rounds,  # the step collectives' count: the same on every rank, joining or not
            version=own.round.version,
            bucket=b,
            shard=self.rank,
            codec=wire.CODEC_IDS[codec],
            numel=sh.numel,
            nbytes=0,
            k=k,
            block=block,
            flags=wire.FLAG_FINITE,
            count=len(sh.segments),
        )
        wire.seal(frame, h, body)
        self.raw_bytes += 4 * sh.numel
        self.enc_bytes += payload.nbytes

    def _install_deltas(self, b: int, t: int, out: torch.Tensor) -> None:
        lay, width = self.layouts[b], self.reply_width[b]
        dst = [self.params[p].data for p in lay.params]
        for r, sh in enumerate(lay.shards):
            if sh.numel == 0:
                continue
            frame = out[r * (width + 8) : r * (width + 8) + width]
            h = wire.frame_header(frame, r)
            self.spec.check_push(h, shard=r)
            if h.clock != self.group.rounds or h.sender != r:
                raise ProtocolError(
                    f"the values of rank {r} carry round {h.clock} (sender {h.sender}); this is round "
                    f"{self.group.rounds} (step {t})"
                )
            payload, _ = wire.unpack_push(wire.frame_body(frame, h), h)
            rep = self.replica[b][sh.begin : sh.end]
            ops_codecs.decode(payload, out=rep, alpha=1.0, accumulate=True, validate=False)
            ops_bucketing.unflatten(rep.to(self.device), dst, lay.offsets, begin=sh.begin)

    def values(self, t: int, seen_active: int) -> int:
        """All-gather every bucket's new shard values and write them into the parameters.
        ``seen_active``: the ranks that pushed in step ``t`` as this rank's shards saw them; returns how
        many ranks pushed in this step, the largest count any owner saw (Note [Joining])."""
        works = []
        for b in range(len(self.layouts)):
            width = self.width[b]
            if width == 0:
                continue
            mine, out = self.ag_send[b], self.ag_recv[b]  # kept across steps
            own = self.owned.shards.get(b)
            if own is not None:
                mine[: own.state.master.numel()].copy_(own.state.master)
            mine[width] = float(seen_active)
            self.st.bytes_sent += 4 * width * (self.n - 1)  # this rank's shard, to every other rank
            works.append((b, out, self._launch_gather(out, mine, _TAG + b)))
        with torch.no_grad():
            for b, out, pending in works:
                for work in pending:
                    self.group.wait(work, "the all-gather of the new values")
                lay, stride = self.layouts[b], self.width[b] + 1
                dst = [self.params[p].data for p in lay.params]
                for r, sh in enumerate(lay.shards):
                    if sh.numel:
                        ops_bucketing.unflatten(
                            out[r * stride : r * stride + sh.numel].to(self.device),
                            dst,
                            lay.offsets,
                            begin=sh.begin,
                        )
        return self._tail(works[0][1], self.width[works[0][0]] + 1)

    def touched(self, values: dict[tuple[int, int], torch.Tensor]) -> None:
        """The parameters were given ``values`` ({(bucket, owner): shard values}, exact fp32) by a load:
        the replica (what every rank holds) takes them too, bit for bit (ShardAccess.written)."""
        if not self.compress_replies:
            return
        if self.replica_stale:
            self._read_replica()  # the rest of the replica: the parameters as they are
        for (b, r), v in values.items():
            sh = self.layouts[b].shards[r]
            self.replica[b][sh.begin : sh.end].copy_(v.reshape(-1))
