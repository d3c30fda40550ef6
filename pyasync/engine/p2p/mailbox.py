"""The worker's side of the replies: a receiver thread keeps the newest values of every shard in a
mailbox; ``install`` copies them into the parameters at step boundaries.

The mailbox holds at most one reply per shard (a newer version replaces an older one, whose receive
buffer goes back to the pool unless ``install`` is reading it right now). It also records, per shard,
the highest clock answered (what ``step()`` waits for) and the FINAL replies (what ``close()`` waits
for). The caller's condition variable guards all of it. With a lossy codec, replies are coded changes
that the receiver decodes on arrival into the values held of that shard (engine/core/replies.py); the
mailbox then points at those values, and ``install`` reads them under their lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from pyasync.engine import wire
from pyasync.engine.core.replies import HeldValues
from pyasync.engine.core.shards import BucketLayout
from pyasync.engine.core.streams import used_here, wait_event
from pyasync.engine.p2p.messages import Reply
from pyasync.ops import bucketing as ops_bucketing
from pyasync.transport.base import Transport, TransportClosed

__all__ = ["Mailbox"]


class Mailbox:
    """Replies of the shards ``keys`` ((bucket, owner) with elements) for one worker."""

    def __init__(
        self,
        *,
        rank: int,
        params: list[torch.Tensor],
        layouts: list[BucketLayout],
        keys: list[tuple[int, int]],
        spec: wire.WireSpec,
        transport: Transport | None,
        cond: threading.Condition,
        fail: Callable[[str, BaseException], None],
        coded: bool = False,
    ) -> None:
        self.rank = rank
        self.params, self.layouts, self.keys = params, layouts, keys
        self.spec, self.transport = spec, transport
        self.cond, self.fail = cond, fail
        self.device = params[0].device
        self.box: dict[tuple[int, int], Reply] = {}
        self.answered = {k: -1 for k in keys}  # highest clock answered per shard
        self.finals: set[tuple[int, int]] = set()
        self.installed_version = {k: 0 for k in keys}
        self.installed_clocks = {k: [-1] * spec.world_size for k in keys}
        self.reading: list[Reply] = []  # replies install() is reading (outside cond)
        self.orphans: list[Reply] = []  # replies superseded while being read
        self.departed: set[int] = set()  # owners that left the membership: nothing more is expected of them
        self.bytes_received = 0
        self.delivered = 0  # replies delivered so far (progress, for close()'s deadline)
        remote = {k for k in keys if k[1] != rank}
        self.expected = set(remote)  # FINAL replies the receiver still waits for
        # Coded replies (a lossy codec): the values held of each remote shard, changes decoded on receipt
        # (Note [Compressed replies on the point-to-point path] in engine/core/replies.py).
        self.held = HeldValues(params, layouts, remote) if coded and remote else None
        self.pool = (
            transport.recv_pool(spec.max_reply_frame(), 2 * len(keys) + 2, self.device)
            if transport is not None
            else None
        )
        self.thread = (
            threading.Thread(target=self._loop, name="pyasync-worker-recv", daemon=True) if remote else None
        )

    def start(self) -> None:
        if self.thread is not None:
            self.thread.start()

    # -- receiving ----------------------------------------------------------------------------------
    def _release(self, rep: Reply) -> None:
        """Give the buffer of a reply no longer in the box back to the pool, unless install() is reading
        it right now (then install gives it back). Caller holds cond."""
        if rep.frame is None:
            return
        if any(r is rep for r in self.reading):
            self.orphans.append(rep)
        else:
            self.pool.put(rep.frame)

    def deliver(self, rep: Reply) -> None:
        """A reply arrived (receiver thread, or this rank's own appliers)."""
        with self.cond:
            key = (rep.bucket, rep.shard)
            cur = self.box.get(key)
            if rep.final or cur is None or rep.version >= cur.version:
                self.box[key] = rep
                if cur is not None:
                    self._release(cur)
            else:
                self._release(rep)  # already superseded
            self.answered[key] = max(self.answered[key], rep.clock)
            if rep.final:
                self.finals.add(key)
            self.delivered += 1
            self.cond.notify_all()

    def depart(self, owners) -> None:
        """``owners`` left the membership: no answer or FINAL is expected from their shards (caller holds
        cond)."""
        self.departed |= set(owners)
        self.expected -= {k for k in self.expected if k[1] in self.departed}
        self.cond.notify_all()

    def _live(self) -> list[tuple[int, int]]:
        return [k for k in self.keys if k[1] not in self.departed]

    def _loop(self) -> None:
        expected_finals = self.expected
        try:
            while expected_finals:
                frame = self.pool.get()
                src = self.transport.recv_any(frame, "reply")
                h = wire.frame_header(frame, src)
                self.spec.check_reply(h)
                if self.layouts[h.bucket].shards[h.shard].numel == 0:
                    raise wire.WireError(f"REPLY from rank {src} for the empty shard of bucket {h.bucket}")
                self.bytes_received += wire.HEADER_BYTES + h.nbytes
                if self.held is not None:
                    values, clocks = self.held.take(h, wire.frame_body(frame, h))
                    self.pool.put(frame)  # decoded: the held values are the reply's
                    frame = None
                else:
                    values, clocks = wire.unpack_reply(wire.frame_body(frame, h), h)
                self.deliver(Reply(h.bucket, h.shard, h.version, h.clock, values, clocks, h.final, frame))
                if h.final:
                    expected_finals.discard((h.bucket, h.shard))
        except TransportClosed:
            return  # stopped on purpose (close after a failure)
        except BaseException as e:
            self.fail("worker reply receiver thread", e)

    # -- queries (caller holds cond) ----------------------------------------------------------------
    def all_answered(self, clock: int) -> bool:
        return all(self.answered[k] >= clock for k in self._live())

    def unanswered(self, clock: int) -> list[tuple[int, int]]:
        return [k for k in self._live() if self.answered[k] < clock]

    def all_final(self) -> bool:
        return all(k in self.finals for k in self._live())

    def not_final(self) -> list[tuple[int, int]]:
        return [k for k in self._live() if k not in self.finals]

    def min_included_clock(self, clock: int) -> int:
        with self.cond:
            clocks = list(self.installed_clocks.values())
        return min((min(c) for c in clocks), default=clock - 1)

    # -- installing (training thread) ---------------------------------------------------------------
    def install(self, final: bool = False) -> None:
        """Install the newest values received for every shard (all of them when final)."""
        with self.cond:
            todo = [
                (k, rep) for k, rep in self.box.items() if final or rep.version != self.installed_version[k]
            ]
            self.reading = [rep for _, rep in todo]  # their buffers stay out of the pool meanwhile
        try:
            with torch.no_grad():
                for (b, r), rep in todo:
                    lay = self.layouts[b]
                    dst = [self.params[p].data for p in lay.params]
                    if rep.frame is None and self.held is not None and r != self.rank:
                        with self.held.lock:  # the receiver decodes the next change into these values
                            ops_bucketing.unflatten(
                                rep.values.to(self.device), dst, lay.offsets, begin=lay.shards[r].begin
                            )
                    else:
                        wait_event(rep.event, self.device)
                        used_here([rep.values], self.device)
                        (values,), _ = (
                            self.transport.land([rep.values], self.device)
                            if self.transport is not None
                            else ([rep.values], False)
                        )
                        ops_bucketing.unflatten(values, dst, lay.offsets, begin=lay.shards[r].begin)
                    self.installed_version[(b, r)] = rep.version
                    self.installed_clocks[(b, r)] = list(rep.clocks)
        finally:
            with self.cond:
                self.reading = []
                for rep in self.orphans:
                    self.pool.put(rep.frame)
                self.orphans = []
