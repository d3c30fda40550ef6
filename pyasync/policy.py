"""Consistency policies: BSP, SSP(s), ASP, Quorum(k) and Local(H) (local steps). Pure decision logic, no I/O.

Vocabulary (see docs/architecture.md):

* A worker's *clock* is the number of its completed ``step()`` calls; the push it makes during step
  ``t`` carries clock ``t``.
* An owner counts *versions* of each of its shards: the number of updates applied to that shard.
* ``included[w]`` (as seen by one shard) is the highest clock ``c`` such that every push of worker
  ``w`` with clock ``<= c`` has been processed by the shard (applied, dropped or skipped), ``-1`` when
  none has. A closed worker has pushed everything it ever will.

Each policy picks the round machine its owners run (:meth:`Policy.round`, see pyasync/engine/core/round.py)
and answers that machine's questions:

* SSP(s) and ASP run a :class:`~pyasync.engine.core.round.PushRound` (every push is its own update):
  :meth:`answer_now` (may the push of clock ``t`` be answered with the shard's current values? The
  worker waits for that answer, so this is where SSP's bound lives) and :meth:`lr_factor`.
* BSP and Quorum(k) run an :class:`~pyasync.engine.core.round.AggregateRound` (one update from the mean of
  several pushes): :meth:`update_ready` (is the aggregate complete?), :meth:`is_late` (was a push
  computed on a superseded version?) and :attr:`folds_late` (is a late push added to the next update
  rather than dropped?).

The worker side needs only :attr:`Policy.worker_waits`; :meth:`SSP.may_start` states SSP's rule from
the worker's point of view and is what the tests check the installed parameters against.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Union

from pyasync._validate import check_int
from pyasync.engine.core.round import AggregateRound, PushRound, Round

__all__ = ["ASP", "BSP", "SSP", "Local", "Policy", "Quorum", "parse_policy"]

_LR_SCALES = (None, "inverse", "delay", "round")
#: The spike clip's factor under ``clip="auto"`` where the optimizer keeps moments (Note [Spike clipping]).
AUTO_CLIP = 1.5
#: Under ``lookahead="auto"`` an answer looks ahead by at least this fraction of the momentum's memory,
#: 1 / (1 - mu) updates of the per-update momentum mu (Note [Look-ahead replies]).
LOOKAHEAD_MEMORY = 0.5


class Policy:
    """Base class. Subclasses are small immutable dataclasses; ``spec()`` round-trips through
    :func:`parse_policy`."""

    #: Whether ``step()`` waits for the owners' answers to its pushes.
    worker_waits: bool = True
    #: ``max_grad_norm`` clips the mean gradient of a round (BSP, as DDP + clip_grad_norm_ does) rather
    #: than each worker's push.
    clips_mean: bool = False
    #: Every worker holds the same values between steps and no reply is in flight then, so what the
    #: workers hold can be saved and restored exactly (Note [Checkpoints and held values]).
    resumes_exactly: bool = False

    def spec(self) -> str:
        raise NotImplementedError

    def validate(self, world_size: int) -> None:
        """Raise ValueError when the policy cannot run with ``world_size`` workers."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")

    def round(self, world_size: int, n_segments: int, name: Hashable = 0, gated: bool = False) -> Round:
        """The state machine an owner runs for one shard (``n_segments`` parameters overlap it);
        ``gated``: complete aggregates wait for a release (only for policies that ``clips_mean``)."""
        raise NotImplementedError

    def divisor(self, world_size: int) -> int:
        """The mean's denominator: each push's gradient is scaled by 1 / divisor."""
        return world_size

    def __str__(self) -> str:
        return self.spec()


def _check_lr_scale(lr_scale: str | None) -> None:
    if lr_scale not in _LR_SCALES:
        raise ValueError(f"lr_scale must be None, 'inverse', 'delay' or 'round', got {lr_scale!r}")


def _check_per_push(p) -> None:
    _check_lr_scale(p.lr_scale)
    for name in ("momentum_correction", "round_moments", "gap"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(p, name)!r}")
    if not isinstance(p.dc, (int, float)) or not math.isfinite(p.dc) or p.dc < 0:
        raise ValueError(f"dc (the delay compensation's lambda) must be a finite number >= 0, got {p.dc!r}")
    la = p.lookahead
    if la not in ("auto", "stale") and (isinstance(la, bool) or not isinstance(la, int) or la < 0):
        raise ValueError(
            f"lookahead must be 'auto', 'stale' or a number of updates >= 0 (0: off), got {la!r}; "
            "Note [Look-ahead replies] in pyasync/policy.py"
        )
    c = p.clip
    bad = isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or 0 < c < 1
    if c != "auto" and bad:
        raise ValueError(
            f"clip must be 'auto', 0 (off) or a factor >= 1 on the running norm of the pushes, got {c!r}; "
            "Note [Spike clipping] in pyasync/policy.py"
        )


class _PerPush(Policy):
    """SSP and ASP: every push is applied on arrival as one update (gradient scaled by 1/n).

    Note [A round of pushes]
        Under SSP and ASP each push is one optimizer update of the shard, and n pushes (one per worker)
        make a round, which should move the parameters as far as one BSP update of their mean:
        * SGD (with or without momentum): each push's gradient is scaled by 1/n, so a round sums to the
          mean (a momentum buffer then carries each push's share for as long as BSP's would).
        * Adam and AdamW divide by the root of the second moment, which undoes any scale on the gradient
          (up to eps): scaled by 1/n, each push was a full-size Adam step and a round moved about n times
          as far as BSP. So for them the learning rate is scaled by 1/n instead, and the gradient is
          not: the moments see gradients of the size BSP's see, eps keeps its meaning, and a round of n
          steps of lr/n moves as far as one BSP step.
        * Any other optimizer class (applied by a private instance of it): the gradient is scaled by
          1/n, as for SGD; an adaptive one needs its learning rate divided by n by the user.
        * SGD's weight decay is not scaled: it acts at every push, n times per round where BSP's acts
          once (with ``moments=round`` it is scaled with the gradient). AdamW's decoupled decay
          follows the lr/n and so acts once per round.
        tests/engine/test_async_math.py checks both against BSP with equal workers and no delay.

    Note [Moments per round]
        That alone leaves the optimizer's moments advancing per push: a momentum of 0.9 forgets in 10
        pushes, 2.5 rounds of 4 workers, where BSP's forgets in 10 rounds, so each update follows one
        worker's noise four times as closely, with stale values besides. On the ``seq`` transformer
        (SGD, momentum 0.9) that oscillated around 0.6-0.7 token accuracy where BSP reaches 0.997
        (docs/benchmarks.md, "Why asynchrony hurt"). With ``round_moments=True`` ("moments=round")
        the moments advance per round: each push uses the n-th root of the momentum (SGD) or of beta1
        and beta2 (Adam), so they forget over as many rounds as BSP's; SGD's gradient and weight decay
        are scaled by (1 - momentum^(1/n)) / (1 - momentum) on top of 1/n, so each gradient still
        moves the parameters as far in total as in BSP. Adam's bias corrections follow, as its step
        count counts pushes. With equal workers and no delay this follows BSP within 5% over 40 rounds
        (tests/engine/test_async_math.py). On its own it bought nothing on ``seq`` with the straggler
        (0.67 final accuracy against 0.70 per push); with look-ahead replies it is what makes them work
        (Note [Look-ahead replies]), so it is on by default ("moments=push" turns it off).

    Note [Momentum correction]
        Asynchrony adds momentum of its own: applying gradients that are tau updates old behaves, in
        expectation, like momentum SGD with momentum tau / (tau + 1) (Mitliagkas et al. 2016,
        "Asynchrony begets momentum"; M workers in their queue model see a staleness of M - 1). On top
        of an explicit momentum of 0.9 the total exceeds what the learning rate was tuned for, and
        training oscillates or diverges. With ``momentum_correction=True`` ("mc=on") each push's
        update uses the explicit momentum ``max(0, beta - tau_bar / (tau_bar + 1))``, where beta is the
        momentum (SGD) or beta1 (Adam) the update would use and tau_bar the running mean of the
        staleness of the shard's pushes (about the last 64), so that explicit and implicit momentum add
        up to what the user chose. Measured, it is off by default: on ``seq`` it took the momentum
        from 0.9 to about 0.15 and training then crawled (0.40 after the budget where BSP reaches
        0.997), because the implicit momentum of the theory did not give the lost displacement back
        (docs/benchmarks.md, "Why asynchrony hurt").

    Note [Delay compensation]
        With ``dc`` = lambda > 0 ("dc=0.04") the owner compensates each push for the updates it missed
        (DC-ASGD, Zheng et al. 2017): g + lambda * g * g * (w_now - w_held), with w_held the values the
        pushing worker was last answered with (what it computed on when it has no push unanswered,
        ASP's default; the values of its last answer otherwise, an approximation). The formula is one
        function of the shared C++ math, fused into the apply kernels (CPU and CUDA). The owner keeps
        w_held per worker and shard: one more copy of the model per rank, as compressed replies
        already keep (Note [Compressed replies on the point-to-point path]). A generic optimizer
        class (not SGD, Adam or AdamW) is not compensated.

    Note [Gap-aware penalty]
        With ``gap=True`` ("gap=on") the owner divides each stale push's gradient, per element, by how
        far that element moved since the values the pushing worker was answered with, counted in the
        element's usual step: g / max(1, |w_now - w_held| / C), C the running mean of |the element's
        change per update| on this shard (about the last 100 updates, from zero: a mean of the first
        few), the penalty starting once that mean has seen GAP_WARMUP updates of the shard, from the start
        or from a restore (engine/core/rule.py; Gap-Aware, Barkai, Hakimi and
        Schuster, ICLR 2020). Unlike a penalty by the staleness (``lr_scale="inverse"``) it leaves an
        element that moved little (or back and forth) alone and damps the ones the other workers'
        updates carried far. w_held is delay compensation's (Note [Delay compensation]), kept per
        worker and shard; C is one more tensor of optimizer state per shard ("gap_step": checkpointed
        and re-split with the others). The gap counts what the look-ahead reply added on purpose, so
        with the penalty ASP's ``lookahead="auto"`` is the staleness alone (as "stale"), not the floor
        of Note [Look-ahead replies]: with the floor the penalty read a look-ahead of 20 updates as a
        gap of ~17 and ``seq`` collapsed (0.34). SGD, Adam and AdamW; a generic optimizer class is
        not penalized. Off by default; it is computed with torch operations next to the fused apply
        (the gradient is decoded to scratch first), not inside it. Measured in docs/benchmarks.md,
        "The gap-aware penalty".

    Note [Look-ahead replies]
        A push applied tau updates after the values it was computed on is a gradient taken at the wrong
        point; with momentum most of the gap is predictable, because the owner's momentum keeps moving
        the parameters whatever the next gradients are. With ``lookahead`` = k ("lookahead=3") an owner
        answers a worker not with its master values w but with where w will be after k more updates
        whose gradients are zero: w - lr * (mu + mu^2 + ... + mu^k) * buf for SGD (momentum mu, buffer
        buf), w - lr/n * (b1 + ... + b1^k) * m_hat / (sqrt(v_hat) + eps) for Adam and AdamW (the step
        of Note [A round of pushes]). The worker's gradient is then taken about where its push will
        land: Nesterov's look-ahead, carried over to asynchrony (DANA, Hakimi et al. 2019). With
        ``lookahead="auto"`` ("lookahead=auto") k is, for each worker answered, the running mean of
        the staleness of its pushes (about the last 8, rounded), so the look-ahead follows the measured
        delay: n - 1 or so for a fast worker, more for a straggler; under ASP, "auto" also spans at
        least half the momentum's memory, LOOKAHEAD_MEMORY / (1 - mu) updates of the per-update
        momentum mu (beta1 for Adam), per param group: 20 pushes for momentum 0.9 per round of 4
        workers. ``lookahead="stale"`` is the staleness alone (ASP's "auto" before the floor; SSP's
        "auto"). The masters and the optimizer
        state are not touched, only what the workers are sent; the final answer (after every worker
        closed) is the master itself, so replicas end equal. Without momentum state (SGD without
        momentum, a generic optimizer) the answer is the master. With ``moments=round`` the prediction
        uses the per-push momentum mu^(1/n) (b1^(1/n)) the updates use; it ignores weight decay, lr
        scales and Nesterov's own flag: it is a look-ahead, not a replay.

        Why with moments per round: what the look-ahead cannot predict is the gradients that arrive
        during the delay. Per push, each of them enters the update with weight 1 - mu (of a momentum
        mu = 0.9, its share of the displacement); per round (mu^(1/n) = 0.974 per push for n = 4),
        with 1 - mu^(1/n), four times less, and the buffer the look-ahead extrapolates carries the
        rest. On ``seq`` with the straggler (median of three seeds, with the spike clip; docs/benchmarks.md,
        "Defaults that converge") SSP(1) went from 0.984 (look-ahead with moments per push) to 0.994,
        BSP's 0.997 within half a point, and ASP, which also waits for its own answers now, from 0.83
        to 0.95. Both are the defaults ("lookahead=off", "moments=push" turn them off).

        Why ASP's floor: looking further ahead than the delay, as Nesterov looks one step ahead of the
        momentum, measured better for ASP and worse for SSP (three seeds each, 4 workers, one 2x
        straggler, "A longer look-ahead" in docs/benchmarks.md): ASP with 20 updates against the
        staleness (3) ended 1.05 points below BSP on ``seq`` with SGD momentum (median; -5.06 with the
        staleness), 0.7% above DDP's loss on ``lm`` with AdamW (+1.6%), and closer on ``lm`` with SGD
        momentum too; SSP(1) and SSP(3) lost 0.5-1.5 points with it. A reading, not tested apart:
        ASP's pushes arrive one by one, each 3-6 updates old, and the momentum carries each of them
        over the next ~38 updates, so a gradient taken where the master will be some way into that
        span meets the parameters it acts on; SSP's rounds arrive together, 0-3 updates old, and its
        workers already wait for them. Only n = 4 and momentum 0.9 were measured; for momentum 0.99 the
        floor is 10x longer, unmeasured. When an
        owner dies (``elastic=True``), its shards' values come from the freshest replica, which holds a
        look-ahead: the new master then starts k momentum steps ahead, the displacement the lost
        momentum (re-initialized, or taken from the epoch's checkpoint) would have carried anyway.
        Measured on ``seq`` (docs/benchmarks.md, "Look-ahead replies and spike clipping").

    Note [Spike clipping]
        The asynchronous runs on ``seq`` climbed as fast as BSP's and then fell off a cliff (0.98 -> 0.25
        token accuracy in one snapshot): a stale gradient that is much larger than usual, applied on its
        own, throws the model out of its basin, where BSP would have averaged it with n - 1 others.
        With ``clip`` = c >= 1 ("clip=1.5") the owner scales each push's gradient on a shard down to
        at most c times the running mean of the norms it applied on that shard (about the last 32
        pushes, after clipping; the first push sets it): an adaptive clip that only touches outliers.
        The user's ``max_grad_norm`` still clips each push first, on its worker. The running
        norm is not checkpointed; it restarts with the first push after a restore. Its cost: one
        norm per push (int8 and sign decode to scratch for it, a second decode) and, on a GPU, a
        host sync in the applier thread to read it; the fused kernels take the factor as a scalar.

        The default, ``clip="auto"``, is c = AUTO_CLIP (1.5) where the optimizer keeps moments
        (momentum, Adam) and no clip where it does not. With moments a spike is not applied once but
        carried by the buffer for about 1/(1 - mu) updates, and that is where the cliffs were seen: on
        ``seq`` with the straggler SSP(3) with look-ahead ended at 0.897 without the clip and 0.988
        with it (one seed each; docs/benchmarks.md, "Look-ahead replies and spike clipping"); the clip
        alone did not reach the target.
        Plain SGD applies each push once, unbiased: clipping would only bend its sum, so "auto" leaves
        it alone. "clip=off" turns it off, "clip=<c>" sets c for every optimizer."""

    lr_scale: str | None = None
    momentum_correction: bool = False
    round_moments: bool = True
    dc: float = 0.0
    gap: bool = False
    lookahead: int | str = "auto"
    clip: float | str = "auto"

    def round(self, world_size: int, n_segments: int, name: Hashable = 0, gated: bool = False) -> Round:
        if gated:
            raise ValueError(f"{self.spec()} clips each push, not a round's mean: its rounds are never gated")
        return PushRound(self, world_size, n_segments, name)

    def answer_now(self, clock: int, included: Sequence[int], closed: Sequence[bool]) -> bool:
        """May a worker's push of clock ``clock`` be answered with the current shard values?

        ``included[w]``: highest clock of worker w fully processed by this shard (-1: none);
        ``closed[w]``: worker w has closed (it will push nothing more)."""
        raise NotImplementedError

    def lr_factor(self, staleness: int, world_size: int = 1) -> float:
        """Factor on the learning rate of an update whose push is ``staleness`` versions old:
        1/max(1, staleness) with ``lr_scale="inverse"``; min(1, n/staleness) with ``lr_scale="delay"``
        (delay-adaptive steps, Mishchenko et al. 2022, Koloskova et al. 2022: the n - 1 or so updates
        of the other workers that any push sees cost nothing, only a longer delay shrinks the step);
        1 / (1 + staleness / n) with ``lr_scale="round"`` (the step shrinks with the delay counted in
        rounds of n pushes: a push one round old takes half a step; Note [Why staleness hurts here] in
        bench/harness/seqtask.py); else 1."""
        if self.lr_scale == "inverse":
            return 1.0 / max(1, staleness)
        if self.lr_scale == "delay":
            return min(1.0, world_size / max(1, staleness))
        if self.lr_scale == "round":
            return 1.0 / (1.0 + staleness / world_size)
        return 1.0

    def implicit_momentum(self, mean_staleness: float) -> float:
        """The momentum a mean staleness of ``mean_staleness`` implies (Note [Momentum correction])."""
        return mean_staleness / (mean_staleness + 1.0) if self.momentum_correction else 0.0

    @property
    def lookahead_memory(self) -> float:
        """The least look-ahead, as a fraction of the momentum's memory 1 / (1 - mu) in updates, that
        the answers span (0: none; Note [Look-ahead replies]): LOOKAHEAD_MEMORY for ASP under "auto"."""
        return 0.0

    def _options(self) -> str:
        """The spec's suffix for the options that differ from their defaults."""
        out = f":{self.lr_scale}" if self.lr_scale else ""
        out += ":mc=on" if self.momentum_correction else ""
        out += "" if self.round_moments else ":moments=push"
        out += f":dc={self.dc:g}" if self.dc else ""
        out += ":gap=on" if self.gap else ""
        la = self.lookahead
        out += "" if la == "auto" else f":lookahead={la}" if la else ":lookahead=off"
        c = self.clip
        out += "" if c == "auto" else f":clip={c:g}" if c else ":clip=off"
        return out


class _Aggregate(Policy):
    """BSP and Quorum: one update per version from the mean of several pushes."""

    #: A push computed on a superseded version is added to the next update (True) or dropped.
    folds_late: bool = False

    def round(self, world_size: int, n_segments: int, name: Hashable = 0, gated: bool = False) -> Round:
        return AggregateRound(self, world_size, n_segments, name, gated=gated)

    def update_ready(self, pushed: AbstractSet[int], absent: AbstractSet[int], world_size: int) -> bool:
        """Is the aggregate complete, given the workers ``pushed`` that contributed a push to it and the
        workers ``absent`` (closed, or paused in a barrier) that will push nothing for it?"""
        raise NotImplementedError

    def is_late(self, push_version: int, current_version: int) -> bool:
        """Was this push computed on a version the shard has already moved past?"""
        return False


@dataclass(frozen=True)
class BSP(_Aggregate):
    """Bulk-synchronous: for every clock t each owner applies ONE update from the mean of all n
    workers' gradients of clock t, and a worker starts step t+1 only on parameters that include update t
    from every owner. Equal to DDP with the same optimizer, up to float rounding.

    It runs on collectives (reduce-scatter or all-to-all, then all-gather: Note [BSP on collectives] in
    pyasync/engine/collective/engine.py); ``p2p=True`` ("bsp:p2p") runs it on the point-to-point engine of the
    other policies instead, where workers may also take different numbers of steps (a worker that
    closed counts as zeros)."""

    p2p: bool = False
    clips_mean = True
    resumes_exactly = True

    def spec(self) -> str:
        return "bsp:p2p" if self.p2p else "bsp"

    def update_ready(self, pushed: AbstractSet[int], absent: AbstractSet[int], world_size: int) -> bool:
        # Every worker that can still push has pushed; workers that closed early count as zeros in the
        # mean (the divisor stays n).
        return bool(pushed) and all(w in pushed or w in absent for w in range(world_size))


@dataclass(frozen=True)
class SSP(_PerPush):
    """Stale-synchronous with bound ``staleness`` = s >= 0: every push is applied on arrival as one
    update (gradient scaled by 1/n); a worker may start step t only on parameters that include every
    worker's pushes of every clock <= t - s - 1. ``lr_scale="inverse"`` divides each update by
    max(1, staleness). By default (as for ASP) the optimizer's moments advance per round of n pushes,
    answers look ahead by the worker's staleness (ASP: at least half the momentum's memory) and spikes
    are clipped where the optimizer keeps
    moments (Notes [Moments per round], [Look-ahead replies], [Spike clipping]; "moments=push",
    "lookahead=off", "clip=off" turn each off)."""

    staleness: int = 0
    lr_scale: str | None = None
    momentum_correction: bool = False
    round_moments: bool = True
    dc: float = 0.0
    gap: bool = False
    lookahead: int | str = "auto"
    clip: float | str = "auto"

    def __post_init__(self) -> None:
        check_int("SSP staleness", self.staleness, lo=0)
        _check_per_push(self)

    def spec(self) -> str:
        return f"ssp:{self.staleness}" + self._options()

    def may_start(self, clock: int, included: Sequence[int]) -> bool:
        """May a worker start step ``clock`` on parameters whose shards include, for every worker w,
        all pushes of clocks <= included[w]?"""
        need = clock - self.staleness - 1
        return all(c >= need for c in included)

    def answer_now(self, clock: int, included: Sequence[int], closed: Sequence[bool]) -> bool:
        # The answer to push `clock` is what the worker starts step clock+1 on.
        need = clock - self.staleness
        return all(done or c >= need for c, done in zip(included, closed))


@dataclass(frozen=True)
class ASP(_PerPush):
    """Asynchronous: every push is applied on arrival (gradient scaled by 1/n) and answered at once;
    a worker does not wait for the others, it installs whatever shard values have arrived.

    ``max_unanswered`` bounds the pushes a worker may have unanswered when it starts a step: with 0 (the
    default) it starts step t + 1 once every owner answered its push of step t (so it computes on
    values that hold its own last update), with 1 it may compute step t + 1 while the answers to step
    t are on their way, and so on; None ("unanswered=inf") is no bound. ``patience`` bounds that wait
    (seconds, "auto": about one step; inf: until the timeout): an owner that does not answer in time
    is not waited for (Notes [Where staleness comes from] and [Patience with one's own answers] in
    pyasync/engine/p2p/engine.py)."""

    lr_scale: str | None = None
    momentum_correction: bool = False
    round_moments: bool = True
    dc: float = 0.0
    gap: bool = False
    lookahead: int | str = "auto"
    clip: float | str = "auto"
    max_unanswered: int | None = 0
    patience: float | str = "auto"
    worker_waits = False

    def __post_init__(self) -> None:
        _check_per_push(self)
        if self.max_unanswered is not None:
            check_int("ASP max_unanswered", self.max_unanswered, lo=0)
        p = self.patience
        if p != "auto" and (isinstance(p, (str, bool)) or not isinstance(p, (int, float)) or not p >= 0):
            raise ValueError(
                f"ASP patience must be 'auto' or a number of seconds >= 0 (inf: until the timeout), got {p!r}"
            )

    def spec(self) -> str:
        u, p = self.max_unanswered, self.patience
        out = "asp" + self._options()
        out += "" if u == 0 else ":unanswered=inf" if u is None else f":unanswered={u}"
        return out + ("" if p == "auto" else f":patience={p:g}")

    def may_start(self, clock: int, included: Sequence[int]) -> bool:
        return True

    def answer_now(self, clock: int, included: Sequence[int], closed: Sequence[bool]) -> bool:
        return True

    @property
    def lookahead_memory(self) -> float:
        # Note [Gap-aware penalty]: with it "auto" is the staleness alone, as "stale"
        return LOOKAHEAD_MEMORY if self.lookahead == "auto" and not self.gap else 0.0


@dataclass(frozen=True)
class Quorum(_Aggregate):
    """Backup workers: an owner applies one update for version v from the mean of the first k pushes
    computed on version v. Pushes computed on an older version are dropped and counted
    (``late="drop"``) or added to the next update with their staleness recorded (``late="fold"``).
    A worker that pushed for version v waits for a newer version; a superseded worker does not wait.
    Quorum(n) equals BSP."""

    k: int = 1
    late: str = "drop"

    def __post_init__(self) -> None:
        check_int("Quorum k", self.k, lo=1)
        if self.late not in ("drop", "fold"):
            raise ValueError(f"Quorum late must be 'drop' or 'fold', got {self.late!r}")

    @property
    def folds_late(self) -> bool:  # type: ignore[override]
        return self.late == "fold"

    def spec(self) -> str:
        return f"quorum:{self.k}" + (":fold" if self.late == "fold" else "")

    def validate(self, world_size: int) -> None:
        super().validate(world_size)
        if self.k > world_size:
            raise ValueError(
                f"Quorum k={self.k} exceeds the number of workers ({world_size}); use 1 <= k <= {world_size}"
            )

    def update_ready(self, pushed: AbstractSet[int], absent: AbstractSet[int], world_size: int) -> bool:
        # k pushes, or fewer when nobody else can push any more (workers closed or paused): never stall.
        if len(pushed) >= min(self.k, world_size):
            return True
        return bool(pushed) and all(w in pushed or w in absent for w in range(world_size))

    def divisor(self, world_size: int) -> int:
        return min(self.k, world_size)

    def is_late(self, push_version: int, current_version: int) -> bool:
        return push_version < current_version


_LOCAL_MODES = ("sync", "quorum", "async")
#: Local's outer (lr, momentum) by mode, as measured (docs/benchmarks.md, "Local steps"): DiLoCo's 0.7 and
#: 0.9 diverged on `seq` (SGD momentum) and ended 2.2% above DDP's loss on `lm` (AdamW); see Note
#: [Outer step defaults] in pyasync/local.py.
LOCAL_OUTER_DEFAULTS = {"sync": (0.5, 0.8), "quorum": (0.5, 0.8), "async": (1.0, 0.3)}


@dataclass(frozen=True)
class Local(Policy):
    """Local steps (Local SGD, DiLoCo): every worker takes ``steps`` (H) steps of the user's optimizer on
    its own replica, then pushes its change since the last sync (a pseudo-gradient) and installs the new
    global values. The owners run an outer optimizer on their shards: Nesterov SGD at ``outer_lr`` and
    ``outer_momentum`` (None: the mode's measured defaults, LOCAL_OUTER_DEFAULTS: 0.5 and 0.8 synchronous
    and quorum, 1.0 and 0.3 async; Note [Outer step defaults] in pyasync/local.py). How the pushes of an
    outer step meet is ``mode``'s: "sync" (every worker, as BSP; ``local:H``), "quorum" (the first ``k``
    workers' changes, as Quorum(k), later ones dropped; ``local:H:quorum:K``) or "async" (each change
    applied on arrival with the delayed Nesterov outer step, Note [Delayed Nesterov]; ``local:H:async``).
    The worker side is pyasync/local.py (Note [Local steps]); the round machine is the outer policy's
    (:meth:`outer`). ``adaptive``: each worker's number of steps per outer step follows its measured
    speed, H for the fastest, fewer for slower ones, so that they all arrive together (dynamic local
    updates, Note [Dynamic local steps] in pyasync/local.py; ``local:H:async:adaptive``)."""

    steps: int = 16
    mode: str = "sync"
    k: int = 0
    outer_lr: float | None = None
    outer_momentum: float | None = None
    adaptive: bool = False

    def __post_init__(self) -> None:
        check_int("Local steps", self.steps, lo=1)
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"Local adaptive must be a bool, got {self.adaptive!r}")
        if self.adaptive and self.mode == "sync":
            raise ValueError(
                "Local adaptive=True needs mode='async' or 'quorum' ('local:H:async:adaptive'): a slower "
                "worker takes fewer steps per outer step, so it reaches more outer steps than the others "
                "in the same number of step() calls, and a synchronous outer step waits for every worker"
            )
        if self.mode not in _LOCAL_MODES:
            raise ValueError(f"Local mode must be one of {_LOCAL_MODES}, got {self.mode!r}")
        lr, mu = LOCAL_OUTER_DEFAULTS[self.mode]
        if self.outer_lr is None:
            object.__setattr__(self, "outer_lr", lr)
        if self.outer_momentum is None:
            object.__setattr__(self, "outer_momentum", mu)
        if self.mode == "quorum":
            check_int("Local quorum k", self.k, lo=1)
        elif self.k != 0:
            raise ValueError(
                f"Local k (the quorum) is only for mode='quorum', got k={self.k} with mode={self.mode!r}"
            )
        for name in ("outer_lr", "outer_momentum"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Local {name} must be a finite number >= 0, got {v!r}")
        if self.outer_momentum >= 1:
            raise ValueError(f"Local outer_momentum must be < 1, got {self.outer_momentum!r}")

    def outer(self, elastic: bool = False) -> Policy:
        """The policy the outer steps' pushes follow: BSP (on collectives; point-to-point when
        ``elastic``), Quorum(k) with late changes dropped, or ASP with the owners' answers awaited
        without a patience, and no look-ahead or clip (the delayed Nesterov step is the correction)."""
        if self.mode == "sync":
            return BSP(p2p=elastic)
        if self.mode == "quorum":
            return Quorum(self.k)
        # patience inf: an owner that does not answer is waited for (until it answers, the heartbeats
        # drop it under elastic=True, or the timeout): Note [Local steps] in pyasync/local.py.
        return ASP(lookahead=0, clip=0.0, round_moments=True, max_unanswered=0, patience=math.inf)

    def spec(self) -> str:
        out = f"local:{self.steps}"
        out += f":quorum:{self.k}" if self.mode == "quorum" else ":async" if self.mode == "async" else ""
        out += ":adaptive" if self.adaptive else ""
        lr, mu = LOCAL_OUTER_DEFAULTS[self.mode]
        out += f":lr={self.outer_lr:g}" if self.outer_lr != lr else ""
        return out + (f":momentum={self.outer_momentum:g}" if self.outer_momentum != mu else "")

    def validate(self, world_size: int) -> None:
        self.outer().validate(world_size)

    def round(self, world_size: int, n_segments: int, name: Hashable = 0, gated: bool = False) -> Round:
        return self.outer().round(world_size, n_segments, name, gated)

    def divisor(self, world_size: int) -> int:
        return self.outer().divisor(world_size)


PolicyLike = Union[Policy, str, None]  # noqa: UP007 - a runtime alias, kept readable on 3.10


def parse_policy(x: PolicyLike) -> Policy:
    """A Policy from a Policy, None (BSP) or a spec string: "bsp", "asp", "asp:inverse", "ssp:2",
    "ssp:2:inverse", "quorum:3", "quorum:3:fold"."""
    if x is None:
        return BSP()
    if isinstance(x, Policy):
        return x
    if not isinstance(x, str):
        raise TypeError(
            f"policy must be a pyasync Policy (BSP(), SSP(s), ASP(), Quorum(k)) or a string, got "
            f"{type(x).__name__}"
        )
    parts = x.strip().lower().split(":")
    name, args = parts[0], parts[1:]
    opts = dict(a.split("=", 1) for a in args if "=" in a)
    args = [a for a in args if "=" not in a]
    try:
        if name in ("asp", "ssp"):
            return _parse_per_push(name, args, opts)
        if name == "local":
            return _parse_local(args, opts)
        if opts:
            raise ValueError(f"{name} takes no key=value options")
        if name == "bsp" and not args:
            return BSP()
        if name == "bsp" and args == ["p2p"]:
            return BSP(p2p=True)
        if name == "quorum" and 1 <= len(args) <= 2:
            return Quorum(int(args[0]), late=args[1] if len(args) == 2 else "drop")
    except ValueError as e:
        raise ValueError(f"bad policy string {x!r}: {e}") from None
    raise ValueError(
        f"unknown policy string {x!r}; use 'bsp', 'bsp:p2p', 'asp', 'ssp:<s>', 'quorum:<k>' or "
        "'quorum:<k>:fold'; asp and ssp take an lr scale ('asp:inverse', 'ssp:2:delay') and options "
        "'moments=push|round', 'mc=on|off' (momentum correction), 'dc=<lambda>' (delay compensation), "
        "'gap=on|off' (gap-aware penalty), "
        "'lookahead=auto|stale|<k>|off', 'clip=auto|<c>|off' and, for asp, 'unanswered=<k or inf>' and "
        "'patience=auto|<seconds>|inf'; local steps: 'local:<H>', 'local:<H>:quorum:<k>', 'local:<H>:async', "
        "each optionally ':adaptive', with options 'lr=<outer lr>' and 'momentum=<outer momentum>'"
    )


def _parse_local(args: list[str], opts: dict[str, str]) -> Policy:
    """Local(...) from "local:H", "local:H:quorum:K", "local:H:async" and lr= / momentum= options."""
    bad = sorted(set(opts) - {"lr", "momentum"})
    if bad:
        raise ValueError(f"unknown option(s) {bad} for local; it takes ['lr', 'momentum']")
    kw: dict = {}
    if "lr" in opts:
        kw["outer_lr"] = float(opts["lr"])
    if "momentum" in opts:
        kw["outer_momentum"] = float(opts["momentum"])
    if args and args[-1] == "adaptive":
        kw["adaptive"] = True
        args = args[:-1]
    if len(args) == 1:
        return Local(int(args[0]), **kw)
    if len(args) == 2 and args[1] == "async":
        return Local(int(args[0]), mode="async", **kw)
    if len(args) == 3 and args[1] == "quorum":
        return Local(int(args[0]), mode="quorum", k=int(args[2]), **kw)
    raise ValueError(
        "local takes its number of steps, then nothing, 'async' or 'quorum:<k>', then optionally 'adaptive'"
    )


def _parse_per_push(name: str, args: list[str], opts: dict[str, str]) -> Policy:
    """ASP or SSP from the spec's positional ``args`` and its key=value ``opts``."""
    known = {"mc", "moments", "dc", "gap", "lookahead", "clip"}
    known |= {"unanswered", "patience"} if name == "asp" else set()
    bad = sorted(set(opts) - known)
    if bad:
        raise ValueError(f"unknown option(s) {bad} for {name}; it takes {sorted(known)}")
    mc, moments = opts.get("mc", "off"), opts.get("moments", "round")
    if mc not in ("on", "off"):
        raise ValueError(f"mc must be 'on' or 'off', got {mc!r}")
    if moments not in ("round", "push"):
        raise ValueError(f"moments must be 'round' or 'push', got {moments!r}")
    kw: dict = {"momentum_correction": mc == "on", "round_moments": moments == "round"}
    if "dc" in opts:
        kw["dc"] = float(opts["dc"])
    if "gap" in opts:
        if opts["gap"] not in ("on", "off"):
            raise ValueError(f"gap must be 'on' or 'off' (the gap-aware penalty), got {opts['gap']!r}")
        kw["gap"] = opts["gap"] == "on"
    if "lookahead" in opts:
        la = opts["lookahead"]
        kw["lookahead"] = la if la in ("auto", "stale") else 0 if la == "off" else int(la)
    if "clip" in opts:
        c = opts["clip"]
        kw["clip"] = c if c == "auto" else 0.0 if c == "off" else float(c)
    if name == "asp":
        if len(args) > 1:
            raise ValueError("asp takes at most one positional option (the lr scale)")
        u = opts.get("unanswered", "0")
        kw["max_unanswered"] = None if u == "inf" else int(u)
        p = opts.get("patience", "auto")
        kw["patience"] = p if p == "auto" else float(p)
        return ASP(lr_scale=args[0] if args else None, **kw)
    if not 1 <= len(args) <= 2:
        raise ValueError("ssp needs its staleness bound, then at most an lr scale ('ssp:2', 'ssp:2:delay')")
    return SSP(int(args[0]), lr_scale=args[1] if len(args) == 2 else None, **kw)
