"""Pure-torch twin of :mod:`pyasync.ops.apply`: decode, then torch.optim's single-tensor step, in eager
torch, line by line (torch/optim/sgd.py ``_single_tensor_sgd``, torch/optim/adam.py
``_single_tensor_adam``). The specification and test oracle of the fused kernels; same signatures, same
argument checks, same in-place results up to float rounding (the kernels do not fuse into FMAs on the
CPU, eager torch's vectorised ops do).
"""

from __future__ import annotations

import torch

from pyasync.ops._common import Payload
from pyasync.ops.apply import adam_scalars, check_adam, check_delayed_nesterov, check_gradient, check_sgd

__all__ = ["adam_apply", "delayed_nesterov_apply", "gradient", "sgd_apply"]


def gradient(
    n: int,
    payload: Payload | None,
    grad_scale: float,
    dense: torch.Tensor | None,
    dense_scale: float,
) -> torch.Tensor:
    """``dense_scale * dense + grad_scale * decode(payload)`` as a new n-element fp32 tensor."""
    g = None
    if payload is not None:
        from pyasync.reference.codecs import decode

        g = decode(payload, alpha=grad_scale)
    if dense is not None:
        d = dense.reshape(-1) * dense_scale
        g = d if g is None else d + g
    assert g is not None and g.numel() == n
    return g


def sgd_apply(
    param: torch.Tensor,
    *,
    payload: Payload | None = None,
    grad_scale: float = 1.0,
    dense: torch.Tensor | None = None,
    dense_scale: float = 1.0,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
    momentum_buffer: torch.Tensor | None = None,
    first_step: bool = False,
    scratch: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """Reference of :func:`pyasync.ops.apply.sgd_apply` (scratch and num_threads are accepted and unused)."""
    state = check_sgd(lr, momentum, dampening, nesterov, weight_decay, maximize, first_step, momentum_buffer)
    check_gradient(param, payload, grad_scale, dense, dense_scale, scratch, state)
    grad = gradient(param.numel(), payload, grad_scale, dense, dense_scale)
    if maximize:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        buf = momentum_buffer
        if first_step:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    param.add_(grad, alpha=-lr)


def adam_apply(
    param: torch.Tensor,
    *,
    payload: Payload | None = None,
    grad_scale: float = 1.0,
    dense: torch.Tensor | None = None,
    dense_scale: float = 1.0,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    step: int,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scratch: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """Reference of :func:`pyasync.ops.apply.adam_apply` (scratch and num_threads are accepted and unused)."""
    state = check_adam(lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize, step, exp_avg,
                       exp_avg_sq)
    check_gradient(param, payload, grad_scale, dense, dense_scale, scratch, state)
    grad = gradient(param.numel(), payload, grad_scale, dense, dense_scale)
    if maximize:
        grad = -grad
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size, bias_correction2_sqrt = adam_scalars(lr, beta1, beta2, step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def delayed_nesterov_apply(
    param: torch.Tensor,
    *,
    payload: Payload | None = None,
    grad_scale: float = 1.0,
    dense: torch.Tensor | None = None,
    dense_scale: float = 1.0,
    lr: float,
    momentum: float = 0.9,
    close_round: bool,
    momentum_buffer: torch.Tensor,
    accumulator: torch.Tensor,
    scratch: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """Reference of :func:`pyasync.ops.apply.delayed_nesterov_apply`: one arrival of
    :class:`pyasync.optim.DelayedNesterov`'s step, in eager torch."""
    state = check_delayed_nesterov(lr, momentum, close_round, momentum_buffer, accumulator)
    check_gradient(param, payload, grad_scale, dense, dense_scale, scratch, state)
    grad = gradient(param.numel(), payload, grad_scale, dense, dense_scale)
    delayed_nesterov_step(param, grad, lr, momentum, close_round, momentum_buffer, accumulator)


def delayed_nesterov_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    momentum: float,
    close_round: bool,
    momentum_buffer: torch.Tensor,
    accumulator: torch.Tensor,
) -> None:
    """The per-arrival math of Note [Delayed Nesterov], in eager torch (shared with
    :class:`pyasync.optim.DelayedNesterov`)."""
    accumulator.add_(grad)
    param.add_(grad, alpha=-lr)
    if close_round:
        momentum_buffer.mul_(momentum).add_(accumulator)
        param.add_(momentum_buffer, alpha=-lr * momentum)
        accumulator.zero_()
