"""Worker side of the engine: gradient hooks, the push thread, the reply receiver, waiting and
installing. The Engine also owns this rank's Owner (owner.py) and is what DistributedOptimizer drives.

Flow of one step (clock t), see docs/architecture.md:

1. backward: a post-accumulate-grad hook marks a parameter ready; the last parameter of a bucket
   hands the bucket to the push thread at once.
2. push thread: flatten the bucket's gradients into a flat fp32 buffer (ops.bucketing.flatten),
   compress each shard slice with its own error-feedback key (bucket, shard), and push slice r to
   owner r (own shard: in-process; others: one frame, header + payload, on the push flow).
3. step(): flush the buckets whose parameters got no gradient (zeros + a has-grad mask), wait until all
   buckets are pushed, then wait as the policy says for the owners' answers (timeout), and install the
   newest shard values received (ops.bucketing.unflatten into the parameters, any dtype).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import threading
import traceback
from collections.abc import Iterator

import torch

from pyasync.engine import wire
from pyasync.engine.clock import EngineError, wait_until
from pyasync.engine.owner import Owner, Reply, retire_sends
from pyasync.engine.rule import UpdateRule
from pyasync.engine.shards import BucketLayout
from pyasync.engine.stats import Stats
from pyasync.ops import bucketing as ops_bucketing
from pyasync.ops._common import Payload
from pyasync.policy import Policy
from pyasync.transport.base import Handle, Transport

__all__ = ["Engine", "NonFiniteGradientError"]

_log = logging.getLogger("pyasync")


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN/Inf under ``on_nonfinite="raise"``. The push was skipped by its owners (never
    applied) and the step completed, so training may go on after handling it."""


def _clone_payload(p: Payload) -> Payload:
    return Payload(
        codec=p.codec,
        n=p.n,
        codes=p.codes.clone(),
        scales=None if p.scales is None else p.scales.clone(),
        indices=None if p.indices is None else p.indices.clone(),
        k=p.k,
        block=p.block,
        finite=p.finite,
    )


def _dense(g: torch.Tensor) -> torch.Tensor:
    """A contiguous dense copy of a sparse or strided gradient (flatten needs contiguous tensors)."""
    if g.layout != torch.strided:
        g = g.to_dense()
    return g if g.is_contiguous() else g.contiguous()


class Engine:
    """One rank's worker and owner. Not thread-safe for the caller: drive it from one thread."""

    def __init__(
        self,
        *,
        params: list[torch.Tensor],
        layouts: list[BucketLayout],
        policy: Policy,
        compressor,
        rule: UpdateRule,
        transport: Transport | None,
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        spec: wire.WireSpec,
        num_appliers: int = 2,
        names: list[str] | None = None,
        on_nonfinite: str = "skip",
    ) -> None:
        self.params = params
        self.names = names if names is not None else [f"param{i}" for i in range(len(params))]
        self.on_nonfinite = on_nonfinite
        self.nonfinite: list[tuple[int, int]] = []  # (bucket, clock) of non-finite pushes not yet raised
        self.nonfinite_logged = False
        self.layouts = layouts
        self.policy = policy
        self.comp = compressor
        self.transport = transport
        self.rank, self.n = rank, world_size
        self.timeout = timeout
        self.spec = spec
        self.device = params[0].device if params else torch.device("cpu")
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.error_where = ""
        self.nonempty = [
            (b, r) for b, lay in enumerate(layouts) for r in range(world_size) if lay.shards[r].numel > 0
        ]
        self.param_bucket: dict[int, tuple[int, int]] = {}  # param index -> (bucket, slot)
        for b, lay in enumerate(layouts):
            for slot, p in enumerate(lay.params):
                self.param_bucket[p] = (b, slot)
        # Worker state (main thread, plus `cond` for what threads share).
        self.clock = 0
        self.mailbox: dict[tuple[int, int], Reply] = {}
        # Reply receive buffers, recycled (see _release): the newest reply per shard keeps its buffer.
        self.reply_pool = wire.FramePool(spec.max_reply_frame(), keep=2 * len(self.nonempty) + 2)  # layout-sized
        self.reading: list[Reply] = []  # replies install() is reading (outside cond)
        self.orphans: list[Reply] = []  # replies superseded while being read
        self.answered = {k: -1 for k in self.nonempty}
        self.finals: set[tuple[int, int]] = set()
        self.installed_version = {k: 0 for k in self.nonempty}
        self.installed_clocks = {k: [-1] * world_size for k in self.nonempty}
        self.enqueued: set[int] = set()  # buckets handed to the push thread this clock
        self.ready: dict[int, set[int]] = {b: set() for b in range(len(layouts))}
        self.packed = 0  # buckets of this clock the push thread has finished
        self.late_grad: str | None = None
        self.no_sync = False
        self.closed = False
        self.wait_seconds = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.raw_bytes = 0
        self.enc_bytes = 0
        self.pushes_sent = 0
        self.flat = [torch.empty(lay.numel, dtype=torch.float32, device=self.device) for lay in layouts]
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Owner: master shards from the current (agreed, broadcast) parameter values.
        masters = {}
        for b, lay in enumerate(layouts):
            sh = lay.shards[rank]
            if sh.numel > 0:
                self._flatten(b, [params[p].detach() for p in lay.params])
                masters[b] = self.flat[b][sh.begin : sh.end].clone()
        self.owner = Owner(
            rank=rank,
            world_size=world_size,
            layouts=layouts,
            masters=masters,
            policy=policy,
            rule=rule,
            transport=transport,
            spec=spec,
            deliver_local=self._deliver,
            fail=self.fail,
            num_appliers=num_appliers,
            timeout=timeout,
        )
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.handles: list[Handle] = []
        self.push_frames: dict[tuple[int, int], list[wire.PushFrame]] = {}  # see _push_frame
        self.hooks = []
        for i, p in enumerate(params):
            if i in self.param_bucket:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))
        self.pusher = threading.Thread(target=self._push_loop, name="pyasync-push", daemon=True)
        remote_final = [k for k in self.nonempty if k[1] != rank]
        self.receiver = (
            threading.Thread(
                target=self._reply_loop, args=(set(remote_final),), name="pyasync-worker-recv", daemon=True
            )
            if remote_final
            else None
        )
        self.owner.start()
        self.pusher.start()
        if self.receiver is not None:
            self.receiver.start()

    # -- errors ------------------------------------------------------------------------------------
    def fail(self, where: str, e: BaseException) -> None:
        """Record a background failure (first one wins) and wake every waiter."""
        with self.cond:
            if self.error is None:
                self.error = e
                self.error_where = where
                e.args = (f"{where}: {e}",) if not e.args else (f"{where}: {e.args[0]}", *e.args[1:])
                self.error_trace = traceback.format_exc()
            self.cond.notify_all()

    def _err(self) -> BaseException | None:
        return self.error

    def check(self) -> None:
        if self.error is not None:
            raise EngineError(f"pyasync engine failed: {self.error}") from self.error

    # -- hooks -------------------------------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._grad_ready(i)

        return hook

    def _grad_ready(self, i: int) -> None:
        if self.no_sync or self.closed:
            return
        b, slot = self.param_bucket[i]
        with self.cond:
            if b in self.enqueued:
                self.late_grad = (
                    f"parameter {i} got a gradient after its bucket {b} was already pushed in this "
                    "step (several backward() calls per step?); accumulate inside "
                    "`with opt.no_sync():` and leave the last backward() outside it"
                )
                return
            self.ready[b].add(slot)
            if len(self.ready[b]) == len(self.layouts[b].params):
                self._enqueue(b)

    def _enqueue(self, b: int) -> None:
        """Hand bucket b of the current clock to the push thread (caller holds cond)."""
        lay = self.layouts[b]
        grads = [self.params[p].grad for p in lay.params]
        has = [g is not None for g in grads]
        grads = [None if g is None else _dense(g) for g in grads]
        versions = {r: self.installed_version.get((b, r), 0) for r in range(self.n)}
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.enqueued.add(b)
        self.q.put(("bucket", b, self.clock, grads, has, versions, event))

    # -- push thread -------------------------------------------------------------------------------
    def _flatten(self, b: int, tensors: list[torch.Tensor | None]) -> None:
        lay = self.layouts[b]
        if lay.numel:
            ops_bucketing.flatten(tensors, self.flat[b], lay.offsets, numels=lay.numels)

    def _push_loop(self) -> None:
        try:
            while True:
                item = self.q.get()
                if item[0] == "stop":
                    for h in self.handles:
                        h.wait(item[1])
                    self.handles = []
                    self.push_frames = {}  # their handles hold gloo work objects, which keep the groups alive
                    return
                if item[0] in ("close", "pause"):
                    kind = wire.CLOSE if item[0] == "close" else (wire.PAUSE if item[2] else wire.RESUME)
                    for r in range(self.n):
                        if r != self.rank:
                            hdr = wire.encode_header(
                                wire.Header(
                                    kind=kind,
                                    sender=self.rank,
                                    clock=item[1],
                                    version=0,
                                    bucket=0,
                                    shard=r,
                                    codec=0,
                                    numel=0,
                                    nbytes=0,
                                )
                            ).view(torch.uint8)
                            self.handles.append(self.transport.send(hdr, r, "push"))
                            self.bytes_sent += hdr.numel()
                    if item[0] == "close":
                        self.owner.local_close()
                    else:
                        self.owner.local_pause(item[2])
                    continue
                _, b, clock, grads, has, versions, event = item
                if self.side_stream is not None:
                    with torch.cuda.stream(self.side_stream):
                        self.side_stream.wait_event(event)
                        self._push_bucket(b, clock, grads, has, versions)
                else:
                    self._push_bucket(b, clock, grads, has, versions)
                retire_sends(self.handles, self.timeout)
                with self.cond:
                    self.packed += 1
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - recorded; every wait of the engine raises it
            self.fail("push thread", e)

    def _push_frame(self, b: int, r: int) -> wire.PushFrame | None:
        """The send buffer for this step's push to shard (b, r) (CPU only): two per shard, used in turn;
        the one taken was last sent two steps ago, and that send is waited for (long done, unless the
        owner stopped receiving: then a TimeoutError naming it) before it is overwritten."""
        ring = self.push_frames.get((b, r))
        if ring is None:
            return None  # the first push sizes the ring (see _push_bucket)
        return wire.next_frame(ring, self.timeout)

    def _push_bucket(self, b: int, clock: int, grads, has, versions) -> None:
        lay = self.layouts[b]
        self._flatten(b, grads)
        cpu = self.device.type == "cpu"
        for r in range(self.n):
            sh = lay.shards[r]
            if sh.numel == 0:
                continue
            fr = self._push_frame(b, r) if cpu and r != self.rank else None
            payload = self.comp.compress(
                self.flat[b][sh.begin : sh.end], key=(b, r), out=None if fr is None else fr.payload
            )
            if not payload.finite:
                self._on_nonfinite(b, clock)
            mask = [has[slot] for slot in sh.slots]
            self.raw_bytes += 4 * sh.numel
            self.enc_bytes += payload.nbytes
            self.pushes_sent += 1
            if r == self.rank:
                if cpu:
                    local = payload  # a fresh payload (compress allocated it), owned by the applier now
                else:
                    local = _clone_payload(payload)
                    # The applier runs on another stream: the copy must be complete before it is queued.
                    torch.cuda.current_stream(local.device).synchronize()
                self.owner.local_push(b, clock, versions[r], local, mask)
                continue
            h = wire.Header(
                kind=wire.PUSH,
                sender=self.rank,
                clock=clock,
                version=versions[r],
                bucket=b,
                shard=r,
                codec=wire.CODEC_IDS[payload.codec],
                numel=sh.numel,
                nbytes=0,  # set by seal / pack_push
                k=payload.k,
                block=payload.block,
                flags=wire.FLAG_FINITE if payload.finite else 0,
                count=len(mask),
            )
            mask_t = torch.tensor(mask, dtype=torch.uint8)
            if fr is not None:
                fr.mask.copy_(mask_t)
                frame = fr.seal(h)
            else:
                frame = wire.pack_push(payload, mask_t.to(payload.device), header=h)
                frame = wire.to_host(frame)  # pinned host staging for gloo (CUDA), no-op on CPU
                if cpu:  # from now on this shard's pushes are encoded straight into two reused frames
                    self.push_frames[(b, r)] = [
                        wire.PushFrame(payload.codec, payload.n, payload.block, payload.k, len(mask)) for _ in range(2)
                    ]
            handle = self.transport.send(frame, r, "push")
            if fr is not None:
                fr.handle = handle
            self.handles.append(handle)
            self.bytes_sent += frame.numel()

    def _nonfinite_text(self, b: int, clock: int) -> str:
        names = [self.names[p] for p in self.layouts[b].params]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        return (
            f"non-finite gradient (NaN or Inf) in bucket {b} at step {clock} on rank {self.rank} "
            f"(parameters: {shown})"
        )

    def _on_nonfinite(self, b: int, clock: int) -> None:
        """A shard of bucket b held NaN/Inf (push thread): the owners skip that push. Log once per rank;
        under on_nonfinite="raise", step() raises it."""
        with self.cond:
            if (b, clock) in self.nonfinite:
                return
            self.nonfinite.append((b, clock))
            first = not self.nonfinite_logged
            self.nonfinite_logged = True
        if first:
            _log.warning(
                "pyasync: %s; the push is skipped, not applied (counted in stats().nonfinite_skipped; "
                "logged once per rank)",
                self._nonfinite_text(b, clock),
            )

    # -- replies -----------------------------------------------------------------------------------
    def _release(self, rep: Reply) -> None:
        """Give the receive buffer of a reply no longer in the mailbox back to the pool, unless install()
        is reading it right now (then install gives it back). Caller holds cond."""
        if rep.frame is None:
            return
        if any(r is rep for r in self.reading):
            self.orphans.append(rep)
        else:
            self.reply_pool.put(rep.frame)

    def _deliver(self, rep: Reply) -> None:
        with self.cond:
            key = (rep.bucket, rep.shard)
            cur = self.mailbox.get(key)
            if rep.final or cur is None or rep.version >= cur.version:
                self.mailbox[key] = rep
                if cur is not None:
                    self._release(cur)
            else:
                self._release(rep)  # already superseded
            self.answered[key] = max(self.answered[key], rep.clock)
            if rep.final:
                self.finals.add(key)
            self.cond.notify_all()

    def _reply_loop(self, expected_finals: set) -> None:
        try:
            while expected_finals:
                frame = self.reply_pool.get()
                src = self.transport.recv_any(frame, "reply")
                h = wire.frame_header(frame, src)
                self.spec.check_reply(h)
                if self.layouts[h.bucket].shards[h.shard].numel == 0:
                    raise wire.WireError(f"REPLY from rank {src} for the empty shard of bucket {h.bucket}")
                self.bytes_received += wire.HEADER_BYTES + h.nbytes
                values, clocks = wire.unpack_reply(wire.frame_body(frame, h), h)
                self._deliver(
                    Reply(
                        bucket=h.bucket,
                        shard=h.shard,
                        version=h.version,
                        clock=h.clock,
                        values=values,
                        clocks=clocks,
                        final=h.final,
                        frame=frame,
                    )
                )
                if h.final:
                    expected_finals.discard((h.bucket, h.shard))
        except BaseException as e:  # noqa: BLE001 - recorded; every wait of the engine raises it
            self.fail("worker reply receiver thread", e)

    # -- step --------------------------------------------------------------------------------------
    def _missing(self, keys) -> str:
        owners = sorted({r for _, r in keys})
        buckets = sorted({b for b, _ in keys})
        return f"owner ranks {owners} (buckets {buckets[:8]}{'...' if len(buckets) > 8 else ''})"

    def _missing_answers(self, t: int) -> str:
        missing = self._missing([k for k in self.nonempty if self.answered[k] < t])
        text = f"answers to the pushes of step {t} from {missing}"
        lag = self.owner.laggards(t)
        if lag:
            text += f"; this rank's shards are still waiting for pushes from worker ranks {lag}"
        return text

    def _missing_finals(self) -> str:
        text = "every rank to close: final values missing from " + self._missing(
            [k for k in self.nonempty if k not in self.finals]
        )
        late = self.owner.unclosed()
        if late:
            text += f"; this rank's shards have not seen worker ranks {late} close"
        return text

    def step(self) -> None:
        """Push whatever is not pushed yet, wait as the policy says, install fresh values."""
        if self.closed:
            raise RuntimeError("step() called after close(); create a new DistributedOptimizer")
        self.check()
        if self.late_grad is not None:
            msg, self.late_grad = self.late_grad, None
            raise RuntimeError(f"pyasync: {msg}")
        t = self.clock
        nb = len(self.layouts)
        with self.cond:
            for b in range(nb):
                if b not in self.enqueued:
                    self._enqueue(b)
            self.wait_seconds += wait_until(
                self.cond,
                lambda: self.packed >= nb,
                self.timeout,
                lambda: f"the push thread to send the {nb - self.packed} remaining buckets of step {t}",
                self._err,
            )
            if self.policy.worker_waits:
                self.wait_seconds += wait_until(
                    self.cond,
                    lambda: all(self.answered[k] >= t for k in self.nonempty),
                    self.timeout,
                    lambda: self._missing_answers(t),
                    self._err,
                )
            self.enqueued = set()
            self.packed = 0
            for b in range(nb):
                self.ready[b] = set()
            self.clock = t + 1
            bad = [(b, c) for b, c in self.nonfinite if c == t]
            self.nonfinite = []
        self.install()
        if bad and self.on_nonfinite == "raise":
            raise NonFiniteGradientError(
                "pyasync: " + "; ".join(self._nonfinite_text(b, c) for b, c in bad)
                + "; the push was skipped (not applied) and the step completed. Fix the loss or lower the "
                "learning rate, or pass on_nonfinite='skip' to skip such pushes silently"
            )

    def install(self, final: bool = False) -> None:
        """Install the newest values received for every shard (all of them when final)."""
        with self.cond:
            todo = [
                (k, rep)
                for k, rep in self.mailbox.items()
                if final or rep.version != self.installed_version[k]
            ]
            self.reading = [rep for _, rep in todo]  # their buffers stay out of the pool meanwhile
        try:
            with torch.no_grad():
                for (b, r), rep in todo:
                    lay = self.layouts[b]
                    values = rep.values if rep.values.device == self.device else rep.values.to(self.device)
                    ops_bucketing.unflatten(
                        values, [self.params[p].data for p in lay.params], lay.offsets, begin=lay.shards[r].begin
                    )
                    self.installed_version[(b, r)] = rep.version
                    self.installed_clocks[(b, r)] = list(rep.clocks)
        finally:
            with self.cond:
                self.reading = []
                for rep in self.orphans:
                    self.reply_pool.put(rep.frame)
                self.orphans = []

    # -- close -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain, serve the others until every rank has closed, install the final values, stop."""
        if self.closed:
            return
        self.closed = True
        ok = False
        try:
            self.check()
            self.q.put(("close", self.clock))
            with self.cond:
                self.wait_seconds += wait_until(
                    self.cond,
                    lambda: len(self.finals) == len(self.nonempty),
                    self.timeout,
                    lambda: self._missing_finals(),
                    self._err,
                )
            self.install(final=True)
            ok = True
        finally:
            for h in self.hooks:
                h.remove()
            self.hooks = []
            if ok:
                self.q.put(("stop", self.timeout))
                self.pusher.join(self.timeout.total_seconds())
                self.owner.stop(self.timeout)
                if self.receiver is not None:
                    self.receiver.join(self.timeout.total_seconds())
                alive = [
                    t.name
                    for t in [self.pusher, self.receiver, self.owner.receiver, *self.owner.appliers]
                    if t is not None and t.is_alive()
                ]
                if alive:
                    raise TimeoutError(f"pyasync: threads {alive} did not stop within {self.timeout}")
                self.check()
                if self.transport is not None:
                    self.transport.close()

    def pause(self, on: bool) -> None:
        """Tell every owner that this worker waits in a barrier and pushes nothing until it resumes
        (PAUSE), or that it is back (RESUME); sent by the push thread, after this rank's pushes."""
        if self.closed:
            raise RuntimeError("the optimizer is closed")
        self.check()
        self.q.put(("pause", self.clock, on))

    @contextlib.contextmanager
    def no_sync_ctx(self) -> Iterator[None]:
        prev = self.no_sync
        self.no_sync = True
        try:
            yield
        finally:
            self.no_sync = prev

    # -- stats -------------------------------------------------------------------------------------
    def stats(self) -> Stats:
        st = Stats(clock=self.clock)
        with self.cond:
            clocks = list(self.installed_clocks.values())
        st.min_included_clock = min((min(c) for c in clocks), default=self.clock - 1)
        for a in self.owner.appliers:
            c = a.c
            st.pushes_applied += c.applied
            st.pushes_dropped += c.dropped
            st.nonfinite_skipped += c.nonfinite
            st.updates_applied += c.updates
            st.bytes_sent += c.bytes_sent
            for k, v in list(c.staleness.items()):
                st.staleness[k] = st.staleness.get(k, 0) + v
        st.staleness = dict(sorted(st.staleness.items()))
        st.bytes_sent += self.bytes_sent
        st.bytes_received = self.bytes_received + self.owner.bytes_received
        st.wait_seconds = self.wait_seconds
        st.compression_ratio = self.raw_bytes / self.enc_bytes if self.enc_bytes else 1.0
        st.pushes_sent = self.pushes_sent
        return st
