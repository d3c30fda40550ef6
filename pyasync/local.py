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
    - ``stats()`` is the engine's: its ``clock`` and push counts count outer steps; ``opt.local_steps``
      holds ``inner_steps`` and ``outer_steps``.
    - An outer step whose wait timed out (TimeoutError) stays in flight, as any step does; the next
      ``step()`` finishes it first and takes its answer as the anchor, so its change is pushed once.

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
    momentum 0.3. ``local:H:lr=..:momentum=..`` sets both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pyasync.optim import DelayedNesterov
from pyasync.policy import Local

__all__ = ["LocalSteps", "outer_optimizer"]


def outer_optimizer(policy: Local, param_groups: list[dict]) -> torch.optim.Optimizer:
    """The optimizer the owners run on the pushed changes: one group per user group (same parameters),
    Nesterov SGD, or delayed Nesterov under ``mode="async"`` (its round: the number of workers)."""
    groups = [{"params": list(g["params"])} for g in param_groups]
    if policy.mode == "async":
        return DelayedNesterov(groups, lr=policy.outer_lr, momentum=policy.outer_momentum)
    mu = policy.outer_momentum
    return torch.optim.SGD(groups, lr=policy.outer_lr, momentum=mu, nesterov=mu > 0)


class LocalSteps:
    """One worker's side of Local(H): the inner steps, and the pseudo-gradient of each outer step."""

    def __init__(self, policy: Local, params: list[torch.Tensor], max_grad_norm: float | None) -> None:
        self.policy = policy
        self.params = params
        self.max_grad_norm = max_grad_norm
        self.anchor = [p.detach().clone() for p in params]
        self.inner_steps = 0  # inner steps taken (skipped GradScaler steps not counted)
        self.outer_steps = 0
        self.pending = False  # an outer step whose wait timed out: finished by the next step()

    def inner_step(
        self, optimizer: torch.optim.Optimizer, grad_scale: float | None, found_inf: bool, finish: Callable
    ) -> bool:
        """One step of the user's optimizer on this replica; True when it completes H steps (an outer
        step is due). An outer step that timed out is first finished (``finish()``: the engine's, which
        installs its answer), and its answer becomes the anchor: its change is never pushed twice."""
        if self.pending:
            finish()
            self.pending = False
            self._settle()
        if found_inf:
            return False
        if grad_scale is not None and grad_scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(1.0 / grad_scale)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        optimizer.step()
        self.inner_steps += 1
        return self.inner_steps % self.policy.steps == 0

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
    def _settle(self) -> None:
        """The installed global values become the anchor of the next outer step."""
        for p, a in zip(self.params, self.anchor):
            a.copy_(p)
        self.outer_steps += 1
