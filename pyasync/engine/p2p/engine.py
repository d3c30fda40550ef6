"""The Engine: one rank's worker (gradient capture, push thread, replies) and owner (receiver, appliers),
behind the narrow API that pyasync.optimizer and pyasync.checkpoint use:

    step() close() abort() pause() resume() no_sync() check() record_failure() stats() drain() clock
    lost drained shards.snapshot() shards.load() shards.masters() shards.install_values()
    (the EngineProtocol of engine/core/protocol.py; the shards' access is engine/core/access.py)

Flow of one step (clock t), see docs/architecture.md:

1. backward: the hooks (engine/core/capture.py) hand each full bucket to the push thread at once, which
   flattens and compresses it (engine/p2p/pusher.py) without sending.
2. step(): flush the buckets no hook handed over (zeros + a has-grad mask); commit: every bucket whose
   .grad changed since is encoded again, then everything is pushed (Note [What step() pushes]).
3. step(): wait as the policy says for the owners' answers (engine/p2p/mailbox.py), install the newest
   shard values received.

How it ends is the Engine's too: close() (drain, serve the others until every rank closed, install the
final values), abort() after a failure, and under elastic membership the departure of a rank and the
two halves of an epoch change (drain_epoch, stop_epoch; pyasync/session/membership.py). Its failures
and non-finite pushes are kept by the ``Failures`` it owns (engine/core/failures.py).
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from pyasync.engine import wire
from pyasync.engine.core.access import ShardAccess, initial_masters
from pyasync.engine.core.capture import Capture, check_grads, dense, forbid_error
from pyasync.engine.core.clip import MeanClip
from pyasync.engine.core.clock import wait_at_most, wait_until
from pyasync.engine.core.failures import Failures
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import BucketLayout
from pyasync.engine.core.stats import Stats, collect_stats
from pyasync.engine.core.streams import record_event
from pyasync.engine.p2p.mailbox import Mailbox
from pyasync.engine.p2p.messages import BucketReady, Commit, Control, Stop
from pyasync.engine.p2p.owner import Owner
from pyasync.engine.p2p.pusher import Pusher
from pyasync.engine.p2p.replay import Retention
from pyasync.errors import PeerFailure
from pyasync.policy import Policy
from pyasync.transport.base import Transport

__all__ = ["Engine"]

_log = logging.getLogger("pyasync")

#: The least patience "auto" gives ASP's wait for a worker's own answers (Note [Patience with one's own
#: answers]).
PATIENCE_FLOOR_S = 0.05


class Engine:
    """One rank's worker and owner (the EngineProtocol of engine/core/protocol.py), built from the parts it
    hands what they use: its Failures, the Mailbox (answers in), the Owner (this rank's shards), the
    Pusher (pushes out), the Capture (gradient hooks), MeanClip (gated clipping) and ShardAccess. Not
    thread-safe for the caller: drive it from one thread."""

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
        max_grad_norm: float | None = None,
        control=None,
        grad_edits: str = "detect",
        elastic: bool = False,
    ) -> None:
        self.params, self.layouts, self.policy, self.rule = params, layouts, policy, rule
        self.spec = spec
        self.elastic = elastic
        self.lost: set[int] = set()  # ranks that left the membership (elastic: pyasync/session/membership.py)
        self.drained = False  # elastic: CLOSE sent and the live owners' finals installed (epoch change)
        self.lost_at: float | None = None  # wall time (time.time()) this rank first saw a rank leave
        # elastic: asked once close() has every final: whether a joiner is admitted before this rank closes
        # (Note [Joining a running job] in session/joining.py); set by the optimizer
        self.admit_at_close: Callable[[], bool] | None = None
        self.max_grad_norm = max_grad_norm
        self.grad_edits = grad_edits
        self.gated = max_grad_norm is not None and policy.clips_mean and world_size > 1
        self.control = control  # the optimizer's private gloo group (the gates' all-reduce)
        self.grad_norm: float | None = None  # last clipped norm (mean gradient under BSP, else this push)
        self.names = names if names is not None else [f"param{i}" for i in range(len(params))]
        self.on_nonfinite = on_nonfinite
        self.rank, self.n, self.timeout = rank, world_size, timeout
        self.transport = transport
        self.device = params[0].device
        self.cond = threading.Condition()
        self.failures = Failures(
            cond=self.cond,
            rank=rank,
            names=self.names,
            layouts=layouts,
            policy=policy,
            closed=lambda: self.closed,
        )
        self.clock = 0
        self.closed = False
        self.wait_seconds = 0.0
        self.committed = -1  # the last clock whose pushes the push thread has sent
        self.in_flight: int | None = None  # a step whose pushes went out and that has not finished
        self.gated_done = -1  # the last clock whose gate (BSP clipping) this rank has run
        self.resumes = 0  # pauses ended: RESUMEs every owner expects
        self.mailbox = self._make_mailbox(compressor)
        self.owner = self._make_owner(compressor, num_appliers)
        self.pusher = self._make_pusher(compressor)
        self.capture = Capture(params, layouts, self.cond, self._hand_over)
        self.clip = (
            MeanClip(
                self.owner.gate,
                control,
                transport,
                max_grad_norm,
                timeout,
                self.owner.processed_total,
                self.owner.release_gate,
            )
            if self.gated
            else None
        )
        self.shards = self._make_shards(compressor)
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=32)  # recent step times
        self._step_start: float | None = None
        self.late_owners: set[int] = set()  # owners whose answers ran out of ASP's patience (not yet in)
        self.patience_expired = 0  # waits for this rank's own answers that ran out of patience
        self._start()

    # -- construction ---------------------------------------------------------------------------------
    def _make_mailbox(self, compressor) -> Mailbox:
        """The worker's receive side: the owners' answers, installed into the parameters."""
        n, layouts = self.n, self.layouts
        keys = [(b, r) for b, lay in enumerate(layouts) for r in range(n) if lay.shards[r].numel > 0]
        return Mailbox(
            rank=self.rank,
            params=self.params,
            layouts=layouts,
            keys=keys,
            spec=self.spec,
            transport=self.transport,
            cond=self.cond,
            fail=self.failures.fail,
            coded=compressor.replies,
        )

    def _make_owner(self, compressor, num_appliers: int) -> Owner:
        """The owner side: this rank's shards, their receiver and appliers."""
        return Owner(
            rank=self.rank,
            world_size=self.n,
            layouts=self.layouts,
            masters=initial_masters(self.params, self.layouts, self.rank),
            policy=self.policy,
            rule=self.rule,
            transport=self.transport,
            spec=self.spec,
            deliver_local=self.mailbox.deliver,
            fail=self.failures.fail,
            num_appliers=num_appliers,
            timeout=self.timeout,
            gated=self.gated,
            notify=self._notify,
            compressor=compressor,
        )

    def _make_pusher(self, compressor) -> Pusher:
        """The push thread: flattens, compresses and sends every bucket handed over."""
        rank, mailbox = self.rank, self.mailbox
        return Pusher(
            rank=rank,
            world_size=self.n,
            layouts=self.layouts,
            compressor=compressor,
            transport=self.transport,
            owner=self.owner,
            device=self.device,
            timeout=self.timeout,
            committed=self._committed,
            nonfinite=self.failures.on_nonfinite,
            fail=self.failures.fail,
            clip_each_push=self.max_grad_norm is not None and not self.gated,
            send_early=self.grad_edits == "forbid",
            retain=Retention(lambda key: mailbox.installed_clocks[key][rank]) if self.elastic else None,
        )

    def _make_shards(self, compressor) -> ShardAccess:
        """The state access of pyasync.optimizer and pyasync.checkpoint (engine/core/access.py)."""
        shards = ShardAccess(
            self.owner, self.rule, self.layouts, self.params, self.rank, self.timeout,
            self.failures.require_open,
        )
        if compressor.replies:  # Note [Checkpoints and held values] in pyasync/checkpoint/save.py
            if self.policy.resumes_exactly:  # elsewhere a reply may be in flight at a load: not restored
                shards.held_rows = self.owner.replies.held_rows
            shards.restore_rows = self.owner.replies.restore
            if self.mailbox.held is not None:
                shards.written = self.mailbox.held.set
        return shards

    def _start(self) -> None:
        """Start the threads (and, elastic, the transport's heartbeats and departure callback)."""
        transport = self.transport
        if self.elastic and transport is not None:
            transport.on_lost = self._on_lost
        self.owner.start()
        self.pusher.start()
        self.mailbox.start()
        if self.elastic and transport is not None:  # a no-op without liveness probing (transport/base.py)
            transport.start_heartbeats(self.silence_deadline, lambda: list(self.owner.remaining))

    # -- errors (kept by self.failures) --------------------------------------------------------------
    def fail(self, where: str, e: BaseException) -> None:
        """Record a background failure (first one wins) and wake every waiter."""
        self.failures.fail(where, e)

    def check(self) -> None:
        """Raise the recorded failure, if any (see clock.as_raised)."""
        self.failures.check()

    def record_failure(self, e: BaseException) -> None:
        """A call failed while the engine was mid-step (or a caller's collective failed): later calls keep
        failing with this cause."""
        self.failures.record(e)


    def abort_reason(self, reason: str | None) -> str | None:
        """What a rank that stops tells its peers (Failures.abort_reason)."""
        return self.failures.abort_reason(reason)

    def _notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    # -- hand-offs ----------------------------------------------------------------------------------
    def _hand_over(self, b: int) -> None:
        """Bucket b of the current clock goes to the push thread (caller holds cond)."""
        grads = [self.params[p].grad for p in self.layouts[b].params]
        grads = [None if g is None else dense(g) for g in grads]
        versions = {r: self.mailbox.installed_version.get((b, r), 0) for r in range(self.n)}
        self.pusher.q.put(BucketReady(b, self.clock, grads, versions, record_event(self.device)))

    def _committed(self, clock: int, norm: float | None) -> None:
        with self.cond:
            self.committed = clock
            if norm is not None:
                self.grad_norm = norm
            self.cond.notify_all()

    # -- step ---------------------------------------------------------------------------------------
    def _missing(self, keys) -> str:
        owners = sorted({r for _, r in keys})
        buckets = sorted({b for b, _ in keys})
        return f"owner ranks {owners} (buckets {buckets[:8]}{'...' if len(buckets) > 8 else ''})"

    def _missing_answers(self, t: int) -> str:
        text = f"answers to the pushes of step {t} from {self._missing(self.mailbox.unanswered(t))}"
        lag = self.owner.laggards(t)
        if lag:
            text += f"; this rank's shards are still waiting for pushes from worker ranks {lag}"
        return text

    def step(self, grad_scale: float | None = None, found_inf: bool = False) -> None:
        """Send this step's pushes (Note [What step() pushes]), wait as the policy says, install fresh
        values. ``grad_scale``: the GradScaler scale the gradients still carry (divided out before
        encoding); ``found_inf``: the GradScaler found an inf or NaN (nothing of this step is applied).

        A step whose wait timed out (TimeoutError naming who is missing) stays in flight: the next
        ``step()`` first finishes it (waiting again), then pushes the gradients it is given; ``close()``
        finishes it too. A failed peer (PeerFailure) or engine thread fails every later call."""
        if self.closed:
            raise RuntimeError("step() called after close(); create a new DistributedOptimizer")
        self.check()
        if self.in_flight is not None:
            self._finish(self.in_flight)
        check_grads(
            self.params, self.names
        )  # before anything is sent: a bad gradient is the caller's error, not a failure
        t = self.clock
        with self.cond:
            self.capture.flush()
        changed = self.capture.changed()
        if self.grad_edits == "forbid" and (changed or grad_scale is not None or found_inf):
            err = forbid_error(self.names, self.layouts, changed, "sent them")
            self.record_failure(err)
            raise err
        regrab = {
            b: [
                None if self.params[p].grad is None else dense(self.params[p].grad)
                for p in self.layouts[b].params
            ]
            for b in changed
        }
        scale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        self.pusher.q.put(
            Commit(t, regrab, scale, self.max_norm_each(), bool(found_inf), record_event(self.device))
        )
        self.in_flight = t
        self._finish(t)

    def finish(self) -> None:
        """Finish a step whose wait timed out, if any (the protocol's ``finish``)."""
        self.check()
        if self.in_flight is not None:
            self._finish(self.in_flight)

    def _finish(self, t: int) -> None:
        """Wait until step ``t``'s pushes are sent (and, gated, its norm is agreed) and, as the policy says,
        answered; then install and move to the next clock."""
        try:
            with self.cond:
                self.wait_seconds += wait_until(
                    self.cond,
                    lambda: self.committed >= t,
                    self.timeout,
                    lambda: f"the push thread to send the pushes of step {t}",
                    self.failures.err,
                    # A slow owner that drains this rank's sends only slowly is no failure: the wait
                    # starts again while pushes go out or this rank sees the job move (Note [Fair
                    # intake]); a send that makes no progress fails on its own, after the timeout.
                    progress=lambda: self.pusher.pushes_sent + self._progress(),
                )
            if self.clip is not None and self.gated_done < t:
                with self.cond:
                    self.wait_seconds += self.clip.wait(self.cond, self.failures.err)
                self.grad_norm = self.clip.run()
                self.gated_done = t
            need = t if self.policy.worker_waits else t - self._unanswered_bound()
            if need >= 0:
                self._await_answers(need)
        except PeerFailure as e:
            self.record_failure(e)
            raise
        except TimeoutError as e:
            # what a later abort() tells the peers first
            self.failures.timed_out = self.failures.timed_out or e
            raise
        with self.cond:
            self.capture.next_clock()
            self.clock = t + 1
            self.in_flight = None
            self.failures.timed_out = None
            bad = self.failures.take_nonfinite(t)
        self.mailbox.install()
        now = time.monotonic()
        if self._step_start is not None:
            self.step_seconds.append(now - self._step_start)
        self._step_start = now
        self.failures.raise_nonfinite(bad, self.on_nonfinite)

    def _await_answers(self, need: int) -> None:
        """Wait until every owner answered this rank's pushes of clock ``need``: for as long as the
        timeout allows, or, under ASP's patience (Note [Patience with one's own answers]), for at most
        the patience, not at all for an owner that ran out of it before and has not answered since."""
        patience = self._patience()
        with self.cond:
            if patience is None:
                self.wait_seconds += wait_until(
                    self.cond,
                    lambda: self.mailbox.all_answered(need),
                    self.timeout,
                    lambda: self._missing_answers(need),
                    self.failures.err,
                )
                return
            late = self.late_owners
            self.wait_seconds += wait_at_most(
                self.cond,
                lambda: all(r in late for _, r in self.mailbox.unanswered(need)),
                patience,
                self.failures.err,
            )
            missing = {r for _, r in self.mailbox.unanswered(need)}
            self.patience_expired += bool(missing - late)
            self.late_owners = missing

    def _patience(self) -> float | None:
        """How long to wait for this rank's own answers before training on without them (None: until
        the timeout).

        Note [Patience with one's own answers]
            ASP's default is ``max_unanswered=0``: a worker starts step t + 1 on values that hold its
            own push of step t, as a parameter-server worker pushes and then pulls. Without it, half
            of a push's staleness is the worker's own pushes in flight (Note [Where staleness comes
            from]), and on ``seq`` ASP did not converge with any correction (docs/benchmarks.md). The
            wait is for the owners' apply and reply, not for another worker's compute, but an owner is
            also a worker: a stopped or hung rank would stall everyone's next step until the timeout.
            So the wait is bounded by a patience (``asp:patience=<seconds>``; "auto", the default, is
            the median of this rank's recent steps, at least 50 ms, and 1 s before the first step): a
            busy machine that answers slowly does not run it out, while a stopped owner costs little.
            When it runs out, the worker trains on with what has arrived, as unbounded ASP does, and
            waits no more for the owners that were late until they answer again. A stopped rank then
            costs the others one patience, not one per step (tests/faults/test_failures_stalls.py).
            ``patience=inf`` waits until the timeout, as SSP does."""
        p = getattr(self.policy, "patience", None)
        if p is None or p == float("inf"):
            return None
        if p == "auto":
            recent = sorted(self.step_seconds)
            p = max(PATIENCE_FLOOR_S, recent[len(recent) // 2]) if recent else 1.0
        return min(float(p), self.timeout.total_seconds())

    def _unanswered_bound(self) -> int:
        """How many of its pushes a worker may leave unanswered when it starts its next step (ASP's
        ``max_unanswered``; a bound past any clock when there is none).

        Note [Where staleness comes from]
            The staleness of a push (the shard's updates between the version it was computed on and its
            own) has three sources under ASP with n workers: the n - 1 other workers' pushes that reach
            the owner in between (about n - 1 per round when all run at one speed); this worker's own
            pushes still in flight (unbounded ASP starts step t + 1 as soon as step t's pushes are
            sent, on values that do not hold them, so every push of step t + 1 is also stale by the
            worker's own push of step t and by the others' pushes that arrived meanwhile); and a
            straggler's pushes, computed on values n - 1 or more of everyone else's pushes old. The
            second source doubles the median: 6-7 with 4 workers (docs/benchmarks.md, "Why asynchrony
            hurt"). ``max_unanswered=0`` ("asp:unanswered=0") removes it: a worker waits for the
            answers to its last push, which costs one owner's apply and one reply per step, and
            computes on values that hold its own update. On ``seq`` that halved the median staleness
            (6 -> 3); with the look-ahead and moments per round it is what made ASP converge there
            (docs/benchmarks.md). It is ASP's default, with a patience so that a stopped rank cannot
            stall the others (Note [Patience with one's own answers]); ``asp:unanswered=inf`` is the
            unbounded pipeline."""
        bound = getattr(self.policy, "max_unanswered", None)
        return self.clock + 1 if bound is None else bound

    def max_norm_each(self) -> float | None:
        """The norm each push is clipped to (None: no per-push clipping)."""
        return None if self.gated else self.max_grad_norm

    def no_sync(self) -> AbstractContextManager[None]:
        """Context: gradients accumulate over several backward() calls, nothing is pushed."""
        return self.capture.paused()

    # -- pauses -------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Tell every owner that this worker waits in a barrier and pushes nothing until it resumes
        (PAUSE, sent by the push thread after this rank's pushes)."""
        if self.closed:
            raise RuntimeError("the optimizer is closed")
        self.check()
        self.pusher.q.put(Control(wire.PAUSE, self.clock))

    def resume(self) -> None:
        """Send RESUME and wait until this rank's owner has processed every rank's RESUME (so no push of
        the next step reaches an owner that still counts its sender as paused, once the ranks met)."""
        self.pusher.q.put(Control(wire.RESUME, self.clock))
        self.resumes += 1
        self.owner.wait_resumed(self.resumes, self.timeout, self.failures.err)

    # -- state (between steps) ----------------------------------------------------------------------
    def drain(self, want: list[int]) -> None:
        """Wait (at most the timeout) until every owned shard has processed ``want[w]`` pushes from each
        worker w, pushes still on the network included."""
        self.owner.wait_processed(want, self.timeout, self.failures.err)

    # -- stats --------------------------------------------------------------------------------------
    def installed_versions(self) -> dict[tuple[int, int], int]:
        with self.cond:
            return dict(self.mailbox.installed_version)

    def stats(self) -> Stats:
        st = collect_stats(
            self.clock, self.mailbox, self.owner, self.pusher, self.wait_seconds, self.grad_norm
        )
        st.patience_expired = self.patience_expired
        return st

    # -- close ------------------------------------------------------------------------------------
    def _missing_finals(self) -> str:
        text = "every rank to close: final values missing from " + self._missing(self.mailbox.not_final())
        late = self.owner.unclosed()
        if late:
            text += f"; this rank's shards have not seen worker ranks {late} close"
        return text

    def _progress(self) -> int:
        """Grows while any rank still makes progress this rank can see (for close()'s deadline)."""
        return self.owner.processed_total() + self.mailbox.delivered

    def close(self) -> None:
        """Drain, serve the others until every rank has closed, install the final values, stop. After a
        failure: stop every thread at once and raise the failure if no call has raised it yet."""
        if self.closed:
            return
        self.closed = True
        if self.failures.error is not None:  # after a failure: stop, and say why unless a call already did
            self.capture.remove()
            self.abort()
            if not self.failures.reported:
                self.check()
            return
        ok = False
        try:
            self.pusher.q.put(Control(wire.CLOSE, self.clock))
            while True:
                with self.cond:
                    self.wait_seconds += wait_until(
                        self.cond,
                        lambda: self.mailbox.all_final() or (self.clip is not None and self.clip.ready()),
                        self.timeout,
                        self._missing_finals,
                        self.failures.err,
                        progress=self._progress,
                    )
                    done = self.mailbox.all_final()
                if done:
                    break
                self.grad_norm = self.clip.run()  # a slower rank's round: this rank still helps clip it
            self.mailbox.install(final=True)
            ok = True
            if self.lost or (self.admit_at_close is not None and self.admit_at_close()):
                # elastic: a rank left, or a joiner is admitted, while this one closed: change epoch
                self.closed, self.drained = False, True
                return
        except BaseException as e:
            self.record_failure(e)
            raise
        finally:
            if not self.drained:
                self.capture.remove()
                if ok:
                    self._stop()
                else:
                    self.abort()

    def abort(self, reason: str | None = None) -> None:
        """Stop every engine thread at once (after a failure): wake what waits, join, close the sockets.
        The peers are told ``reason``, else this rank's failure, if there is one (so a rank that gives up
        is not mistaken for the first failure)."""
        if self.transport is not None:
            self.transport.abort(self.abort_reason(reason), getattr(self.failures.error, "ranks", None))
        self.owner.abort()
        self.pusher.q.put(Stop(None))
        wait = min(5.0, self.timeout.total_seconds())
        for t in self.threads():
            t.join(wait)
        if self.transport is not None:
            self.transport.stop_heartbeats()
        alive = [t.name for t in self.threads() if t.is_alive()]
        if alive:  # say so: a thread left inside a native call may crash the interpreter's exit
            _log.warning(
                "pyasync: rank %d: threads %s did not stop within %g s of abort(); they are daemon threads "
                "and may still be inside a socket call or a kernel when the interpreter exits",
                self.rank,
                alive,
                wait,
            )

    def _stop(self, close_transport: bool = True) -> None:
        self.pusher.q.put(Stop(self.timeout))
        self.pusher.join(self.timeout.total_seconds())
        self.owner.stop(self.timeout, receiver=not self.lost)
        if self.lost and self.transport is not None:
            # Ranks left: the receivers may still wait for a message only they would have sent (every
            # live rank's CLOSE and FINAL are in); waking them ends those waits.
            self.check()
            self.transport.wake_receivers()
            if self.owner.receiver is not None:
                self.owner.receiver.join(self.timeout.total_seconds())
        if self.mailbox.thread is not None:
            self.mailbox.thread.join(self.timeout.total_seconds())
        alive = [t.name for t in self.threads() if t.is_alive()]
        if alive:
            self.abort()
            raise TimeoutError(f"pyasync: threads {alive} did not stop within {self.timeout}")
        self.check()
        if self.transport is not None:
            self.transport.stop_heartbeats()
            if close_transport:
                self.transport.close()

    def threads(self) -> list[threading.Thread]:
        """The engine's threads: the push thread, the mailbox's, the owner's receiver and appliers."""
        return [t for t in (self.pusher, self.mailbox.thread, *self.owner.threads()) if t is not None]

    # -- elastic membership (pyasync/session/membership.py) -------------------------------------------------
    def _on_lost(self, ranks: list[int]) -> None:
        """Elastic membership: ``ranks`` left (any thread). Nothing waits for them from now on; the
        optimizer starts the next membership epoch at its next call (pyasync/session/membership.py)."""
        with self.cond:
            new = set(ranks) - self.lost - {self.rank}
            if not new:
                return
            self.lost |= new
            self.lost_at = self.lost_at or time.time()
            self.mailbox.depart(new)
            self.cond.notify_all()
        self.owner.depart(sorted(new))
        _log.warning("pyasync: rank %d saw ranks %s leave (their connections ended)", self.rank, sorted(new))

    def silence_deadline(self) -> float:
        """Seconds of silence after which a peer counts as gone (Note [Heartbeats] in
        transport/heartbeats.py): ten times this rank's median step time, at least 3 s, at most the
        timeout."""
        recent = sorted(self.step_seconds)
        typical = recent[len(recent) // 2] if recent else 0.0
        return min(self.timeout.total_seconds(), max(3.0, 10.0 * typical))

    def drain_epoch(self) -> None:
        """Elastic membership, first half of an epoch change: CLOSE to every owner, wait (at most twice
        the timeout: a survivor blocked in a collective with the dead rank, a checkpoint save, notices
        only when that collective times out) until every live owner has applied every live worker's
        pushes and sent its final values, install them. The threads keep running (the shards can still
        be read); ``stop_epoch`` ends them."""
        if self.drained:  # close() already did it
            return
        self.check()
        if self.in_flight is not None:
            self._finish(self.in_flight)
        self.drained = True
        self.pusher.q.put(Control(wire.CLOSE, self.clock))
        try:
            with self.cond:
                self.wait_seconds += wait_until(
                    self.cond,
                    self.mailbox.all_final,
                    2 * self.timeout,  # a survivor may first sit out a collective (a save) for a timeout
                    self._missing_finals,
                    self.failures.err,
                    progress=self._progress,
                )
            self.mailbox.install(final=True)
        except BaseException as e:
            self.record_failure(e)
            raise

    def stop_epoch(self) -> None:
        """Second half: stop every thread, say goodbye to the live peers. The transport stays open (its
        connections still tell who dies during the epoch change) until ``transport.close()``."""
        self.closed = True
        self.capture.remove()
        try:
            self._stop(close_transport=False)
        except BaseException:
            self.abort()
            raise
