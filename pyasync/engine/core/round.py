"""The round of one shard as a pure state machine: events in, actions out. No threads, no I/O, no tensors.

An owner keeps one :class:`Round` per shard it owns. Every message about that shard becomes an event
(:meth:`Round.push`, :meth:`Round.close`, :meth:`Round.pause`, :meth:`Round.depart`,
:meth:`Round.join`); each returns the list of actions the owner must carry out, in order:

* :class:`Apply`: apply this one push as an update of its own (SSP, ASP), gradient scaled by 1/n;
* :class:`Sum`: add this push to the round's aggregate (BSP, Quorum; late pushes under ``fold``);
* :class:`Update`: apply the aggregate (x ``scale``) as one update on the masked-in segments, then clear it;
* :class:`Gate`: (gated rounds) the aggregate of ``version`` is complete; its update waits for
  :meth:`AggregateRound.release` (BSP's clipping of the mean gradient needs every shard's norm first);
* :class:`Release`: the push will not be used (dropped, skipped, or already summed elsewhere);
* :class:`Answer`: send the shard's current values to these workers (``final``: the last word).

A push is identified by an opaque ``item`` (the owner's message, holding the payload and its receive
buffer); the machine only passes it back in Apply, Sum and Release, exactly once each push.

Two machines cover the four policies (see pyasync/policy.py, where each policy picks its machine):

* :class:`PushRound` (SSP(s), ASP): every push is its own update; the push of clock t is answered when
  ``policy.answer_now(t, included, closed)`` holds, ``lr_factor(staleness)`` scales its learning rate.
* :class:`AggregateRound` (BSP, Quorum(k)): pushes computed on the current version are summed in rank
  order (Note [Rank-order sum]) until ``policy.update_ready(pushers, absent, n)``; then one update,
  and every pusher is answered. A push computed on an older version (``policy.is_late``) is dropped,
  or summed into the next update under ``policy.folds_late``, and its sender is answered at once.

Note [Rank-order sum]
    fp32 addition is not associative, so an aggregate summed in arrival order differs in the last
    bits from run to run, and a BSP run resumed from a checkpoint would not be bit-identical to an
    uninterrupted one. Fresh pushes are therefore held until every lower rank has pushed (or closed)
    and summed in ascending rank order as soon as they can be, so most of the decoding still overlaps
    the wait for the last push. Under Quorum the round's pushers are not known in advance: what is
    still held when the update fires is summed then, again in ascending rank order, so the sum's
    order depends only on who pushed. Late pushes folded under Quorum(late="fold") go in on arrival.

Note [Reflected clocks]
    An answer carries, per worker, the highest clock c such that every push of that worker up to c is
    *in the values it sends* (applied, or never to be applied: dropped, not finite). Under SSP and ASP
    that is every push processed (``included``). An aggregate round holds pushes it has processed but
    not yet applied (fresh pushes waiting for the round to complete, late ones folded into the next
    update), so its answers carry less than ``included`` for their senders until the update. A
    worker keeps every push an answer it installed does not reflect yet (elastic membership): when
    the owner dies, exactly those are replayed on the freshest replica (pyasync/session/membership.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from pyasync.engine.core.actions import Action, Answer, Apply, Counters, Gate, Release, Sum, Update
from pyasync.errors import ProtocolError

__all__ = [
    "Action",
    "AggregateRound",
    "Answer",
    "Apply",
    "Gate",
    "PushRound",
    "Release",
    "Round",
    "Sum",
    "Update",
]


# -- the machine -------------------------------------------------------------------------------------
class Round:
    """Per-worker bookkeeping shared by both machines: clocks, closes, pauses, departures, answers."""

    def __init__(self, policy: Any, world_size: int, n_segments: int, name: Hashable = 0) -> None:
        self.policy = policy
        self.n = world_size
        self.n_segments = n_segments
        self.name = name  # for messages (the bucket index)
        self.version = 0  # updates applied to the shard
        self.processed = [0] * world_size  # pushes processed per worker (= included clock + 1)
        self.closed = [False] * world_size  # will push nothing more (CLOSE, or departed)
        self.departed = [False] * world_size  # left the membership (no answers, no final)
        self.paused = [False] * world_size  # waits in a barrier: pushes nothing until it resumes
        self.pending: dict[int, int] = {}  # worker -> clock of its push that waits for an answer
        self.finalized = False
        self.c = Counters()

    # -- events ---------------------------------------------------------------------------------------
    def push(self, w: int, clock: int, version: int, finite: bool, mask: Sequence[bool], item: Any) -> list:
        """Worker ``w``'s push of ``clock``, computed on shard ``version``; ``mask``: the segments it
        has a gradient for; ``finite``: False when it held NaN/Inf (never applied)."""
        self._check_push(w, clock, version, mask)
        self.processed[w] = clock + 1
        return self._on_push(w, clock, version, finite, tuple(bool(m) for m in mask), item)

    def close(self, w: int) -> list:
        """Worker ``w`` has pushed everything it ever will (CLOSE)."""
        self._check_worker(w)
        if self.closed[w]:
            raise ProtocolError(f"rank {w} closed twice (bucket {self.name})")
        self.closed[w] = True
        return self._on_absent(w) + self._maybe_finish()

    def pause(self, w: int, on: bool) -> list:
        """Worker ``w`` waits in a barrier and pushes nothing until it resumes (on), or is back (off).
        Aggregate rounds stop waiting for a paused worker (Note [Barriers and quorums])."""
        self._check_worker(w)
        self.paused[w] = on
        return self._on_absent(w) if on else []

    def depart(self, w: int) -> list:
        """Worker ``w`` left the membership (died, or was dropped): no more pushes from it are expected,
        it gets no more answers; a round that waits for it goes on without it."""
        self._check_worker(w)
        if self.departed[w]:
            return []
        self.departed[w] = True
        self.closed[w] = True
        self.pending.pop(w, None)
        return self._on_absent(w) + self._maybe_finish()

    def join(self, w: int, clock: int) -> list:
        """Worker ``w`` (re)joins; its next push carries ``clock``."""
        self._check_worker(w)
        if not self.departed[w]:
            raise ProtocolError(f"rank {w} joined bucket {self.name} without having departed")
        if clock < 0:
            raise ProtocolError(f"rank {w} joined with a negative clock {clock}")
        self.departed[w] = self.closed[w] = self.paused[w] = False
        self.processed[w] = clock
        return []

    # -- queries --------------------------------------------------------------------------------------
    @property
    def included(self) -> list[int]:
        """Per worker: the highest clock whose pushes (and all before) this shard has processed."""
        return [p - 1 for p in self.processed]

    @property
    def reflected(self) -> list[int]:
        """Per worker: the highest clock whose pushes (and all before) the shard's values reflect: what
        an answer carries (Note [Reflected clocks])."""
        return self.included

    def missing(self, clock: int) -> list[int]:
        """Workers whose pushes an answer to a push of ``clock`` still waits for (for error messages)."""
        raise NotImplementedError

    def unclosed(self) -> list[int]:
        return [w for w in range(self.n) if not self.closed[w]]

    # -- machine-specific -----------------------------------------------------------------------------
    def _on_push(self, w: int, clock: int, version: int, finite: bool, mask: tuple, item: Any) -> list:
        raise NotImplementedError

    def _on_absent(self, w: int) -> list:
        """Worker ``w`` closed, paused or departed: whatever waited for it may proceed."""
        raise NotImplementedError

    def _flush(self) -> list:
        """Every worker has closed: whatever is outstanding is applied (before the final answer)."""
        return []

    def _waiting(self) -> bool:
        """An update waits for something outside the round (a gate): no final answer yet."""
        return False

    # -- shared ---------------------------------------------------------------------------------------
    def _maybe_finish(self) -> list:
        if self.finalized or not all(self.closed) or self._waiting():
            return []
        out = self._flush()
        self.finalized = True
        live = tuple((w, self.processed[w] - 1) for w in range(self.n) if not self.departed[w])
        return [*out, Answer(live, final=True)]

    def _check_worker(self, w: int) -> None:
        if not 0 <= w < self.n:
            raise ProtocolError(f"worker rank {w} out of range for {self.n} workers (bucket {self.name})")

    def _check_push(self, w: int, clock: int, version: int, mask: Sequence[bool]) -> None:
        self._check_worker(w)
        b = self.name
        if self.departed[w]:
            raise ProtocolError(f"PUSH from rank {w} for bucket {b}, which has left the membership")
        if self.closed[w]:
            raise ProtocolError(f"PUSH from rank {w} for bucket {b} arrived after its CLOSE")
        if clock != self.processed[w]:
            raise ProtocolError(
                f"PUSH from rank {w} for bucket {b} has clock {clock}, expected {self.processed[w]} "
                "(a push was lost, duplicated or reordered)"
            )
        if version > self.version:
            raise ProtocolError(
                f"PUSH from rank {w} for bucket {b} was computed on version {version}, but the shard is "
                f"only at version {self.version}"
            )
        if len(mask) != self.n_segments:
            raise ProtocolError(
                f"PUSH from rank {w} for bucket {b} has {len(mask)} mask entries, expected {self.n_segments}"
            )


class PushRound(Round):
    """SSP(s) and ASP: each push is one update; answers wait as ``policy.answer_now`` says."""

    def __init__(self, policy: Any, world_size: int, n_segments: int, name: Hashable = 0) -> None:
        super().__init__(policy, world_size, n_segments, name)
        self.stale_mean: float | None = None  # running mean of the pushes' staleness (momentum correction)
        self.stale_of: dict[int, float] = {}  # worker -> running mean of its pushes' staleness (look-ahead)

    def _on_push(self, w: int, clock: int, version: int, finite: bool, mask: tuple, item: Any) -> list:
        if not finite:
            self.c.nonfinite += 1
            out: list = [Release(item)]
        else:
            stale = self.version - version
            m = self.stale_of.get(w)
            self.stale_of[w] = float(stale) if m is None else m + (stale - m) / 8
            p = self.policy
            per_round = bool(getattr(p, "round_moments", False))
            dc = float(getattr(p, "dc", 0.0)) if stale > 0 else 0.0
            clip = getattr(p, "clip", 0.0)
            gap = bool(getattr(p, "gap", False)) and stale > 0
            out = [Apply(item, p.lr_factor(stale, self.n), self._implicit(stale), per_round, dc, clip, gap)]
            self.version += 1
            self.c.applied += 1
            self.c.updates += 1
            self.c.stale(stale)
        self.pending[w] = clock
        return out + self._answer_ready()

    def _on_absent(self, w: int) -> list:
        return self._answer_ready()

    def _implicit(self, stale: int) -> float:
        """The implicit momentum of the pushes' staleness so far (0 when the policy does not correct)."""
        if not getattr(self.policy, "momentum_correction", False):
            return 0.0
        # A running mean over about the last 64 pushes: the staleness a push sees moves with the job.
        m = self.stale_mean
        self.stale_mean = float(stale) if m is None else m + (stale - m) / 64
        return self.policy.implicit_momentum(self.stale_mean)

    def _answer_ready(self) -> list:
        inc = self.included
        ready = tuple(
            (w, t) for w, t in sorted(self.pending.items()) if self.policy.answer_now(t, inc, self.closed)
        )
        for w, _ in ready:
            del self.pending[w]
        return [Answer(ready, ahead=self._ahead(ready))] if ready else []

    def _ahead(self, dests: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
        """Per dest, the updates its answer looks ahead by (Note [Look-ahead replies]): the policy's k,
        or under "auto" and "stale" the running mean of the worker's staleness (n - 1 before its first
        push); under "auto" ASP's owner stretches it to its floor (Owner.answer)."""
        la = getattr(self.policy, "lookahead", 0)
        if not la:
            return ()
        if la not in ("auto", "stale"):
            return tuple(int(la) for _ in dests)
        return tuple(round(self.stale_of.get(w, self.n - 1)) for w, _ in dests)

    def missing(self, clock: int) -> list[int]:
        inc = self.included
        return [
            w
            for w in range(self.n)
            if not self.closed[w] and not self.policy.answer_now(clock, [inc[w]], [False])
        ]


class AggregateRound(Round):
    """BSP and Quorum(k): one update from the mean of a round's pushes (see the module docstring)."""

    def __init__(
        self, policy: Any, world_size: int, n_segments: int, name: Hashable = 0, gated: bool = False
    ) -> None:
        super().__init__(policy, world_size, n_segments, name)
        self.gated = gated  # a complete aggregate waits for release(scale) (Gate action)
        self.parked: tuple | None = None  # (mask or None, waiters, fresh, fold_stale) of a gated update
        self.pushers: set[int] = set()  # workers with a fresh push in this round (finite or not)
        self.fresh = 0  # finite fresh pushes in the aggregate
        self.fold_stale: list[int] = []  # staleness of late pushes folded into the aggregate
        self.mask = [False] * n_segments  # union of the summed pushes' masks
        self.next = 0  # next worker rank to sum; every lower rank is summed, closed or paused
        self.held: dict[int, Any] = {}  # fresh pushes waiting for their turn (None: non-finite)
        self.members: list[tuple[int, int]] = []  # (worker, clock) of the pushes in the aggregate
        self.unreflected: dict[int, set[int]] = {}  # worker -> clocks processed, not yet in the values

    def _on_push(self, w: int, clock: int, version: int, finite: bool, mask: tuple, item: Any) -> list:
        if self.policy.is_late(version, self.version):
            if not finite:
                self.c.nonfinite += 1
                out: list = [Release(item)]
            elif self.policy.folds_late:
                self._union(mask)
                self.fold_stale.append(self.version - version)
                self._pending_values(w, clock)
                out = [Sum(item)]
            else:
                self.c.dropped += 1
                out = [Release(item)]
            return [*out, Answer(((w, clock),))]  # superseded: catch up at once
        self._pending_values(w, clock)
        if not finite:
            self.c.nonfinite += 1  # counts as zeros in the mean
            self.held[w] = None
            out = [Release(item)]
        else:
            self.held[w] = item
            self.fresh += 1
            self._union(mask)
            out = []
        out += self._sum_in_order()
        self.pushers.add(w)
        self.pending[w] = clock
        return out + self._maybe_update()

    def _on_absent(self, w: int) -> list:
        return self._sum_in_order() + self._maybe_update()

    def _pending_values(self, w: int, clock: int) -> None:
        self.members.append((w, clock))
        self.unreflected.setdefault(w, set()).add(clock)

    @property
    def reflected(self) -> list[int]:
        out = self.included
        for w, clocks in self.unreflected.items():
            if clocks:
                out[w] = min(clocks) - 1
        return out

    def _flush(self) -> list:
        if self.fresh or self.fold_stale or self.pending:
            return self._maybe_update(force=True)
        return []

    def _union(self, mask: tuple) -> None:
        self.mask = [a or b for a, b in zip(self.mask, mask)]

    def _absent(self) -> set[int]:
        return {w for w in range(self.n) if self.closed[w] or self.paused[w]}

    def _sum_in_order(self, flush: bool = False) -> list:
        out: list = []
        while self.next < self.n:
            w = self.next
            if w in self.held:
                item = self.held.pop(w)
                if item is not None:
                    out.append(Sum(item))
            elif not self.closed[w]:
                break
            self.next += 1
        if flush:
            for w in sorted(self.held):
                item = self.held.pop(w)
                if item is not None:
                    out.append(Sum(item))
        return out

    def _waiting(self) -> bool:
        return self.parked is not None

    def _maybe_update(self, force: bool = False) -> list:
        if self.parked is not None:
            return []  # the last aggregate still waits for its gate
        if not force and not (
            self.pushers and self.policy.update_ready(self.pushers, self._absent(), self.n)
        ):
            return []
        out = self._sum_in_order(flush=True)
        self.next = 0
        done = (
            tuple(self.mask) if self.fresh or self.fold_stale else None,
            tuple(sorted(self.pending.items())),
            self.fresh,
            self.fold_stale,
            self.members,
        )
        self.mask = [False] * self.n_segments
        self.pushers, self.fresh, self.fold_stale, self.members = set(), 0, [], []
        self.pending.clear()
        if self.gated:
            self.parked = done
            return [*out, Gate(self.version)]
        return out + self._finish_update(done, 1.0)

    def release(self, scale: float) -> list:
        """The gate of a parked aggregate opens: apply it x ``scale`` and answer its workers."""
        if self.parked is None:
            raise ProtocolError(f"bucket {self.name}: release() without a gated update waiting")
        done, self.parked = self.parked, None
        return self._finish_update(done, scale) + self._maybe_finish()

    def _finish_update(self, done: tuple, scale: float) -> list:
        mask, waiters, fresh, fold_stale, members = done
        for w, c in members:  # applied below (or nothing to apply): the values reflect them
            self.unreflected[w].discard(c)
        out: list = []
        if mask is not None:
            out.append(Update(mask, scale))
            self.version += 1
            self.c.updates += 1
            self.c.applied += fresh + len(fold_stale)
            if fresh:
                self.c.stale(0, fresh)
            for s in fold_stale:
                self.c.stale(s)
        if waiters:
            out.append(Answer(waiters))
        return out

    def missing(self, clock: int) -> list[int]:
        return [w for w in range(self.n) if not self.closed[w] and self.processed[w] <= clock]
