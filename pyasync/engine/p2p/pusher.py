"""The push thread of a worker: flatten each ready bucket, compress its shard slices with error feedback
and, once ``step()`` confirms them, push slice r to owner r (own shard: in-process; others: one frame,
header + payload).

A bucket is encoded as soon as its hooks hand it over (overlapping backward), into reused send
frames of the transport (Note [Frame reuse] in pyasync/transport/frames.py), but sent only on the
step's Commit: buckets whose gradients changed since are encoded again first, after the early
encode's error-feedback residual is taken back (Note [What step() pushes] in engine/core/capture.py).
Per-push clipping and the GradScaler's unscaling are applied to the flat gradient before encoding.
On a device, the thread runs its kernels on a side stream that waits for the hook's event, and hands
its own shard's payload to the local applier with an event of its own (engine/core/streams.py).
"""

from __future__ import annotations

import datetime
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pyasync.engine import wire
from pyasync.engine.core.shards import BucketLayout
from pyasync.engine.core.streams import on_stream, record_event, side_stream, wait_event
from pyasync.engine.p2p.messages import BucketReady, Commit, Control, Stop
from pyasync.engine.p2p.owner import Owner
from pyasync.engine.p2p.replay import Retention
from pyasync.ops import bucketing as ops_bucketing
from pyasync.ops._common import Payload
from pyasync.transport.base import Transport, TransportClosed
from pyasync.transport.frames import FrameRing, PoolClosed

__all__ = ["Pusher"]


@dataclass
class _Encoded:
    """One bucket encoded for a clock, not sent yet."""

    clock: int
    versions: dict[int, int]
    has: list[bool]
    scale: float = 1.0  # the factor the flat buffer holds, relative to the gradients
    sq: float = 0.0  # sum of squares of the flat buffer (when clipping per push)
    remote: dict[int, tuple] = field(default_factory=dict)  # shard -> (frame, header fields, payload)
    local: Payload | None = None
    sent: bool = False  # already sent (grad_edits="forbid")


class Pusher(threading.Thread):
    """Takes BucketReady, Commit, Control and Stop messages from ``q``; counts what it sent."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        layouts: list[BucketLayout],
        compressor,
        transport: Transport | None,
        owner: Owner,
        device: torch.device,
        timeout: datetime.timedelta,
        committed: Callable[[int, float | None], None],
        nonfinite: Callable[[int, int], None],
        fail: Callable[[str, BaseException], None],
        clip_each_push: bool = False,
        send_early: bool = False,
        retain: Retention | None = None,
    ) -> None:
        super().__init__(name="pyasync-push", daemon=True)
        self.rank, self.n = rank, world_size
        self.layouts = layouts
        self.comp = compressor
        self.transport = transport
        self.owner = owner
        self.device = device
        self.timeout = timeout
        self._committed, self._nonfinite, self._fail = committed, nonfinite, fail
        self.clip_each_push = clip_each_push
        self.send_early = send_early  # grad_edits="forbid": send as soon as encoded (overlapping backward)
        # elastic: a copy of each push until an answer reflects it (engine/p2p/replay.py)
        self.retain = retain
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.flat = [torch.empty(lay.numel, dtype=torch.float32, device=device) for lay in layouts]
        self.stream = side_stream(device)
        self.rings: dict[tuple, FrameRing] = {}  # (bucket, shard) or ("ctl", rank) -> send frames
        self.encoded: dict[int, _Encoded] = {}
        self.bytes_sent = 0
        self.raw_bytes = 0  # fp32 bytes of the slices pushed
        self.enc_bytes = 0  # their encoded bytes
        self.pushes_sent = 0
        self.reencoded = 0  # buckets encoded again because their gradients changed (or were scaled)

    # -- the thread ---------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while True:
                msg = self.q.get()
                if isinstance(msg, BucketReady):
                    with on_stream(self.stream):
                        wait_event(msg.event, self.device)
                        self._encode_early(msg)
                elif isinstance(msg, Commit):
                    with on_stream(self.stream):
                        wait_event(msg.event, self.device)
                        norm = self._commit(msg)
                    self._committed(msg.clock, norm)
                elif isinstance(msg, Control):
                    self._control(msg)
                elif isinstance(msg, Stop):
                    if msg.timeout is not None:
                        for ring in self.rings.values():
                            ring.drain(msg.timeout)
                    self.rings = {}  # their handles hold transport work objects, which keep groups alive
                    return
                else:
                    raise TypeError(f"push thread got an unknown message {type(msg).__name__}")
        except (TransportClosed, PoolClosed):
            return  # stopped on purpose (close after a failure)
        except BaseException as e:
            self._fail("push thread", e)

    # -- encoding -----------------------------------------------------------------------------------
    def _flatten(self, b: int, grads: list[torch.Tensor | None], scale: float) -> torch.Tensor:
        lay = self.layouts[b]
        if lay.numel:
            ops_bucketing.flatten(grads, self.flat[b], lay.offsets, numels=lay.numels, scale=scale)
        return self.flat[b]

    def _encode_early(self, msg: BucketReady) -> None:
        """Flatten and encode bucket ``msg.bucket`` (not sent: see _commit)."""
        enc = _Encoded(msg.clock, msg.versions, [g is not None for g in msg.grads])
        self._flatten(msg.bucket, msg.grads, 1.0)
        if self.clip_each_push:
            enc.sq = self._sq(msg.bucket)
        self.encoded[msg.bucket] = enc
        self._encode(msg.bucket, enc)
        if self.send_early:
            self._send(msg.bucket, enc, False)
            enc.sent = True

    def _sq(self, b: int) -> float:
        f = self.flat[b]
        return float(torch.dot(f, f)) if f.numel() else 0.0

    def _encode(self, b: int, enc: _Encoded) -> None:
        """Compress every shard slice of the flat buffer of bucket b into its frame (remote) or a fresh
        payload (own shard)."""
        lay, flat = self.layouts[b], self.flat[b]
        for r, sh in enumerate(lay.shards):
            if sh.numel == 0:
                continue
            mask = [enc.has[slot] for slot in sh.slots]
            if r == self.rank:
                enc.local = self.comp.compress(flat[sh.begin : sh.end], key=(b, r))
                continue
            codec, block, k = self.comp.wire_params(sh.numel)
            nbytes = wire.HEADER_BYTES + wire.push_parts(codec, sh.numel, block, k, len(mask))[1]
            fr = self._ring((b, r), nbytes).take(self.timeout)
            if fr.views is None:
                fr.views = wire.push_views(fr.buf, codec, sh.numel, block, k, len(mask))
            out, mask_v, body = fr.views
            payload = self.comp.compress(flat[sh.begin : sh.end], key=(b, r), out=out)
            wire.put_ints(mask_v, mask)
            enc.remote[r] = (fr, (codec, block, k, len(mask), body), payload)

    def _undo(self, b: int) -> None:
        for r, sh in enumerate(self.layouts[b].shards):
            if sh.numel:
                self.comp.undo((b, r))

    # -- commit -------------------------------------------------------------------------------------
    def _commit(self, msg: Commit) -> float | None:
        """Send every bucket of clock ``msg.clock`` (encoding again what changed); the norm of this
        push when clipping per push."""
        encoded = {b: e for b, e in self.encoded.items() if e.clock == msg.clock}
        if len(encoded) != len(self.layouts):
            raise RuntimeError(
                f"step {msg.clock}: {len(self.layouts) - len(encoded)} buckets were never encoded "
                "(internal error)"
            )
        if self.send_early:
            if msg.regrab or msg.scale != 1.0 or msg.skip:
                raise RuntimeError("internal error: a commit with changes under grad_edits='forbid'")
            self.encoded = {}
            return None
        dirty = set(msg.regrab)
        for b, grads in msg.regrab.items():  # what changed: flatten again, already scaled
            e = encoded[b]
            e.has = [g is not None for g in grads]
            self._flatten(b, grads, msg.scale)
            e.scale = msg.scale
            if self.clip_each_push:
                e.sq = self._sq(b)
        norm, coef = None, 1.0
        if self.clip_each_push:
            total = sum(e.sq * (msg.scale / e.scale) ** 2 for e in encoded.values())
            norm = math.sqrt(total)
            if msg.clip is not None and math.isfinite(norm):
                coef = min(1.0, msg.clip / (norm + 1e-6))
        for b, e in sorted(encoded.items()):
            want = msg.scale * coef
            if want != e.scale:
                self.flat[b].mul_(want / e.scale)
                e.scale = want
                dirty.add(b)
            if b in dirty:
                self._undo(b)
                self._encode(b, e)
                self.reencoded += 1
            if msg.skip:
                self._undo(b)  # nothing of this step is applied: the residuals stay as they were
            self._send(b, e, msg.skip)
        self.encoded = {}
        return norm

    def _send(self, b: int, e: _Encoded, skip: bool) -> None:
        lay = self.layouts[b]
        for r, sh in enumerate(lay.shards):
            if sh.numel == 0:
                continue
            if r == self.rank:
                payload = e.local
                if skip:
                    payload.finite = False
                self._count(b, e.clock, sh.numel, payload, skip)
                mask = [e.has[slot] for slot in sh.slots]
                self.owner.local_push(b, e.clock, e.versions[r], payload, mask, record_event(self.device))
                continue
            fr, (codec, block, k, mask_len, body), payload = e.remote[r]
            finite = payload.finite and not skip
            self._count(b, e.clock, sh.numel, payload, skip)
            h = wire.Header(
                kind=wire.PUSH,
                sender=self.rank,
                clock=e.clock,
                version=e.versions[r],
                bucket=b,
                shard=r,
                codec=wire.CODEC_IDS[codec],
                numel=sh.numel,
                nbytes=0,
                k=k,
                block=block,
                flags=wire.FLAG_FINITE if finite else 0,
                count=mask_len,
            )
            wire.seal(fr.buf, h, body)
            if self.retain is not None:
                self.retain.keep((b, r), e.clock, fr.buf[: wire.HEADER_BYTES + body])
            self.transport.send_frame(fr, r, "push")
            self.bytes_sent += wire.HEADER_BYTES + body

    def _count(self, b: int, clock: int, numel: int, payload, skip: bool) -> None:
        if not payload.finite and not skip:
            self._nonfinite(b, clock)
        self.raw_bytes += 4 * numel
        self.enc_bytes += payload.nbytes
        self.pushes_sent += 1

    # -- control ------------------------------------------------------------------------------------
    def _ring(self, key: tuple, nbytes: int) -> FrameRing:
        ring = self.rings.get(key)
        if ring is None:
            ring = self.rings[key] = self.transport.frame_ring(nbytes, self.device)
        return ring

    def _control(self, msg: Control) -> None:
        """CLOSE / PAUSE / RESUME to every owner, after this rank's pushes (same flow, so in order)."""
        for r in range(self.n):
            if r == self.rank:
                continue
            fr = self._ring(("ctl", r), wire.HEADER_BYTES).take(self.timeout)
            h = wire.Header(
                kind=msg.kind,
                sender=self.rank,
                clock=msg.clock,
                version=0,
                bucket=0,
                shard=r,
                codec=0,
                numel=0,
                nbytes=0,
            )
            wire.seal(fr.buf, h, 0)
            self.transport.send_frame(fr, r, "push")
            self.bytes_sent += wire.HEADER_BYTES
        if msg.kind == wire.CLOSE:
            self.owner.local_close()
        else:
            self.owner.local_pause(msg.kind == wire.PAUSE)
