"""Optimizers pyasync adds: the outer optimizers of local steps (pyasync/local.py)."""

from __future__ import annotations

import torch

from pyasync._validate import check_int, check_real
from pyasync.reference.apply import delayed_nesterov_step

__all__ = ["DelayedNesterov"]


class DelayedNesterov(torch.optim.Optimizer):
    """Nesterov SGD whose momentum moves once per ``delay`` steps (Note [Delayed Nesterov] in
    csrc/include/pyasync/math/optim.h; Liu et al. 2024): each step applies ``lr * grad`` at once and
    adds the gradient to an accumulator; every ``delay``-th step also takes the momentum step on the
    accumulated sum. With ``delay=1`` it is ``torch.optim.SGD(momentum=momentum, nesterov=True)``
    (up to rounding). Under ``policy="local:H:async"`` the owners run it on their shards with ``delay``
    the number of workers, in the fused apply; this class is its single-process twin."""

    def __init__(self, params, lr: float = 0.7, momentum: float = 0.9, delay: int = 1) -> None:
        check_real("lr", lr, lo=0.0)
        check_real("momentum", momentum, lo=0.0, hi=1.0)
        check_int("delay", delay, lo=1)
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["accumulator"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                close = st["step"] % int(group["delay"]) == 0
                delayed_nesterov_step(
                    p, p.grad, float(group["lr"]), float(group["momentum"]), close, st["momentum_buffer"],
                    st["accumulator"],
                )
        return loss
