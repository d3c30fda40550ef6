"""Replies on the point-to-point path: an owner's send frames per (bucket, worker), exact fp32 values or,
with a lossy compressor, coded changes (Note [Compressed replies on the point-to-point path]); and the
worker's side that turns what arrives back into values (:class:`HeldValues`).

Note [Compressed replies on the point-to-point path]
    With a lossy compressor (int8, sign, fp16, bf16, top-k), replies are compressed as pushes are. The
    owner keeps, per remote worker and owned shard, ``held``: the values that worker holds, exactly as
    the worker decoded them. A reply carries ``master - held`` encoded once with the job's codec
    (``Compressor.encode_once``), and the owner adds the decoded change to ``held`` with the same kernel
    the worker uses, so both sides agree bit for bit. What the encoding dropped stays in the next
    ``master - held``: error feedback by construction, with no residual of its own (the BSP gather does
    the same, Note [Compressed replies] in engine/collective/gather.py). Pushes and replies of one
    pair of ranks travel in order on one connection, so every change is decoded once, in the order it
    was made; the worker decodes on receipt (the mailbox keeps only the newest reply, so a change
    cannot wait there).

    This rank's own worker gets the same kind of change (no frame, no network), so under BSP every rank
    holds the same values of every shard, as with exact replies. Both sides start from the agreed
    parameters (broadcast at construction: the initial masters are
    what every worker holds). A reply is exact (fp32, codec 0) when the owner no longer knows what the
    worker holds, after a load (``forget``) that did not restore it, and for the FINAL reply of
    ``close()``, so a run ends on the masters as an uncompressed one does. Under BSP a checkpoint saves
    ``held`` (``held_rows``: one row, as every worker holds the same values) and a load into the same
    world size restores it on both sides (``restore``, ``HeldValues.set``), so a resumed run sends the
    same coded changes as one that never stopped (Note [Checkpoints and held values] in
    pyasync/checkpoint/save.py). So BSP on this path sends the same changes as BSP on
    collectives, and the two agree bit for bit. The price is one fp32 copy of the shard per worker on
    its owner (the model's size per rank in all), and per reply a subtraction, an encode
    and a decode of the shard: passes at memory bandwidth, against 2-32x fewer bytes on the wire.
"""

from __future__ import annotations

import datetime
import threading

import torch

from pyasync.engine import wire
from pyasync.errors import ProtocolError
from pyasync.ops import bucketing as ops_bucketing
from pyasync.ops import codecs as ops_codecs
from pyasync.transport.base import Transport

__all__ = ["HeldValues", "ReplyFrames"]


class ReplyFrames:
    """The owner's reply frames (the transport's rings, one per (bucket, worker)) and, when replies are
    coded, what each worker holds of each owned shard."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        transport: Transport | None,
        compressor,
        timeout: datetime.timedelta,
        masters: dict[int, torch.Tensor],
        track: bool = False,
    ) -> None:
        self.rank, self.n, self.transport, self.timeout = rank, world_size, transport, timeout
        self.comp = compressor if compressor is not None and compressor.replies else None
        # Keep ``held`` with exact replies too: the delay compensation needs what each worker holds.
        self.track = track
        self.rings: dict[tuple[int, int], object] = {}  # (bucket, worker) -> the transport's frames
        # (bucket, worker) -> the values that worker holds of our shard: at first the agreed parameters.
        self.held: dict[tuple[int, int], torch.Tensor] = (
            {(b, w): m.clone() for b, m in masters.items() for w in range(world_size)}
            if self.comp is not None or track
            else {}
        )
        self.scratch: dict[int, torch.Tensor] = {}  # bucket -> master - held (one applier per bucket)

    def forget(self, bucket: int) -> None:
        """The shard's values changed outside the updates (a load): the next reply to every worker is
        exact. Call from the shard's applier thread."""
        for key in [k for k in self.held if k[0] == bucket]:
            del self.held[key]

    def held_rows(self, bucket: int) -> torch.Tensor | None:
        """What every worker holds of our shard of ``bucket``, for a checkpoint (a copy): [1, numel] when
        all hold the same values (always under BSP), else [n, numel] (row w: worker w's); None when
        replies are exact or the owner does not know (a load forgot it). Call from the shard's applier
        thread. See Note [Checkpoints and held values] in pyasync/checkpoint/save.py."""
        if self.comp is None:
            return None
        rows = [self.held.get((bucket, w)) for w in range(self.n)]
        if any(r is None for r in rows):
            return None
        if all(torch.equal(rows[0], r) for r in rows[1:]):
            return rows[0].detach().cpu().clone().unsqueeze(0)
        return torch.stack([r.detach().cpu() for r in rows])

    def restore(self, bucket: int, rows: torch.Tensor, like: torch.Tensor) -> None:
        """A load restored what every worker holds of our shard of ``bucket`` (``rows`` as
        :meth:`held_rows` gives them; ``like``: the master, for device and size): the next replies are
        coded changes from these values, as if the run had not stopped. Call from the shard's applier
        thread, after ``forget``."""
        if self.comp is None:
            return
        if rows.dim() != 2 or rows.shape[0] not in (1, self.n) or rows.shape[1] != like.numel():
            raise ValueError(
                f"held values of bucket {bucket} have shape {tuple(rows.shape)}, expected (1 or "
                f"{self.n}, {like.numel()})"
            )
        for w in range(self.n):
            row = rows[w if rows.shape[0] > 1 else 0]
            self.held[(bucket, w)] = row.to(device=like.device, dtype=torch.float32).clone()

    def _ring(self, bucket: int, w: int, nbytes: int, device: torch.device):
        ring = self.rings.get((bucket, w))
        if ring is None:
            ring = self.rings[(bucket, w)] = self.transport.frame_ring(nbytes, device)
        return ring

    def send(
        self,
        bucket: int,
        w: int,
        clock: int,
        version: int,
        master: torch.Tensor,
        clocks: list[int],
        final: bool,
    ) -> int:
        """Send worker ``w`` the shard's values (exact or coded); returns the bytes sent."""
        numel = master.numel()
        held = None if final or self.comp is None else self.held.get((bucket, w))
        exact_bytes = wire.HEADER_BYTES + wire.reply_parts(numel, self.n)[1]
        if self.comp is not None:
            codec, block, k = self.comp.wire_params(numel)
            coded_bytes = wire.HEADER_BYTES + wire.coded_reply_parts(codec, numel, block, k, self.n)[1]
        ring = self._ring(bucket, w, max(exact_bytes, coded_bytes if self.comp else 0), master.device)
        fr = ring.take(self.timeout)
        if fr.views is None:
            fr.views = {}
        if held is None:
            views = fr.views.get("exact")
            if views is None:
                views = fr.views["exact"] = wire.reply_views(fr.buf, numel, self.n)
            values, clocks_v, nbytes = views
            values.copy_(master)
            codec_id, block, k, flags = 0, 0, 0, 0
            if self.comp is not None and not final:
                self.held[(bucket, w)] = master.clone()
            elif self.track and not final:
                self._keep(bucket, w, master)
        else:
            views = fr.views.get("coded")
            if views is None:
                views = fr.views["coded"] = wire.coded_reply_views(fr.buf, codec, numel, block, k, self.n)
            payload, clocks_v, nbytes = views
            self._change(bucket, version, master, held, out=payload)
            codec_id, flags = wire.CODEC_IDS[codec], wire.FLAG_FINITE
        wire.put_ints(clocks_v, clocks)
        h = wire.Header(
            kind=wire.REPLY,
            sender=self.rank,
            clock=clock,
            version=version,
            bucket=bucket,
            shard=self.rank,
            codec=codec_id,
            numel=numel,
            nbytes=0,
            k=k,
            block=block,
            flags=flags | (wire.FLAG_FINAL if final else 0),
            count=self.n,
        )
        wire.seal(fr.buf, h, nbytes)
        self.transport.send_frame(fr, w, "reply", wire.HEADER_BYTES + nbytes)  # not the frame's spare room
        return wire.HEADER_BYTES + nbytes

    def _keep(self, bucket: int, w: int, master: torch.Tensor) -> None:
        """Exact replies with delay compensation: worker ``w`` now holds ``master`` (a copy, reused)."""
        kept = self.held.get((bucket, w))
        if kept is None or kept.numel() != master.numel():
            self.held[(bucket, w)] = master.clone()
        else:
            kept.copy_(master)

    def _change(self, bucket: int, version: int, master: torch.Tensor, held: torch.Tensor, out=None):
        """Encode master - held into ``out`` (views of a frame, or None: fresh tensors) and add the
        decoded change to ``held``; the payload."""
        delta = self.scratch.get(bucket)
        if delta is None or delta.numel() != master.numel():
            delta = self.scratch[bucket] = torch.empty_like(master)
        torch.sub(master, held, out=delta)
        payload = self.comp.encode_once(delta, out=out)
        if not payload.finite:
            raise ProtocolError(
                f"pyasync: the values of bucket {bucket} shard {self.rank} are not finite at version "
                f"{version} (a diverged update: lower the learning rate)"
            )
        ops_codecs.decode(payload, out=held, alpha=1.0, accumulate=True, validate=False)
        return payload

    def local(self, bucket: int, version: int, master: torch.Tensor, final: bool) -> torch.Tensor:
        """The values this rank's own worker gets (a fresh tensor): the same coded change as a remote
        worker would decode, so every rank holds the same values of a shard under BSP; exact values
        when replies are not coded, after a load, and when final."""
        held = None if final or self.comp is None else self.held.get((bucket, self.rank))
        if held is None:
            if self.comp is not None and not final:
                self.held[(bucket, self.rank)] = master.clone()
            elif self.track and not final:
                self._keep(bucket, self.rank, master)
            return master.clone()
        self._change(bucket, version, master, held)
        return held.clone()

    def drain(self, buckets, timeout: datetime.timedelta) -> None:
        """Wait for the replies still in flight from ``buckets`` (applier thread, at stop)."""
        for (b, _), ring in list(self.rings.items()):
            if b in buckets:
                ring.drain(timeout)


class HeldValues:
    """The worker's side of coded replies: the values it holds of each remote shard (``keys``: (bucket,
    owner)), at first the agreed parameters; exact replies are copied in, coded ones decoded onto them on
    receipt (receiver thread); ``install`` reads them under the same lock, so it never sees half a
    change."""

    def __init__(self, params: list[torch.Tensor], layouts, keys) -> None:
        self.values: dict[tuple[int, int], torch.Tensor] = {}
        for b in sorted({b for b, _ in keys}):
            lay = layouts[b]
            flat = torch.empty(lay.numel)
            src = [params[p].detach().reshape(-1).float().cpu() for p in lay.params]
            ops_bucketing.flatten(src, flat, lay.offsets, numels=lay.numels)
            for bb, r in keys:
                if bb == b:
                    self.values[(b, r)] = flat[lay.shards[r].begin : lay.shards[r].end].clone()
        self.lock = threading.Lock()

    def set(self, values: dict[tuple[int, int], torch.Tensor]) -> None:
        """The parameters were given ``values`` ({(bucket, owner): shard values}) outside the replies (a
        checkpoint load, between steps): they are what this worker holds of those shards now."""
        with self.lock:
            for key, v in values.items():
                held = self.values.get(key)
                if held is not None:
                    held.copy_(v.reshape(-1))

    def take(self, h: wire.Header, body: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Apply a checked reply (exact or coded) to the held values of its shard; (values, clocks)."""
        key = (h.bucket, h.shard)
        held = self.values[key]
        if h.codec == 0:
            values, clocks = wire.unpack_reply(body, h)
            with self.lock:
                held.copy_(values)
            return held, clocks
        payload, clocks = wire.unpack_coded_reply(body, h)
        with self.lock:
            ops_codecs.decode(payload, out=held, alpha=1.0, accumulate=True, validate=False)
        return held, clocks
