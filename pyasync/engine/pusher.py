"""The push thread of a worker: flatten each ready bucket, compress its shard slices with error feedback
and push slice r to owner r (own shard: in-process; others: one frame, header + payload).

Each slice is encoded straight into a reused send frame of the transport (Note [Frame reuse] in
pyasync/transport/frames.py); on a device, the thread runs its kernels on a side stream that waits
for the event the hook recorded, and hands its own shard's payload to the local applier with an
event of its own (engine/streams.py).
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable

import torch

from pyasync.engine import wire
from pyasync.engine.messages import BucketReady, Control, Stop
from pyasync.engine.owner import Owner
from pyasync.engine.shards import BucketLayout
from pyasync.engine.streams import on_stream, record_event, side_stream, wait_event
from pyasync.ops import bucketing as ops_bucketing
from pyasync.transport.base import Transport
from pyasync.transport.frames import FrameRing

__all__ = ["Pusher"]


class Pusher(threading.Thread):
    """Takes BucketReady, Control and Stop messages from ``q``; counts what it sent."""

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
        packed: Callable[[], None],
        nonfinite: Callable[[int, int], None],
        fail: Callable[[str, BaseException], None],
    ) -> None:
        super().__init__(name="pyasync-push", daemon=True)
        self.rank, self.n = rank, world_size
        self.layouts = layouts
        self.comp = compressor
        self.transport = transport
        self.owner = owner
        self.device = device
        self.timeout = timeout
        self._packed, self._nonfinite, self._fail = packed, nonfinite, fail
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.flat = [torch.empty(lay.numel, dtype=torch.float32, device=device) for lay in layouts]
        self.stream = side_stream(device)
        self.rings: dict[tuple, FrameRing] = {}  # (bucket, shard) or ("ctl", rank) -> send frames
        self.bytes_sent = 0
        self.raw_bytes = 0  # fp32 bytes of the slices pushed
        self.enc_bytes = 0  # their encoded bytes
        self.pushes_sent = 0

    def flatten(self, b: int, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """Bucket b's flat fp32 buffer, filled from ``tensors`` (None: zeros)."""
        lay = self.layouts[b]
        if lay.numel:
            ops_bucketing.flatten(tensors, self.flat[b], lay.offsets, numels=lay.numels)
        return self.flat[b]

    # -- the thread ---------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while True:
                msg = self.q.get()
                if isinstance(msg, BucketReady):
                    with on_stream(self.stream):
                        wait_event(msg.event, self.device)
                        self._push_bucket(msg)
                    self._packed()
                elif isinstance(msg, Control):
                    self._control(msg)
                elif isinstance(msg, Stop):
                    for ring in self.rings.values():
                        ring.drain(msg.timeout)
                    self.rings = {}  # their handles hold transport work objects, which keep groups alive
                    return
                else:
                    raise TypeError(f"push thread got an unknown message {type(msg).__name__}")
        except BaseException as e:  # noqa: BLE001 - recorded; every wait of the engine raises it
            self._fail("push thread", e)

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
            h = wire.Header(kind=msg.kind, sender=self.rank, clock=msg.clock, version=0, bucket=0, shard=r,
                            codec=0, numel=0, nbytes=0)
            wire.seal(fr.buf, h, 0)
            self.transport.send_frame(fr, r, "push")
            self.bytes_sent += wire.HEADER_BYTES
        if msg.kind == wire.CLOSE:
            self.owner.local_close()
        else:
            self.owner.local_pause(msg.kind == wire.PAUSE)

    def _push_bucket(self, msg: BucketReady) -> None:
        b, lay = msg.bucket, self.layouts[msg.bucket]
        flat = self.flatten(b, msg.grads)
        has = [g is not None for g in msg.grads]
        for r, sh in enumerate(lay.shards):
            if sh.numel == 0:
                continue
            mask = [has[slot] for slot in sh.slots]
            codec, block, k = self.comp.wire_params(sh.numel)
            if r == self.rank:
                payload = self.comp.compress(flat[sh.begin : sh.end], key=(b, r))  # fresh: the applier's now
                self._count(b, msg.clock, sh.numel, payload)
                self.owner.local_push(b, msg.clock, msg.versions[r], payload, mask, record_event(self.device))
                continue
            nbytes = wire.HEADER_BYTES + wire.push_parts(codec, sh.numel, block, k, len(mask))[1]
            fr = self._ring((b, r), nbytes).take(self.timeout)
            if fr.views is None:
                fr.views = wire.push_views(fr.buf, codec, sh.numel, block, k, len(mask))
            out, mask_v, body = fr.views
            payload = self.comp.compress(flat[sh.begin : sh.end], key=(b, r), out=out)
            self._count(b, msg.clock, sh.numel, payload)
            mask_v.copy_(torch.tensor(mask, dtype=torch.uint8))
            h = wire.Header(kind=wire.PUSH, sender=self.rank, clock=msg.clock, version=msg.versions[r], bucket=b,
                            shard=r, codec=wire.CODEC_IDS[codec], numel=sh.numel, nbytes=0, k=k, block=block,
                            flags=wire.FLAG_FINITE if payload.finite else 0, count=len(mask))
            wire.seal(fr.buf, h, body)
            self.transport.send_frame(fr, r, "push")
            self.bytes_sent += wire.HEADER_BYTES + body

    def _count(self, b: int, clock: int, numel: int, payload) -> None:
        if not payload.finite:
            self._nonfinite(b, clock)
        self.raw_bytes += 4 * numel
        self.enc_bytes += payload.nbytes
        self.pushes_sent += 1
