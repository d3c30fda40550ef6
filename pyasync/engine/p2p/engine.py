"""The Engine: one rank's worker (gradient capture, push thread, replies) and owner (receiver, appliers),
behind the narrow API that pyasync.optimizer and pyasync.checkpoint use:

    step() close() abort() pause() resume() no_sync() check() stats() drain() clock
    shards.snapshot() shards.load() shards.masters() shards.install_values()   (engine/access.py)

Flow of one step (clock t), see docs/architecture.md:

1. backward: the hooks (engine/capture.py) hand each full bucket to the push thread at once, which
   flattens and compresses it (engine/pusher.py) without sending.
2. step(): flush the buckets no hook handed over (zeros + a has-grad mask); commit: every bucket whose
   .grad changed since is encoded again, then everything is pushed (Note [What step() pushes]).
3. step(): wait as the policy says for the owners' answers (engine/mailbox.py), install the newest
   shard values received.

close(), abort() and the elastic epoch change's halves are engine/lifecycle.py's.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
import traceback
from collections.abc import Iterator

import torch

from pyasync.engine import wire
from pyasync.engine.core.access import ShardAccess, initial_masters
from pyasync.engine.core.capture import Capture, check_grads, dense, forbid_error
from pyasync.engine.core.clip import MeanClip
from pyasync.engine.core.clock import wait_until
from pyasync.engine.core.failures import EngineBase
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import BucketLayout
from pyasync.engine.core.stats import Stats, collect_stats
from pyasync.engine.core.streams import record_event
from pyasync.engine.p2p.lifecycle import Lifecycle
from pyasync.engine.p2p.mailbox import Mailbox
from pyasync.engine.p2p.messages import BucketReady, Commit, Control
from pyasync.engine.p2p.owner import Owner
from pyasync.engine.p2p.pusher import Pusher
from pyasync.engine.p2p.replay import Retention
from pyasync.errors import PeerFailure
from pyasync.policy import Policy
from pyasync.transport.base import Transport

__all__ = ["Engine"]


class Engine(Lifecycle, EngineBase):
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
        self.init_failures()
        self.clock = 0
        self.closed = False
        self.wait_seconds = 0.0
        self.committed = -1  # the last clock whose pushes the push thread has sent
        self.in_flight: int | None = None  # a step whose pushes went out and that has not finished
        self.gated_done = -1  # the last clock whose gate (BSP clipping) this rank has run
        self.resumes = 0  # pauses ended: RESUMEs every owner expects
        keys = [(b, r) for b, lay in enumerate(layouts) for r in range(world_size) if lay.shards[r].numel > 0]
        self.mailbox = Mailbox(
            rank=rank,
            params=params,
            layouts=layouts,
            keys=keys,
            spec=spec,
            transport=transport,
            cond=self.cond,
            fail=self.fail,
            coded=compressor.replies,
        )
        self.owner = Owner(
            rank=rank,
            world_size=world_size,
            layouts=layouts,
            masters=initial_masters(params, layouts, rank),
            policy=policy,
            rule=rule,
            transport=transport,
            spec=spec,
            deliver_local=self.mailbox.deliver,
            fail=self.fail,
            num_appliers=num_appliers,
            timeout=timeout,
            gated=self.gated,
            notify=self._notify,
            compressor=compressor,
        )
        self.pusher = Pusher(
            rank=rank,
            world_size=world_size,
            layouts=layouts,
            compressor=compressor,
            transport=transport,
            owner=self.owner,
            device=self.device,
            timeout=timeout,
            committed=self._committed,
            nonfinite=self._on_nonfinite,
            fail=self.fail,
            clip_each_push=max_grad_norm is not None and not self.gated,
            send_early=grad_edits == "forbid",
            retain=Retention(lambda key: self.mailbox.installed_clocks[key][rank]) if elastic else None,
        )
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
        self.shards = ShardAccess(self.owner, rule, layouts, params, rank, timeout, self._require_open)
        if compressor.replies:  # Note [Checkpoints and held values] in pyasync/checkpoint/save.py
            if policy.resumes_exactly:  # elsewhere a reply may be in flight at a load: not restored
                self.shards.held_rows = self.owner.replies.held_rows
            self.shards.restore_rows = self.owner.replies.restore
            if self.mailbox.held is not None:
                self.shards.written = self.mailbox.held.set
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=32)  # recent step times
        self._step_start: float | None = None
        if elastic and transport is not None:
            transport.on_lost = self._on_lost
        self.owner.start()
        self.pusher.start()
        self.mailbox.start()
        if elastic and hasattr(transport, "start_heartbeats"):
            transport.start_heartbeats(self.silence_deadline, lambda: list(self.owner.remaining))

    # -- errors -------------------------------------------------------------------------------------
    def fail(self, where: str, e: BaseException) -> None:
        """Record a background failure (first one wins) and wake every waiter."""
        with self.cond:
            if self.error is None:
                self.error = e
                e.args = (f"{where}: {e}",) if not e.args else (f"{where}: {e.args[0]}", *e.args[1:])
                self.error_trace = traceback.format_exc()
            self.cond.notify_all()

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
            self._sticky(err)
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
                    self._err,
                    # A slow owner that drains this rank's sends only slowly is no failure: the wait
                    # starts again while pushes go out or this rank sees the job move (Note [Fair
                    # intake]); a send that makes no progress fails on its own, after the timeout.
                    progress=lambda: self.pusher.pushes_sent + self._progress(),
                )
            if self.clip is not None and self.gated_done < t:
                with self.cond:
                    self.wait_seconds += self.clip.wait(self.cond, self._err)
                self.grad_norm = self.clip.run()
                self.gated_done = t
            need = t if self.policy.worker_waits else t - self._unanswered_bound()
            if need >= 0:
                with self.cond:
                    self.wait_seconds += wait_until(
                        self.cond,
                        lambda: self.mailbox.all_answered(need),
                        self.timeout,
                        lambda: self._missing_answers(need),
                        self._err,
                    )
        except PeerFailure as e:
            self._sticky(e)
            raise
        except TimeoutError as e:
            self.timed_out = self.timed_out or e  # what a later abort() tells the peers first
            raise
        with self.cond:
            self.capture.next_clock()
            self.clock = t + 1
            self.in_flight = None
            self.timed_out = None
            bad = self._take_nonfinite(t)
        self.mailbox.install()
        now = time.monotonic()
        if self._step_start is not None:
            self.step_seconds.append(now - self._step_start)
        self._step_start = now
        self._raise_nonfinite(bad, self.on_nonfinite)

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
            (6 -> 3) and bought 11 points of accuracy, not the 30 that separate ASP from BSP there. It
            is not the default, because it gives up a promise of ASP: with a rank stopped (SIGSTOP, a
            hung host), the others wait for its owner's answers at their next step instead of
            training on (test_asp_goes_on_while_a_rank_is_stopped in tests/faults/test_failures_stalls.py)."""
        bound = getattr(self.policy, "max_unanswered", None)
        return self.clock + 1 if bound is None else bound

    def max_norm_each(self) -> float | None:
        """The norm each push is clipped to (None: no per-push clipping)."""
        return None if self.gated else self.max_grad_norm

    def no_sync(self) -> Iterator[None]:
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
        self.owner.wait_resumed(self.resumes, self.timeout, self._err)

    # -- state (between steps) ----------------------------------------------------------------------
    def drain(self, want: list[int]) -> None:
        """Wait (at most the timeout) until every owned shard has processed ``want[w]`` pushes from each
        worker w, pushes still on the network included."""
        self.owner.wait_processed(want, self.timeout, self._err)

    # -- stats --------------------------------------------------------------------------------------
    def installed_versions(self) -> dict[tuple[int, int], int]:
        with self.cond:
            return dict(self.mailbox.installed_version)

    def stats(self) -> Stats:
        return collect_stats(
            self.clock, self.mailbox, self.owner, self.pusher, self.wait_seconds, self.grad_norm
        )
