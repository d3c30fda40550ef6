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
    - A membership change (``elastic=True``) keeps each survivor's replica and anchor: the next outer
      step pushes the change since the last one it made.
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

    def inner_step(
        self, optimizer: torch.optim.Optimizer, grad_scale: float | None, found_inf: bool
    ) -> bool:
        """One step of the user's optimizer on this replica; True when it completes H steps (an outer
        step is due)."""
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
        """Put ``anchor - params`` in ``.grad``, ``push()`` it (the engine's step: it installs the new
        values), take them as the anchor and give the user's gradients back."""
        saved = [p.grad for p in self.params]
        try:
            for p, a in zip(self.params, self.anchor):
                p.grad = a - p
            push()
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g
        for p, a in zip(self.params, self.anchor):
            a.copy_(p)
        self.outer_steps += 1
