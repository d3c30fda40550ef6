"""Owner side of a rank: receive pushes, hand them to the appliers of their shards, answer the workers.

Threads (see docs/architecture.md, "Threads"):

* one *receiver* takes every message of the push flow: an any-source receive of one frame (header and
  payload) into a buffer of the largest push this rank can get, full validation (wire.WireSpec and
  wire.unpack_push), then the payload lands on the owner's device and goes to the applier of its
  bucket as a typed :class:`~pyasync.engine.p2p.messages.Push`. CLOSE, PAUSE and RESUME go to every applier.
* a few *appliers* (engine/p2p/applier.py) run the round machines and the updates.

The worker of this rank pushes to its own shards through :meth:`Owner.local_push` (no network) and
gets its answers through a callback. Send frames and receive pools are the transport's (Note [Frame
reuse] in pyasync/transport/frames.py).

Pushes an owner holds are bounded, and fair across senders: Note [Bounded intake] and Note [Fair
intake] in engine/p2p/intake.py.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch

from pyasync.engine import wire
from pyasync.engine.core.clip import ClipGate
from pyasync.engine.core.clock import wait_until
from pyasync.engine.core.replies import ReplyFrames
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.streams import record_event
from pyasync.engine.p2p.applier import Applier, OwnedShard
from pyasync.engine.p2p.intake import Intake, intake_limit, local_limit
from pyasync.engine.p2p.messages import Close, Depart, Pause, Push, Release, Reply, Stop
from pyasync.ops._common import Payload
from pyasync.policy import Policy
from pyasync.transport.base import Transport, TransportClosed
from pyasync.transport.frames import PoolClosed

__all__ = ["Owner", "intake_limit"]


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
        gated: bool = False,
        notify: Callable[[], None] = lambda: None,
        compressor=None,
    ) -> None:
        self.rank, self.n = rank, world_size
        self.timeout = timeout  # for frame reuse (a peer that stopped receiving)
        self.transport, self.spec = transport, spec
        self.deliver_local = deliver_local
        self.fail = fail
        self.device = next(iter(masters.values())).device if masters else torch.device("cpu")
        owned = [b for b, lay in enumerate(layouts) if lay.shards[rank].numel > 0]
        divisor = policy.divisor(world_size)
        self.appliers = [
            Applier(self, i, rule, world_size, divisor) for i in range(max(1, min(num_appliers, len(owned))))
        ]
        self.route: dict[int, Applier] = {}
        for j, b in enumerate(owned):
            lay = layouts[b].shards[rank]
            a = self.appliers[j % len(self.appliers)]
            rnd = policy.round(world_size, len(lay.segments), b, gated=gated)
            a.shards[b] = OwnedShard(rnd, rule.new_state(lay, masters[b]))
            self.route[b] = a
        self.gate = ClipGate(owned, notify) if gated else None
        self.receiver: threading.Thread | None = None
        self.bytes_received = 0
        # Pushes held (Note [Bounded intake]): from other ranks, and this rank's own. A slot is taken
        # before a message is read and given back once the push is applied, summed or dropped, whether
        # its payload still sits in its receive buffer or was copied to the device.
        self.intake = Intake(intake_limit(world_size, len(owned)))
        self.local_intake = Intake(local_limit(world_size, len(owned)))  # Note [Fair intake]
        # Receive buffers, recycled; sized by this rank's layout only. As many are kept as the intake
        # lets out, so a backlog that drains and refills allocates nothing new.
        self.push_pool = (
            transport.recv_pool(spec.max_push_frame(), self.intake.limit, self.device)
            if transport is not None
            else None
        )
        self.aborted = False
        self.replies = ReplyFrames(
            rank=rank,
            world_size=world_size,
            transport=transport,
            compressor=compressor,
            timeout=timeout,
            masters=masters,
            # Notes [Delay compensation], [Gap-aware penalty]
            track=float(getattr(policy, "dc", 0.0)) > 0 or bool(getattr(policy, "gap", False)),
        )
        # wait_processed() sleeps on `progress`; appliers notify it after each push while someone waits.
        self.progress = threading.Condition()
        self.watchers = 0
        self.resumes = [0] * world_size  # RESUMEs processed by every applier, per worker (see barrier)
        self.remaining = set(range(world_size)) - {rank}  # workers that may still push (no CLOSE yet)
        self.departed: set[int] = set()
        self._resume_parts: dict[int, int] = {}

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        for a in self.appliers:
            a.start()
        if self.n > 1:
            self.receiver = threading.Thread(target=self._recv_loop, name="pyasync-owner-recv", daemon=True)
            self.receiver.start()

    def local_push(self, b: int, clock: int, version: int, payload: Payload, mask: list[bool], event) -> None:
        """Queue this rank's own push for its applier, waiting while ``local_intake.limit`` of them are
        queued (at most the timeout without one being consumed)."""
        self.local_intake.take(
            self.timeout, self.processed_total, f"rank {self.rank}'s own appliers took none of its pushes"
        )
        self.route[b].q.put(Push(b, self.rank, clock, version, payload, tuple(mask), None, event))

    def processed_total(self) -> int:
        """Pushes processed by this rank's shards so far (only grows; read without locks)."""
        return sum(sum(sh.round.processed) for a in self.appliers for sh in list(a.shards.values()))

    def release_gate(self, version: int, scale: float) -> None:
        """Open the gated rounds of ``version`` (every owned shard), scaling their updates by ``scale``."""
        for b, a in self.route.items():
            a.q.put(Release(b, scale))

    def abort(self) -> None:
        """Wake every thread of the owner that waits (the receiver on its pool, local pushes, appliers)."""
        self.aborted = True
        self.intake.close()
        self.local_intake.close()
        for a in self.appliers:
            a.q.put(Stop(None))

    def depart(self, workers) -> None:
        """``workers`` left the membership: every round stops waiting for them (elastic membership)."""
        for w in workers:
            if w in self.departed or w == self.rank:
                continue
            self.departed.add(w)
            self.remaining.discard(w)
            for a in self.appliers:
                a.q.put(Depart(w))

    def local_close(self) -> None:
        for a in self.appliers:
            a.q.put(Close(self.rank))

    def local_pause(self, on: bool) -> None:
        for a in self.appliers:
            a.q.put(Pause(self.rank, on))

    def call(self, fn: Callable, timeout: datetime.timedelta) -> list:
        """Run ``fn(applier)`` in every applier thread (between pushes); their results."""
        results = [a.call(fn) for a in self.appliers]
        return [r.get(timeout, f"applier {a.name}") for a, r in zip(self.appliers, results)]

    def stop(self, timeout: datetime.timedelta, receiver: bool = True) -> None:
        """Stop the appliers (after their replies in flight) and, with ``receiver``, join the receiver
        (it ends at the last CLOSE)."""
        for a in self.appliers:
            if a.is_alive():
                a.q.put(Stop(timeout))
        for a in self.appliers:
            a.join(timeout.total_seconds())
        if receiver and self.receiver is not None:
            self.receiver.join(timeout.total_seconds())

    def drain_sends(self, ap: Applier, timeout: datetime.timedelta) -> None:
        """Wait for the replies still in flight from ``ap``'s shards (applier thread, at stop)."""
        self.replies.drain(ap.shards, timeout)

    def threads(self) -> list[threading.Thread]:
        return [t for t in (self.receiver, *self.appliers) if t is not None]

    # -- applier callbacks ----------------------------------------------------------------------------
    def release(self, push: Push) -> None:
        """A push's payload is consumed: its slot in the intake comes back, and its receive buffer (if it
        still holds the payload) goes back to the pool."""
        if push.frame is not None:
            self.push_pool.put(push.frame)
        (self.local_intake if push.worker == self.rank else self.intake).give()

    def progressed(self) -> None:
        if self.watchers:  # read without the lock: a waiter checks its condition under it before sleeping
            with self.progress:
                self.progress.notify_all()

    def resumed(self, w: int) -> None:
        """One applier processed worker w's RESUME; when all have, count it and wake waiters."""
        with self.progress:
            k = self._resume_parts.get(w, 0) + 1
            if k == len(self.appliers):
                k = 0
                self.resumes[w] += 1
                self.progress.notify_all()
            self._resume_parts[w] = k

    def answer(self, ap: Applier, sh: OwnedShard, dests, final: bool, ahead=()) -> None:
        """Send shard ``sh``'s current values to each (worker, clock answered) of ``dests``: a frame per
        remote worker (a copy, or a coded change: engine/core/replies.py), a clone for this rank's worker.
        ``ahead``: per dest, the updates to look ahead by (Note [Look-ahead replies] in pyasync/policy.py)."""
        rnd, master = sh.round, sh.state.master
        clocks = rnd.reflected  # Note [Reflected clocks]
        seen: dict[int, torch.Tensor] = {}  # look-ahead k -> values (one per distinct k)
        memory = float(getattr(rnd.policy, "lookahead_memory", 0.0))  # ASP's floor under "auto"

        def values_for(i: int) -> torch.Tensor:
            if final or not ahead:
                return master
            k = ahead[i]
            if k <= 0 and not memory:
                return master
            if k not in seen:
                per_round = bool(getattr(rnd.policy, "round_moments", False))
                seen[k] = ap.rule.lookahead(sh.state, k, self.n, self.n if per_round else 1, memory)
            return seen[k]

        for i, (w, c) in enumerate(dests):
            if w != self.rank:
                v = values_for(i)
                ap.bytes_sent += self.replies.send(sh.bucket, w, c, rnd.version, v, clocks, final)
        local = [(i, c) for i, (w, c) in enumerate(dests) if w == self.rank]
        if local:
            values = self.replies.local(sh.bucket, rnd.version, values_for(local[0][0]), final)
            self.deliver_local(
                Reply(
                    sh.bucket,
                    self.rank,
                    rnd.version,
                    local[0][1],
                    values,
                    clocks,
                    final,
                    event=record_event(values.device),
                )
            )

    # -- receiver thread ------------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        remaining = self.remaining
        try:
            while remaining:
                self.intake.take()  # waits while the intake is full: stop reading (Note [Bounded intake])
                frame = self.push_pool.get()
                src = self.transport.recv_any(frame, "push")
                h = wire.frame_header(frame, src)
                if h.kind in wire.CONTROL_KINDS:
                    self.spec.check_close(h)
                    self.bytes_received += wire.HEADER_BYTES
                    self.push_pool.put(frame)
                    self.intake.give()  # a control message holds nothing
                    if h.kind != wire.CLOSE:
                        for a in self.appliers:
                            a.q.put(Pause(src, h.kind == wire.PAUSE))
                        continue
                    if src not in remaining:
                        if src in self.departed:
                            continue
                        raise wire.WireError(f"rank {src} sent CLOSE twice")
                    remaining.discard(src)
                    for a in self.appliers:
                        a.q.put(Close(src))
                    continue
                self.spec.check_push(h)
                if h.bucket not in self.route:
                    raise wire.WireError(
                        f"PUSH from rank {src} for bucket {h.bucket}, whose shard {self.rank} is empty"
                    )
                self.bytes_received += wire.HEADER_BYTES + h.nbytes
                payload, mask = wire.unpack_push(wire.frame_body(frame, h), h)
                (codes, scales, indices), copied = self.transport.land(
                    [payload.codes, payload.scales, payload.indices], self.device
                )
                if copied:
                    self.push_pool.put(frame)
                    frame = None
                payload = Payload(
                    payload.codec, payload.n, codes, scales, indices, payload.k, payload.block, payload.finite
                )
                mask_t = tuple(bool(m) for m in mask.tolist())
                self.route[h.bucket].q.put(Push(h.bucket, src, h.clock, h.version, payload, mask_t, frame))
        except (TransportClosed, PoolClosed):
            return  # stopped on purpose (close after a failure)
        except BaseException as e:
            self.fail("owner receiver thread", e)

    # -- waiting on the owner (main thread) -----------------------------------------------------------
    def wait_resumed(self, count: int, timeout: datetime.timedelta, error) -> None:
        """Block until every applier has processed ``count`` RESUMEs from every worker."""

        def what() -> str:
            late = [w for w in range(self.n) if self.resumes[w] < count and w not in self.departed]
            return f"RESUME from worker ranks {late} at rank {self.rank}'s owner (a rank left the barrier?)"

        with self.progress:
            wait_until(
                self.progress,
                lambda: all(self.resumes[w] >= count for w in range(self.n) if w not in self.departed),
                timeout,
                what,
                error,
            )

    def behind(self, want: list[int]) -> list[tuple[int, int, int]]:
        """(bucket, worker, processed) of every owned shard that has processed fewer than want[worker]
        pushes from some worker (read without locks: each value only grows)."""
        return [
            (b, w, sh.round.processed[w])
            for b, sh in sorted(self.shards().items())
            for w in range(self.n)
            if sh.round.processed[w] < want[w]
        ]

    def wait_processed(self, want: list[int], timeout: datetime.timedelta, error) -> None:
        """Block until every owned shard has processed want[w] pushes from every worker w (pushes still
        on the network included); TimeoutError naming the shard and worker, or the engine's failure."""

        def what() -> str:
            b, w, got = self.behind(want)[0]
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
        return sorted({w for sh in list(self.shards().values()) for w in sh.round.missing(clock)})

    def unclosed(self) -> list[int]:
        """Workers this rank's shards have not seen close (for error messages only)."""
        return sorted({w for sh in list(self.shards().values()) for w in sh.round.unclosed()})

    def shards(self) -> dict[int, OwnedShard]:
        return {b: sh for a in self.appliers for b, sh in a.shards.items()}
