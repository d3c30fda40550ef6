"""The Engine: one rank's worker (gradient capture, push thread, replies) and owner (receiver, appliers),
behind the narrow API that pyasync.optimizer and pyasync.checkpoint use:

    step() close() pause() resume() no_sync() check() stats()
    snapshot() load() drain() installed_versions() clock

Flow of one step (clock t), see docs/architecture.md:

1. backward: the hooks (engine/capture.py) hand each full bucket to the push thread at once.
2. push thread (engine/pusher.py): flatten, compress slice r with its own error-feedback key, push it
   to owner r (own shard: in-process).
3. step(): flush the buckets no hook handed over (zeros + a has-grad mask), wait until every bucket is
   pushed, wait as the policy says for the owners' answers (engine/mailbox.py), install the newest
   shard values received.
"""

from __future__ import annotations

import datetime
import logging
import threading
import traceback
from collections.abc import Iterator

import torch

from pyasync.engine import wire
from pyasync.engine.capture import Capture
from pyasync.engine.clock import wait_until
from pyasync.engine.errors import EngineError, NonFiniteGradientError
from pyasync.engine.mailbox import Mailbox
from pyasync.engine.messages import BucketReady, Control, Stop
from pyasync.engine.owner import Owner
from pyasync.engine.pusher import Pusher
from pyasync.engine.rule import UpdateRule
from pyasync.engine.shards import BucketLayout
from pyasync.engine.stats import Stats
from pyasync.engine.streams import record_event
from pyasync.ops import bucketing as ops_bucketing
from pyasync.policy import Policy
from pyasync.transport.base import Transport

__all__ = ["Engine"]

_log = logging.getLogger("pyasync")


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
        self.params, self.layouts, self.policy, self.rule = params, layouts, policy, rule
        self.names = names if names is not None else [f"param{i}" for i in range(len(params))]
        self.on_nonfinite = on_nonfinite
        self.rank, self.n, self.timeout = rank, world_size, timeout
        self.transport = transport
        self.device = params[0].device
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.clock = 0
        self.closed = False
        self.wait_seconds = 0.0
        self.packed = 0  # buckets of this clock the push thread has finished
        self.nonfinite: list[tuple[int, int]] = []  # (bucket, clock) of non-finite pushes not yet raised
        self.nonfinite_logged = False
        self.resumes = 0  # pauses ended: RESUMEs every owner expects
        keys = [(b, r) for b, lay in enumerate(layouts) for r in range(world_size) if lay.shards[r].numel > 0]
        self.mailbox = Mailbox(rank=rank, params=params, layouts=layouts, keys=keys, spec=spec,
                               transport=transport, cond=self.cond, fail=self.fail)
        self.owner = Owner(rank=rank, world_size=world_size, layouts=layouts, masters=self._masters(),
                           policy=policy, rule=rule, transport=transport, spec=spec,
                           deliver_local=self.mailbox.deliver, fail=self.fail, num_appliers=num_appliers,
                           timeout=timeout)
        self.pusher = Pusher(rank=rank, world_size=world_size, layouts=layouts, compressor=compressor,
                             transport=transport, owner=self.owner, device=self.device, timeout=timeout,
                             packed=self._packed, nonfinite=self._on_nonfinite, fail=self.fail)
        self.capture = Capture(params, layouts, self.cond, self._hand_over)
        self.owner.start()
        self.pusher.start()
        self.mailbox.start()

    def _masters(self) -> dict[int, torch.Tensor]:
        """Master shards from the current (agreed, broadcast) parameter values."""
        out = {}
        for b, lay in enumerate(self.layouts):
            sh = lay.shards[self.rank]
            if sh.numel > 0:
                flat = torch.empty(lay.numel, dtype=torch.float32, device=self.device)
                ops_bucketing.flatten([self.params[p].detach() for p in lay.params], flat, lay.offsets,
                                      numels=lay.numels)
                out[b] = flat[sh.begin : sh.end].clone()
        return out

    # -- errors -------------------------------------------------------------------------------------
    def fail(self, where: str, e: BaseException) -> None:
        """Record a background failure (first one wins) and wake every waiter."""
        with self.cond:
            if self.error is None:
                self.error = e
                e.args = (f"{where}: {e}",) if not e.args else (f"{where}: {e.args[0]}", *e.args[1:])
                self.error_trace = traceback.format_exc()
            self.cond.notify_all()

    def _err(self) -> BaseException | None:
        return self.error

    def check(self) -> None:
        if self.error is not None:
            raise EngineError(f"pyasync engine failed: {self.error}") from self.error

    # -- hand-offs ----------------------------------------------------------------------------------
    def _hand_over(self, b: int) -> None:
        """Bucket b of the current clock goes to the push thread (caller holds cond)."""
        grads = [self.params[p].grad for p in self.layouts[b].params]
        grads = [None if g is None else _dense(g) for g in grads]
        versions = {r: self.mailbox.installed_version.get((b, r), 0) for r in range(self.n)}
        self.pusher.q.put(BucketReady(b, self.clock, grads, versions, record_event(self.device)))

    def _packed(self) -> None:
        with self.cond:
            self.packed += 1
            self.cond.notify_all()

    def _nonfinite_text(self, b: int, clock: int) -> str:
        names = [self.names[p] for p in self.layouts[b].params]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        return f"non-finite gradient (NaN or Inf) in bucket {b} at step {clock} on rank {self.rank} (parameters: {shown})"

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

    def _missing_finals(self) -> str:
        text = "every rank to close: final values missing from " + self._missing(self.mailbox.not_final())
        late = self.owner.unclosed()
        if late:
            text += f"; this rank's shards have not seen worker ranks {late} close"
        return text

    def step(self) -> None:
        """Push whatever is not pushed yet, wait as the policy says, install fresh values."""
        if self.closed:
            raise RuntimeError("step() called after close(); create a new DistributedOptimizer")
        self.check()
        late = self.capture.take_late_grad()
        if late is not None:
            raise RuntimeError(f"pyasync: {late}")
        t = self.clock
        with self.cond:
            nb = self.capture.flush()
            self.wait_seconds += wait_until(
                self.cond,
                lambda: self.packed >= nb,
                self.timeout,
                lambda: f"the push thread to send the {nb - self.packed} remaining buckets of step {t}",
                self._err,
            )
            if self.policy.worker_waits:
                self.wait_seconds += wait_until(
                    self.cond, lambda: self.mailbox.all_answered(t), self.timeout,
                    lambda: self._missing_answers(t), self._err,
                )
            self.capture.next_clock()
            self.packed = 0
            self.clock = t + 1
            bad = [(b, c) for b, c in self.nonfinite if c == t]
            self.nonfinite = []
        self.mailbox.install()
        if bad and self.on_nonfinite == "raise":
            raise NonFiniteGradientError(
                "pyasync: " + "; ".join(self._nonfinite_text(b, c) for b, c in bad)
                + "; the push was skipped (not applied) and the step completed. Fix the loss or lower the "
                "learning rate, or pass on_nonfinite='skip' to skip such pushes silently"
            )

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
    def snapshot(self) -> dict[int, dict]:
        """This rank's shards: {bucket: {master, version, processed, optim}} (copies), taken in their
        applier threads between pushes."""

        def grab(ap) -> dict:
            return {
                b: {
                    "master": sh.state.master.clone(),
                    "version": torch.tensor(sh.round.version, dtype=torch.int64),
                    "processed": torch.tensor(sh.round.processed, dtype=torch.int64),
                    "optim": {k: v.clone() for k, v in self.rule.state_tensors(sh.state).items()},
                }
                for b, sh in ap.shards.items()
            }

        out: dict[int, dict] = {}
        for part in self.owner.call(grab, self.timeout):
            out.update(part)
        return out

    def load(self, shards: dict[int, dict]) -> None:
        """Load {bucket: {master, optim}} into this rank's shards (in their applier threads) and install
        them into the local parameters. Versions and clocks are this engine's own and stay."""

        def put(ap) -> None:
            for b, sh in ap.shards.items():
                d = shards[b]
                where = f"state_dict['shards']['{b}']"
                if d["master"].numel() != sh.state.master.numel():
                    raise ValueError(
                        f"{where}['master'] has {d['master'].numel()} elements, expected {sh.state.master.numel()}"
                    )
                self.rule.load_state_tensors(sh.state, d["optim"], where + "['optim']")
                sh.state.master.copy_(d["master"].reshape(-1))

        self.owner.call(put, self.timeout)
        self.install_shards({b: d["master"] for b, d in shards.items()})

    def masters(self) -> dict[int, torch.Tensor]:
        """Copies of the master values of this rank's shards, {bucket: values}."""
        out: dict[int, torch.Tensor] = {}
        for part in self.owner.call(lambda ap: {b: sh.state.master.clone() for b, sh in ap.shards.items()},
                                    self.timeout):
            out.update(part)
        return out

    def install_shards(self, values: dict[int, torch.Tensor]) -> None:
        """Write shard values {bucket: values of shard ``r`` ...} of this rank into the parameters."""
        self.install_values({(b, self.rank): v for b, v in values.items()})

    def install_values(self, values: dict[tuple[int, int], torch.Tensor]) -> None:
        """Write {(bucket, owner rank): shard values} into the local parameters."""
        with torch.no_grad():
            for (b, r), v in values.items():
                lay = self.layouts[b]
                ops_bucketing.unflatten(v.reshape(-1).to(self.device), [self.params[p].data for p in lay.params],
                                        lay.offsets, begin=lay.shards[r].begin)

    def drain(self, want: list[int]) -> None:
        """Wait (at most the timeout) until every owned shard has processed ``want[w]`` pushes from each
        worker w, pushes still on the network included."""
        self.owner.wait_processed(want, self.timeout, self._err)

    # -- close --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain, serve the others until every rank has closed, install the final values, stop."""
        if self.closed:
            return
        self.closed = True
        ok = False
        try:
            self.check()
            self.pusher.q.put(Control(wire.CLOSE, self.clock))
            with self.cond:
                self.wait_seconds += wait_until(
                    self.cond, self.mailbox.all_final, self.timeout, self._missing_finals, self._err
                )
            self.mailbox.install(final=True)
            ok = True
        finally:
            self.capture.remove()
            if ok:
                self._stop()

    def _stop(self) -> None:
        self.pusher.q.put(Stop(self.timeout))
        self.pusher.join(self.timeout.total_seconds())
        self.owner.stop(self.timeout)
        if self.mailbox.thread is not None:
            self.mailbox.thread.join(self.timeout.total_seconds())
        alive = [t.name for t in self.threads() if t.is_alive()]
        if alive:
            raise TimeoutError(f"pyasync: threads {alive} did not stop within {self.timeout}")
        self.check()
        if self.transport is not None:
            self.transport.close()

    def threads(self) -> list[threading.Thread]:
        return [t for t in (self.pusher, self.mailbox.thread, *self.owner.threads()) if t is not None]

    # -- stats --------------------------------------------------------------------------------------
    def installed_versions(self) -> dict[tuple[int, int], int]:
        with self.cond:
            return dict(self.mailbox.installed_version)

    def stats(self) -> Stats:
        st = Stats(clock=self.clock)
        st.min_included_clock = self.mailbox.min_included_clock(self.clock)
        for a in self.owner.appliers:
            st.bytes_sent += a.bytes_sent
            for sh in list(a.shards.values()):
                c = sh.round.c
                st.pushes_applied += c.applied
                st.pushes_dropped += c.dropped
                st.nonfinite_skipped += c.nonfinite
                st.updates_applied += c.updates
                for k, v in list(c.staleness.items()):
                    st.staleness[k] = st.staleness.get(k, 0) + v
        st.staleness = dict(sorted(st.staleness.items()))
        p = self.pusher
        st.bytes_sent += p.bytes_sent
        st.bytes_received = self.mailbox.bytes_received + self.owner.bytes_received
        st.wait_seconds = self.wait_seconds
        st.compression_ratio = p.raw_bytes / p.enc_bytes if p.enc_bytes else 1.0
        st.pushes_sent = p.pushes_sent
        return st
