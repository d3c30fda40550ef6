"""Local steps on the worker side: policy "local:H" (pyasync.policy.Local).

Note [Local steps]
    Under Local(H) (Local SGD; DiLoCo with its defaults) a worker's ``step()`` is a step of the user's
    optimizer (the inner one) on the worker's own replica, with its own state (Adam's moments stay on
    the worker, as in DiLoCo). Every H-th step is also an outer step: the worker pushes its change
    since the last outer step, the pseudo-gradient ``anchor - params`` (a descent direction, like a
    gradient), through the engine exactly as a gradient is pushed (codecs, error feedback, replies),
    and installs what the owners answer; that becomes the new anchor. The owners apply the mean of the
    changes (or, async, each change) with the outer optimizer: Nesterov SGD at lr 0.7 and momentum 0.9
    (:func:`outer_optimizer`), so with H = 1, outer lr 1 and momentum 0 it is plain data parallelism
    on the inner optimizer's displacements. The outer policy decides how the changes meet (Local.outer:
    BSP, Quorum(k), or ASP with the delayed Nesterov step, Note [Delayed Nesterov] in
    csrc/include/pyasync/math/optim.h). Communication falls by H: one push per H samples of work.
    - The backward hooks are removed (the engine reads ``.grad`` only at the outer step, which holds
      the pseudo-gradient then; the user's gradients are put back afterwards, so ``zero_grad`` and
      anything else that reads them sees what backward left).
    - GradScaler: a step where the scaler found an inf or NaN is skipped (not counted); otherwise the
      gradients are unscaled in place before the inner step. ``max_grad_norm`` clips each inner step's
      gradient on the worker, as ``clip_grad_norm_`` before ``optimizer.step()`` would.
    - A membership change (``elastic=True``) keeps each survivor's progress since its last outer step:
      the change's drain installs the global values and the dead owner's shards are rebuilt from the
      freshest replica, both of which must see the values the survivors *installed*, not their local
      replicas (a replica ahead of its anchor would put its progress into the rebuilt master, and the
      next push would add it again). So the replica is parked at its anchor for the change
      (:meth:`LocalSteps.park`) and its progress is put back on the new global values after it, which
      become the anchor (:meth:`LocalSteps.unpark`): the next outer step pushes that progress once.
    - A worker that joins (Note [Joining under local steps]) starts from the drained global values.
    - ``stats()`` is the engine's: its ``clock`` and push counts count outer steps; ``opt.local_steps``
      holds ``inner_steps`` and ``outer_steps``.
    - An outer step whose wait timed out (TimeoutError) stays in flight, as any step does; the next
      ``step()`` finishes it first and takes its answer as the anchor, so its change is pushed once.
    - Asynchronously the outer ASP waits for the worker's own answers with no patience (Note
      [Patience with one's own answers] in engine/p2p/engine.py). With a patience, a worker whose
      owner stopped (SIGSTOP, a hung host) would train on against that owner's frozen shard: every
      later change is measured from the same stale anchor there, and when the owner is dropped the
      replay (Note [Replaying a dead owner's pushes]) applies them all, each the whole way from that
      anchor. Measured before this was so: the stopped owner's quarter of a quadratic ended at 5-7
      instead of 2 (tests/faults/test_membership.py::test_a_stopped_or_departed_worker_under_local_steps).
      So a worker waits: until the answer, until the heartbeats drop the owner (elastic=True), or
      until the timeout (TimeoutError, the outer step finished by the next step()).

Note [Joining under local steps]
    A replacement started with ``PYASYNC_JOIN=1`` (Note [Joining a running job] in session/joining.py)
    is admitted at the members' next change like any joiner: the members park their progress, the
    joiner receives its replica (the drained global values, which every member installed) and its
    shards of the outer optimizer's state (Nesterov's momentum moves with the masters in the re-split).
    Its LocalSteps is made after that, so the replica it received is its anchor and it has no progress
    to push. Its inner optimizer starts empty, as the joining process built it: the inner state
    (momentum, Adam's moments) belongs to one worker and is not the job's (a copy of a member's would
    give two workers one momentum), so a replacement starts as a new DiLoCo worker does. Its first
    outer step comes H inner steps after the join; the members' cycles go on where they were, and
    each worker still pushes once per outer round, so a synchronous round waits for the joiner's
    first change. Adaptive H reads the new epoch's board, the joiner's speed included.

Note [Dynamic local steps]
    With one worker twice as slow, H steps each means the fast workers wait for it at every synchronous
    outer step (a straggler sets the pace, as under BSP), and asynchronously its changes arrive half as
    often and twice as stale. Liu et al. (2024, "Asynchronous Local-SGD Training for Language
    Modeling") give each worker a number of steps in proportion to its speed (dynamic local updates),
    so that all arrive together. ``Local(adaptive=True)`` (``local:H:async:adaptive`` or
    ``local:H:quorum:K:adaptive``; not synchronous, where every worker must reach the same number of
    outer steps in the same number of ``step()`` calls) does so: each worker
    measures its seconds per inner step (an exponential average, ``STEP_EMA``, of the time from the end
    of one ``step()`` to the start of the next: forward, backward and whatever the training loop does,
    not the outer step's wait), publishes it in the job's store at each outer step
    (:class:`SpeedBoard`, keys under the membership epoch's prefix, a float as text: nothing is
    unpickled), and takes H_i = max(1, round(H * fastest / mine)) steps until its next outer step, H
    for the fastest worker. Until every worker has published (the first outer step), each takes H. A
    store that fails or answers nonsense costs nothing but the adaptation: the worker takes H and
    counts it (``LocalSteps.board.failures``). A slow worker's change then covers fewer steps, and the
    outer step weighs it as any other (the mean, or delayed Nesterov's arrivals).

Note [Checkpoints under local steps]
    Between outer steps the state of a run is more than the owners' shards (the global values and the
    outer optimizer's momentum, saved and re-sharded as any fused rule's): each worker has its replica,
    its anchor (the global values it last installed: under ``async`` older than the masters, since the
    others pushed since), its count of inner steps and the inner optimizer's state (Adam's moments stay
    on the worker). ``DistributedOptimizer.state_dict()`` adds them under ``"local"`` (replica and anchor
    bit for bit, not their difference: ``a + (p - a)`` need not round back to ``p``) and
    ``load_checkpoint`` restores them after installing the global values
    (``DistributedOptimizer.load_local_state``): into the same world size the resumed run is the one
    that never stopped (each worker's next push is ``anchor - replica``, as it would have been).
    Into another world size (Note [Re-sharding] in checkpoint/reshard.py) new worker v takes old worker
    v mod n's inner optimizer state and count of outer steps, but no progress: a worker's change since
    its last outer step belongs to that worker, and given to two new workers it would be pushed twice
    (kept by none, it is lost: at most H - 1 inner steps of each old worker). Every worker starts from
    the loaded global values, its next outer step H steps later. A save while an outer step that timed
    out is still in flight is refused (step() again first): its answer is not the anchor yet.

Note [Outer step defaults]
    DiLoCo's outer Nesterov at lr 0.7 and momentum 0.9 was tuned for inner AdamW and H of about 500. In
    steady state Nesterov moves lr / (1 - mu) times the mean change per outer step: 7x at 0.7 and 0.9.
    Measured here (docs/benchmarks.md, "Local steps"; 4 workers, one 2x straggler, H = 16), that reached
    the target early and then diverged on `seq` (SGD at momentum 0.9, a model trained near its
    stability limit: `local:16` ended at 0.10 token accuracy, `local:16:quorum:3` at 0.07), and on
    `lm` with AdamW ended 2.2% above DDP's held-out loss, against 0.8% at lr 0.5 and momentum 0.8
    (2.5x), which also ended `seq` at 0.999 (DDP 0.997). So synchronous and quorum default to 0.5 and
    0.8. Asynchronously each change moves the global values at once (the gradient part of Note
    [Delayed Nesterov]), and momentum on stale changes swings sooner: on `seq` lr 0.5 and momentum 0.8
    ended at 0.982, lr 0.7 and 0.5 at 0.995, plain averaging (lr 1, momentum 0) at 0.993 and lr 1 with
    momentum 0.3 at 0.996; lr 1.5 or 2 without momentum swung (0.975, 0.717). Async defaults to lr 1 and
    momentum 0.3. ``local:H:lr=..:momentum=..`` sets both. Three seeds per workload later (docs,
    "What local steps' time to target is made of") kept that default, but not by much: without the
    momentum `seq` ended level and reached the target later (0.72x DDP's time against 0.66x), and `lm`
    ended lower (1.0% above DDP's loss with AdamW against 2.0%; -1.1% with SGD against +1.9%, where one
    seed with the momentum ended on a spike 17% above) in about the same time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from pyasync.optim import DelayedNesterov
from pyasync.policy import Local

__all__ = ["STEP_EMA", "LocalSteps", "SpeedBoard", "outer_optimizer"]

STEP_EMA = 0.2  # weight of the newest inner step in a worker's seconds per step (Note [Dynamic local steps])


def outer_optimizer(policy: Local, param_groups: list[dict]) -> torch.optim.Optimizer:
    """The optimizer the owners run on the pushed changes: one group per user group (same parameters),
    Nesterov SGD, or delayed Nesterov under ``mode="async"`` (its round: the number of workers)."""
    groups = [{"params": list(g["params"])} for g in param_groups]
    if policy.mode == "async":
        return DelayedNesterov(groups, lr=policy.outer_lr, momentum=policy.outer_momentum)
    mu = policy.outer_momentum
    return torch.optim.SGD(groups, lr=policy.outer_lr, momentum=mu, nesterov=mu > 0)


class SpeedBoard:
    """The workers' seconds per inner step in the job's store, and this worker's steps per outer step
    from them (Note [Dynamic local steps])."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.keys = [f"{prefix}/{r}" for r in range(world)]
        self.failures = 0  # store calls that failed or answered something that is not a positive number

    def steps(self, mine: float, h: int) -> int:
        """Publish ``mine`` (seconds per step) and return this worker's H_i: H * fastest / mine, rounded,
        at least 1; ``h`` until every worker has published, or when the store fails."""
        if not (math.isfinite(mine) and mine > 0):
            return h
        try:
            self.store.set(self.keys[self.rank], f"{mine:.9g}")
            if not self.store.check(self.keys):
                return h
            seen = [float(v.decode("ascii")) for v in self.store.multi_get(self.keys)]
        except Exception:  # the adaptation is an optimisation: the worker goes on with H
            self.failures += 1
            return h
        if not all(math.isfinite(v) and v > 0 for v in seen):
            self.failures += 1
            return h
        return max(1, min(h, round(h * min(seen) / mine)))


class LocalSteps:
    """One worker's side of Local(H): the inner steps, and the pseudo-gradient of each outer step."""

    def __init__(
        self,
        policy: Local,
        params: list[torch.Tensor],
        max_grad_norm: float | None,
        board: SpeedBoard | None = None,
    ) -> None:
        self.policy = policy
        self.params = params
        self.max_grad_norm = max_grad_norm
        self.board = board  # Local(adaptive=True) with several workers (Note [Dynamic local steps])
        self.anchor = [p.detach().clone() for p in params]
        self.inner_steps = 0  # inner steps taken (skipped GradScaler steps not counted)
        self.outer_steps = 0
        self.since = 0  # inner steps since the last outer step
        self.target = policy.steps  # inner steps per outer step: H, or this worker's H_i when adaptive
        self.seconds_per_step = math.nan  # measured (Note [Dynamic local steps])
        self.left_at: float | None = None  # when the last step() left LocalSteps
        self.pending = False  # an outer step whose wait timed out: finished by the next step()

    def inner_step(
        self, optimizer: torch.optim.Optimizer, grad_scale: float | None, found_inf: bool, finish: Callable
    ) -> bool:
        """One step of the user's optimizer on this replica; True when it completes H steps (an outer
        step is due). An outer step that timed out is first finished (``finish()``: the engine's, which
        installs its answer), and its answer becomes the anchor: its change is never pushed twice."""
        self._tick()
        if self.pending:
            finish()
            self.pending = False
            self._settle()
        if found_inf:
            self.left_at = time.perf_counter()
            return False
        if grad_scale is not None and grad_scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(1.0 / grad_scale)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        optimizer.step()
        self.inner_steps += 1
        self.since += 1
        self.left_at = time.perf_counter()
        return self.since >= self.target

    def _tick(self) -> None:
        """This worker's seconds per inner step: the time since the last step() left, averaged."""
        if self.left_at is None:
            return
        dt = time.perf_counter() - self.left_at
        old = self.seconds_per_step
        self.seconds_per_step = dt if math.isnan(old) else (1 - STEP_EMA) * old + STEP_EMA * dt

    @torch.no_grad()
    def outer_step(self, push: Callable[[], None]) -> None:
        """Put ``anchor - params`` in ``.grad`` and the anchor back in the parameters (the worker holds
        the anchor; its progress is the change it pushes), ``push()`` it (the engine's step: it installs
        the new values), take them as the anchor and give the user's gradients back. The engine may read
        the parameters during its step as what this worker holds (the collective engine's replica under
        coded replies, Note [Compressed replies] in engine/collective/gather.py): they must be the
        anchor then, not the replica's progress."""
        saved = [p.grad for p in self.params]
        try:
            for p, a in zip(self.params, self.anchor):
                p.grad = a - p
                p.copy_(a)
            push()
        except TimeoutError:
            self.pending = True  # in flight: the next step() finishes it (inner_step)
            raise
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g
        self._settle()

    @torch.no_grad()
    def park(self) -> list[torch.Tensor]:
        """Before a membership change: set the replica's progress since the last outer step aside and
        hold the anchor (the installed global values). A timed-out outer step is in flight then, and the
        change's drain applies it: nothing was trained since it was pushed, so there is no progress."""
        if self.pending:
            self.pending = False
            self.outer_steps += 1
            self.since = 0
            return [torch.zeros_like(p) for p in self.params]
        progress = [p - a for p, a in zip(self.params, self.anchor)]
        for p, a in zip(self.params, self.anchor):
            p.copy_(a)
        return progress

    @torch.no_grad()
    def unpark(self, progress: list[torch.Tensor]) -> None:
        """After a membership change: the installed values are the new anchor, the progress goes back
        on top of them."""
        for p, a, d in zip(self.params, self.anchor, progress):
            a.copy_(p)
            p.add_(d)

    @torch.no_grad()
    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """This worker's side of a checkpoint (Note [Checkpoints under local steps]): its replica and
        anchor, bit for bit, its counts and the inner optimizer's state."""
        if self.pending:
            raise RuntimeError(
                "an outer step timed out and is still in flight; call step() again (it finishes that "
                "outer step first) and save after it returned"
            )
        return {
            "inner_steps": torch.tensor(self.inner_steps, dtype=torch.int64),
            "outer_steps": torch.tensor(self.outer_steps, dtype=torch.int64),
            "since": torch.tensor(self.since, dtype=torch.int64),
            "target": torch.tensor(self.target, dtype=torch.int64),
            "replica": [p.detach().clone() for p in self.params],
            "anchor": [a.clone() for a in self.anchor],
            "inner": optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """Restore what :meth:`state_dict` saved, once the global values are installed in the parameters.
        Without ``replica`` (a checkpoint re-sharded to another world size) the installed values are the
        anchor and the replica, and the next outer step comes H counted steps later."""
        optimizer.load_state_dict(state["inner"])
        self.pending = False
        self.outer_steps = int(state["outer_steps"])
        self.target = self.policy.steps
        self.since = 0
        if state.get("replica") is None:
            self.inner_steps = self.outer_steps * self.policy.steps
            for p, a in zip(self.params, self.anchor):
                a.copy_(p)
            return
        self.inner_steps = int(state["inner_steps"])
        self.since, self.target = int(state["since"]), max(1, int(state["target"]))
        for p, a, r, sa in zip(self.params, self.anchor, state["replica"], state["anchor"]):
            p.copy_(r)
            a.copy_(sa)

    @torch.no_grad()
    def _settle(self) -> None:
        """The installed global values become the anchor of the next outer step; adaptive: this
        worker's steps until the next one (Note [Dynamic local steps])."""
        for p, a in zip(self.params, self.anchor):
            a.copy_(p)
        self.outer_steps += 1
        self.since = 0
        if self.board is not None:
            self.target = self.board.steps(self.seconds_per_step, self.policy.steps)
        self.left_at = time.perf_counter()
