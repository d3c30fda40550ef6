"""Owner side: receive pushes, apply them to the shards this rank owns, answer the workers.

Threads (see docs/architecture.md, "Threads"):

* one *receiver* takes every push from the network: an any-source receive of one frame (header and
  payload) into a buffer of the largest push this rank can get, full validation of the header
  (wire.WireSpec), then a view of the payload; it routes the push to the applier of its bucket. CLOSE messages go to every applier.
* a few *appliers* (bucket b -> applier b % A): each alone owns the state of its shards, so the hot
  path takes no lock; pushes to different shards never wait on each other beyond the applier count.
  An applier decodes and applies (rule.UpdateRule), bumps the shard version, records staleness, and
  answers the workers whose wait condition is now met by copying the shard into a fresh frame per
  worker (a reply is never torn).

The worker of this rank pushes to its own shards through :meth:`Owner.local_push` (no network) and
gets its answers through a callback.

Note [Frame reuse]
    Buffers are reused across steps instead of being allocated per message: a fresh multi-megabyte
    tensor per message costs a page fault per 4 KiB the first time it is touched (bench/overlap.py
    counted 30-40 thousand minor faults per step per rank at 25 MB buckets), which is CPU time taken
    from backward. On the CPU path: the worker encodes each push straight into one of two frames per
    (bucket, shard) (wire.PushFrame) and an applier copies each reply into one of two frames per
    (bucket, worker) (wire.ReplyFrame); a frame is reused after waiting for its previous send (two
    messages ago, long done). Receive buffers come from a wire.FramePool: the owner's go back when
    the push has been applied, summed or dropped; the worker's when its reply leaves the mailbox and
    install() is not reading it. A buffer lost on an error path is simply garbage-collected.
"""

from __future__ import annotations

import datetime

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pyasync.engine import wire
from pyasync.engine.clock import wait_until
from pyasync.engine.rule import ShardState, UpdateRule
from pyasync.ops import codecs as ops_codecs
from pyasync.ops._common import Payload
from pyasync.policy import Policy
from pyasync.transport.base import Handle, Transport

__all__ = ["Owner", "Reply"]


@dataclass
class Reply:
    """Fresh values of one shard, as a worker receives them."""

    bucket: int
    shard: int
    version: int  # updates applied to the shard
    clock: int  # clock of the push this answers (-1: none)
    values: torch.Tensor  # fp32 shard values
    clocks: list[int]  # per worker: highest clock fully included in values
    final: bool = False  # the owner's last word on this shard (after every rank closed)
    frame: torch.Tensor | None = None  # the receive buffer values lives in (given back to its pool)


#: Sends a thread keeps in flight before it retires the oldest ones.
MAX_INFLIGHT = 64


def retire_sends(handles: list[Handle], timeout: datetime.timedelta) -> None:
    """Bound the sends a thread keeps in flight (and the buffers they pin): past MAX_INFLIGHT, wait for
    the oldest ones (sent at least MAX_INFLIGHT / 2 messages ago, so done or about to be) and drop them.

    Gloo's send handles report completion only through wait() (``is_completed`` stays False), so
    filtering on ``done()`` would never free a buffer and would rescan an ever longer list after every
    message. A peer that stopped receiving makes the wait raise TimeoutError naming it."""
    if len(handles) <= MAX_INFLIGHT:
        return
    cut = len(handles) - MAX_INFLIGHT // 2
    for h in handles[:cut]:
        h.wait(timeout)
    del handles[:cut]


class _Counters:
    def __init__(self) -> None:
        self.applied = 0
        self.dropped = 0
        self.nonfinite = 0
        self.updates = 0
        self.staleness: dict[int, int] = {}
        self.bytes_sent = 0

    def stale(self, s: int, count: int = 1) -> None:
        self.staleness[s] = self.staleness.get(s, 0) + count


class _Applier(threading.Thread):
    def __init__(self, owner: Owner, index: int) -> None:
        super().__init__(name=f"pyasync-applier-{index}", daemon=True)
        self.owner = owner
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.shards: dict[int, ShardState] = {}
        self.c = _Counters()
        self.handles: list[Handle] = []

    def run(self) -> None:
        try:
            while True:
                item = self.q.get()
                kind = item[0]
                if kind == "push":
                    _, b, w, clock, version, payload, mask, frame = item
                    self.owner._on_push(self, self.shards[b], w, clock, version, payload, mask, frame)
                    self.owner._progressed()
                elif kind == "close":
                    for s in self.shards.values():
                        self.owner._on_close(self, s, item[1])
                    self.owner._progressed()
                elif kind == "pause":
                    _, w, on = item
                    for s in self.shards.values():
                        self.owner._on_pause(self, s, w, on)
                    if not on:
                        self.owner._resumed(w)
                elif kind == "call":
                    _, fn, box, done = item
                    try:
                        box.append(fn(self))
                    except BaseException as e:  # noqa: BLE001 - handed back to the caller
                        box.append(e)
                    done.set()
                elif kind == "stop":
                    deadline = item[1]
                    for h in self.handles:
                        h.wait(deadline)
                    self.handles = []
                    return
                retire_sends(self.handles, self.owner.timeout)
        except BaseException as e:  # noqa: BLE001 - recorded; every wait of the engine raises it
            self.owner.fail(f"applier thread {self.name}", e)


class Owner:
    """The shards this rank owns, their appliers and the push receiver."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        layouts,
        masters: dict[int, torch.Tensor],
        policy: Policy,
        rule: UpdateRule,
        transport: Transport | None,
        spec: wire.WireSpec,
        deliver_local: Callable[[Reply], None],
        fail: Callable[[str, BaseException], None],
        num_appliers: int = 2,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
    ) -> None:
        self.rank, self.n = rank, world_size
        self.timeout = timeout  # for retiring sends (a peer that stopped receiving)
        self.policy, self.rule, self.transport, self.spec = policy, rule, transport, spec
        self.deliver_local = deliver_local
        self.fail = fail
        owned = [b for b, lay in enumerate(layouts) if lay.shards[rank].numel > 0]
        self.appliers = [_Applier(self, i) for i in range(max(1, min(num_appliers, len(owned))))]
        self.route: dict[int, _Applier] = {}
        for j, b in enumerate(owned):
            s = ShardState(layouts[b].shards[rank], masters[b], world_size)
            rule.init_state(s)
            a = self.appliers[j % len(self.appliers)]
            a.shards[b] = s
            self.route[b] = a
        self.receiver: threading.Thread | None = None
        self.bytes_received = 0
        # Push receive buffers, recycled: an applier gives a push's buffer back once it is summed or
        # applied (Note [Frame reuse]); sized by this rank's layout only.
        self.push_pool = wire.FramePool(spec.max_push_frame(), keep=2 * world_size * max(1, len(owned)))
        self.reply_frames: dict[tuple[int, int], list[wire.ReplyFrame]] = {}  # (bucket, worker) -> 2 frames
        # wait_processed() sleeps on `progress`; appliers notify it after each push while someone waits.
        self.progress = threading.Condition()
        self.watchers = 0
        self.resumes = [0] * world_size  # RESUMEs processed by every applier, per worker (see barrier)
        self._resume_parts: dict[int, int] = {}
        self.divisor = policy.divisor(world_size)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        for a in self.appliers:
            a.start()
        if self.n > 1:
            self.receiver = threading.Thread(target=self._recv_loop, name="pyasync-owner-recv", daemon=True)
            self.receiver.start()

    def local_push(self, b: int, clock: int, version: int, payload: Payload, mask: list[bool]) -> None:
        self.route[b].q.put(("push", b, self.rank, clock, version, payload, mask, None))

    def local_close(self) -> None:
        for a in self.appliers:
            a.q.put(("close", self.rank))

    def local_pause(self, on: bool) -> None:
        for a in self.appliers:
            a.q.put(("pause", self.rank, on))

    def call(self, fn: Callable, timeout) -> list:
        """Run fn(applier) on every applier thread (in its own thread, between pushes); results."""
        out = []
        for a in self.appliers:
            box: list = []
            done = threading.Event()
            a.q.put(("call", fn, box, done))
            if not done.wait(timeout.total_seconds()):
                raise TimeoutError(f"pyasync: applier {a.name} did not answer within {timeout}")
            if isinstance(box[0], BaseException):
                raise box[0]
            out.append(box[0])
        return out

    def stop(self, timeout) -> None:
        for a in self.appliers:
            if a.is_alive():
                a.q.put(("stop", timeout))
        for a in self.appliers:
            a.join(timeout.total_seconds())
        self.reply_frames = {}  # their handles hold gloo work objects, which keep the groups alive
        if self.receiver is not None:
            self.receiver.join(timeout.total_seconds())

    def _resumed(self, w: int) -> None:
        """One applier processed worker w's RESUME; when all have, count it and wake waiters."""
        with self.progress:
            k = self._resume_parts.get(w, 0) + 1
            if k == len(self.appliers):
                k = 0
                self.resumes[w] += 1
                self.progress.notify_all()
            self._resume_parts[w] = k

    def wait_resumed(self, count: int, timeout, error) -> None:
        """Block until every applier has processed ``count`` RESUMEs from every worker."""

        def what() -> str:
            late = [w for w in range(self.n) if self.resumes[w] < count]
            return f"RESUME from worker ranks {late} at rank {self.rank}'s owner (a rank left the barrier?)"

        with self.progress:
            wait_until(self.progress, lambda: min(self.resumes) >= count, timeout, what, error)

    def _on_pause(self, ap: _Applier, s: ShardState, w: int, on: bool) -> None:
        """Worker w waits in a barrier (on) or is back (off). While it waits, aggregate rounds do not
        wait for its push (it sends none): see Note [Barriers and quorums] in pyasync/optimizer.py."""
        s.paused[w] = on
        if on and self.policy.mode != "each":
            self._maybe_update(ap, s)

    def _progressed(self) -> None:
        if self.watchers:  # read without the lock: a waiter checks its condition under it before sleeping
            with self.progress:
                self.progress.notify_all()

    def behind(self, want: list[int]) -> list[tuple[int, int, int]]:
        """(bucket, worker, processed) of every owned shard that has processed fewer than want[worker]
        pushes from some worker (read without locks: each value only grows)."""
        return [
            (b, w, s.processed[w])
            for b, s in sorted(self.shards().items())
            for w in range(self.n)
            if s.processed[w] < want[w]
        ]

    def wait_processed(self, want: list[int], timeout, error) -> None:
        """Block until every owned shard has processed want[w] pushes from every worker w (pushes still
        on the network included); raises TimeoutError naming the shard and worker, or the engine's
        failure (``error()``) as an EngineError."""

        def what() -> str:
            late = self.behind(want)
            b, w, got = late[0]
            return (
                f"bucket {b}'s shard on rank {self.rank} to process the pushes of rank {w} "
                f"({got} of {want[w]} processed)"
            )

        with self.progress:
            self.watchers += 1
            try:
                wait_until(self.progress, lambda: not self.behind(want), timeout, what, error)
            finally:
                self.watchers -= 1

    def laggards(self, clock: int) -> list[int]:
        """Workers that, as this rank's shards see it, have not pushed what answering a push of
        ``clock`` needs (read without locks: for error messages only)."""
        need = clock - getattr(self.policy, "staleness", 0)
        out = set()
        for s in list(self.shards().values()):
            out.update(w for w in range(self.n) if not s.closed[w] and s.processed[w] <= need)
        return sorted(out)

    def unclosed(self) -> list[int]:
        """Workers this rank's shards have not seen close (for error messages only)."""
        return sorted({w for s in list(self.shards().values()) for w in range(self.n) if not s.closed[w]})

    def shards(self) -> dict[int, ShardState]:
        return {b: s for a in self.appliers for b, s in a.shards.items()}

    # -- receiver thread ---------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        remaining = set(range(self.n)) - {self.rank}
        try:
            while remaining:
                frame = self.push_pool.get()
                src = self.transport.recv_any(frame, "push")
                h = wire.frame_header(frame, src)
                if h.kind in wire.CONTROL_KINDS:
                    self.spec.check_close(h)
                    self.bytes_received += wire.HEADER_BYTES
                    if h.kind != wire.CLOSE:
                        for a in self.appliers:
                            a.q.put(("pause", src, h.kind == wire.PAUSE))
                        continue
                    if src not in remaining:
                        raise wire.WireError(f"rank {src} sent CLOSE twice")
                    remaining.discard(src)
                    for a in self.appliers:
                        a.q.put(("close", src))
                    continue
                self.spec.check_push(h)
                if h.bucket not in self.route:
                    raise wire.WireError(
                        f"PUSH from rank {src} for bucket {h.bucket}, whose shard {self.rank} is empty"
                    )
                self.bytes_received += wire.HEADER_BYTES + h.nbytes
                payload, mask_t = wire.unpack_push(wire.frame_body(frame, h), h)
                mask = mask_t.tolist()
                if any(m not in (0, 1) for m in mask):
                    raise wire.WireError(
                        f"PUSH from rank {src} for bucket {h.bucket} has mask bytes other than 0/1"
                    )
                s = self.route[h.bucket].shards[h.bucket]
                if s.master.device.type != "cpu":
                    frame = None  # the payload is copied to the device below; the frame is not kept
                    payload = Payload(
                        payload.codec,
                        payload.n,
                        *[
                            None if t is None else t.to(s.master.device)
                            for t in (payload.codes, payload.scales, payload.indices)
                        ],
                        k=payload.k,
                        block=payload.block,
                        finite=payload.finite,
                    )
                self.route[h.bucket].q.put(
                    ("push", h.bucket, src, h.clock, h.version, payload, [bool(m) for m in mask], frame)
                )
        except BaseException as e:  # noqa: BLE001 - recorded; every wait of the engine raises it
            self.fail("owner receiver thread", e)

    # -- applier logic (runs in the shard's applier thread) -----------------------------------------
    def _on_push(
        self,
        ap: _Applier,
        s: ShardState,
        w: int,
        clock: int,
        version: int,
        payload: Payload,
        mask: list[bool],
        frame: torch.Tensor | None = None,
    ) -> None:
        """One push from worker w. ``frame``: the receive buffer the payload lives in, given back to
        the pool once the payload has been applied, summed or dropped."""
        b = s.bucket
        if s.closed[w]:
            raise wire.WireError(f"PUSH from rank {w} for bucket {b} arrived after its CLOSE")
        if clock != s.processed[w]:
            raise wire.WireError(
                f"PUSH from rank {w} for bucket {b} has clock {clock}, expected {s.processed[w]} "
                "(a push was lost, duplicated or reordered)"
            )
        if version > s.version:
            raise wire.WireError(
                f"PUSH from rank {w} for bucket {b} was computed on version {version}, but the "
                f"shard is only at version {s.version}"
            )
        s.processed[w] = clock + 1
        pol = self.policy
        if pol.mode == "each":
            if not payload.finite:
                ap.c.nonfinite += 1
            else:
                stale = s.version - version
                self.rule.apply(
                    s, payload=payload, grad_scale=1.0 / self.n, seg_mask=mask, lr_factor=pol.lr_factor(stale)
                )
                s.version += 1
                ap.c.applied += 1
                ap.c.updates += 1
                ap.c.stale(stale)
            self.push_pool.put(frame)
            s.pending[w] = clock
            self._answer_each(ap, s)
            return
        # Aggregate modes: BSP, Quorum.
        if pol.is_late(version, s.version):
            if not payload.finite:
                ap.c.nonfinite += 1
            elif getattr(pol, "late", "drop") == "fold":
                self._accumulate(s, payload, mask)
                s.fold_stale.append(s.version - version)
            else:
                ap.c.dropped += 1
            self.push_pool.put(frame)
            self._reply(ap, s, [(w, clock)])  # superseded: catch up at once
            return
        if not payload.finite:
            ap.c.nonfinite += 1  # counts as zeros in the mean
            s.agg_held[w] = None
            self.push_pool.put(frame)
        else:
            s.agg_held[w] = (payload, frame)
            s.agg_fresh += 1
            self._union_mask(s, mask)
        self._sum_in_order(s)
        s.pushers.add(w)
        s.pending[w] = clock
        self._maybe_update(ap, s)

    def _union_mask(self, s: ShardState, mask: list[bool]) -> None:
        for i, m in enumerate(mask):
            s.agg_mask[i] = s.agg_mask[i] or m

    def _accumulate(self, s: ShardState, payload: Payload, mask: list[bool] | None = None) -> None:
        if s.agg is None:
            s.agg = torch.zeros_like(s.master)
        ops_codecs.decode(payload, out=s.agg, alpha=1.0 / self.divisor, accumulate=True)
        if mask is not None:
            self._union_mask(s, mask)

    def _sum_in_order(self, s: ShardState, flush: bool = False) -> None:
        """Sum the held fresh pushes into agg in rank order.

        Note [Rank-order sum]
            fp32 addition is not associative, so an aggregate summed in arrival order differs in the
            last bits from run to run, and a BSP run resumed from a checkpoint would not be
            bit-identical to an uninterrupted one. Fresh pushes are therefore held until every lower
            rank has pushed (or closed) and summed in ascending rank order as soon as they can be, so
            most of the decoding still overlaps the wait for the last push. Under Quorum the round's
            pushers are not known in advance: what is still held when the update fires (``flush``)
            is summed then, again in ascending rank order, so the sum's order depends only on who
            pushed. Late pushes folded under Quorum(late="fold") go in on arrival."""
        while s.agg_next < self.n:
            w = s.agg_next
            if w in s.agg_held:
                self._sum_held(s, s.agg_held.pop(w))
            elif not s.closed[w]:
                break
            s.agg_next += 1
        if flush:
            for w in sorted(s.agg_held):
                self._sum_held(s, s.agg_held.pop(w))

    def _sum_held(self, s: ShardState, held) -> None:
        if held is not None:
            payload, frame = held
            self._accumulate(s, payload)
            self.push_pool.put(frame)

    def _maybe_update(self, ap: _Applier, s: ShardState, force: bool = False) -> None:
        closed = {w for w in range(self.n) if s.closed[w] or s.paused[w]}
        if not force and not (s.pushers and self.policy.update_ready(s.pushers, closed, self.n)):
            return
        self._sum_in_order(s, flush=True)
        s.agg_next = 0
        if s.agg_fresh or s.fold_stale:
            self.rule.apply(s, dense=s.agg, seg_mask=s.agg_mask)
            s.version += 1
            ap.c.updates += 1
            ap.c.applied += s.agg_fresh + len(s.fold_stale)
            if s.agg_fresh:
                ap.c.stale(0, s.agg_fresh)
            for st in s.fold_stale:
                ap.c.stale(st)
        if s.agg is not None:
            s.agg.zero_()
        s.agg_mask = [False] * len(s.agg_mask)
        s.pushers, s.agg_fresh, s.fold_stale = set(), 0, []
        waiters = sorted(s.pending.items())
        s.pending.clear()
        if waiters:
            self._reply(ap, s, waiters)

    def _reply_frame(self, s: ShardState, w: int) -> wire.ReplyFrame:
        """The send buffer for this reply of shard s to worker w (applier thread; CPU): two per (shard,
        worker), used in turn; the one taken carried the reply before last, whose send is waited for
        (long done, unless worker w stopped receiving: then a TimeoutError naming it)."""
        ring = self.reply_frames.get((s.bucket, w))
        if ring is None:
            ring = self.reply_frames[(s.bucket, w)] = [wire.ReplyFrame(s.master.numel(), self.n) for _ in range(2)]
        return wire.next_frame(ring, self.timeout)

    def _answer_each(self, ap: _Applier, s: ShardState) -> None:
        included = [p - 1 for p in s.processed]
        ready = [
            (w, t) for w, t in sorted(s.pending.items()) if self.policy.answer_now(t, included, s.closed)
        ]
        for w, _ in ready:
            del s.pending[w]
        if ready:
            self._reply(ap, s, ready)

    def _on_close(self, ap: _Applier, s: ShardState, w: int) -> None:
        if s.closed[w]:
            raise wire.WireError(f"rank {w} closed twice")
        s.closed[w] = True
        if self.policy.mode == "each":
            self._answer_each(ap, s)
        else:
            self._sum_in_order(s)  # the sum may have been waiting for this rank's turn
            self._maybe_update(ap, s)
        if all(s.closed) and not s.finalized:
            if self.policy.mode != "each" and (s.agg_fresh or s.fold_stale or s.pending):
                self._maybe_update(ap, s, force=True)  # apply whatever is outstanding
            if s.pending:
                self._answer_each(ap, s)
            s.finalized = True
            self._reply(ap, s, [(w2, s.processed[w2] - 1) for w2 in range(self.n)], final=True)

    def _reply(self, ap: _Applier, s: ShardState, dests: list[tuple[int, int]], final: bool = False) -> None:
        clocks = [p - 1 for p in s.processed]
        remote = [(w, c) for w, c in dests if w != self.rank]
        if remote:
            cpu = s.master.device.type == "cpu"
            host = wire.to_host(s.master)  # each frame is a copy: a send never sees a later update
            clocks_t = torch.tensor(clocks, dtype=torch.int64)
            for w, c in remote:
                h = wire.Header(
                    kind=wire.REPLY,
                    sender=self.rank,
                    clock=c,
                    version=s.version,
                    bucket=s.bucket,
                    shard=self.rank,
                    codec=0,
                    numel=s.master.numel(),
                    nbytes=0,  # set when the frame is written
                    flags=wire.FLAG_FINAL if final else 0,
                    count=self.n,
                )
                if cpu:
                    fr = self._reply_frame(s, w)
                    frame = fr.fill(h, host, clocks_t)
                else:
                    fr, frame = None, wire.pack_reply(host, clocks, header=h)
                handle = self.transport.send(frame, w, "reply")
                if fr is not None:
                    fr.handle = handle
                ap.handles.append(handle)
                ap.c.bytes_sent += frame.numel()
        local = [c for w, c in dests if w == self.rank]
        if local:
            values = s.master.clone()
            if values.device.type == "cuda":  # the installing thread may use another stream
                torch.cuda.current_stream(values.device).synchronize()
            self.deliver_local(
                Reply(
                    bucket=s.bucket,
                    shard=self.rank,
                    version=s.version,
                    clock=local[0],
                    values=values,
                    clocks=list(clocks),
                    final=final,
                )
            )
