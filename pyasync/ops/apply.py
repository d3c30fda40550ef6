"""Apply-to-shard: one fused decode + optimizer step (SGD / Adam / AdamW, or the delayed Nesterov outer
step of asynchronous local steps) on an fp32 master shard.

An owner turns a push (or the sum of several) into one optimizer update of its shard, reading the
encoded payload directly: per element ``g = dense_scale * dense + grad_scale * decode(payload)``, then
the torch.optim step (see Note [Fused apply] in csrc/include/pyasync/math/optim.h), optionally after
DC-ASGD delay compensation ``g += dc_lambda * g * g * (param - dc_held)`` (Note [Delay compensation formula],
same header). Codecs none, fp16, bf16, int8 and sign are decoded inside the kernel; top-k is first
scattered into a dense fp32 scratch (:func:`pyasync.ops.codecs.decode`) and then applied as a dense
gradient. Everything is updated in place; on CUDA the kernel runs on the current stream. The
pure-torch twin is :mod:`pyasync.reference.apply` (without delay compensation, for now).
"""

from __future__ import annotations

import math

import torch

from pyasync._validate import check_bool, check_real, overlaps
from pyasync.ops._common import CODEC_IDS, Payload, addr, check_num_threads, check_tensor, launch

__all__ = ["adam_apply", "delayed_nesterov_apply", "sgd_apply"]


# ---------------------------------------------------------------------------------------------------
# Validation (shared with pyasync.reference.apply, so both accept exactly the same arguments)


def _check_shard(name: str, t: object, device: torch.device | None, n: int | None) -> None:
    check_tensor(name, t, dtype=torch.float32, device=device, numel=n)
    if t.dim() != 1:
        raise ValueError(
            f"{name} must be 1-D (a flat fp32 shard), got shape {tuple(t.shape)}; pass .view(-1)"
        )


def check_gradient(
    param: torch.Tensor,
    payload: Payload | None,
    grad_scale: float,
    dense: torch.Tensor | None,
    dense_scale: float,
    scratch: torch.Tensor | None,
    state: dict,
) -> None:
    """Validate the shard, the gradient terms and the optimizer state tensors (``state``: name ->
    tensor, written in place); raise TypeError/ValueError naming the offending argument."""
    _check_shard("param", param, None, None)
    device, n = param.device, param.numel()
    if payload is None and dense is None:
        raise ValueError("apply needs a gradient: pass payload=, dense= or both")
    if payload is not None:
        from pyasync.ops.codecs import check_payload

        check_payload(payload, n=n, device=device)
        if not payload.finite:
            raise ValueError(
                "payload.finite is False: the pushed gradient held NaN/Inf and must not be applied "
                "(skip it and count it as nonfinite_skipped)"
            )
    check_real("grad_scale", grad_scale)
    check_real("dense_scale", dense_scale)
    if dense is not None:
        check_tensor("dense", dense, dtype=torch.float32, device=device, numel=n)
    if scratch is not None:
        check_tensor("scratch", scratch, dtype=torch.float32, device=device, numel=n)
    for name, t in state.items():
        _check_shard(name, t, device, n)
    written = {"param": param, **state}
    others = dict(written)
    if dense is not None:
        others["dense"] = dense
    if scratch is not None:
        others["scratch"] = scratch
    if payload is not None:
        others.update(
            {
                f"payload.{k}": t
                for k, t in (
                    ("codes", payload.codes),
                    ("scales", payload.scales),
                    ("indices", payload.indices),
                )
                if isinstance(t, torch.Tensor)
            }
        )  # anything else fails check_payload
    for wname, w in written.items():
        for oname, o in others.items():
            if oname != wname and overlaps(w, o):
                raise ValueError(
                    f"{wname} and {oname} share memory; every state tensor needs its own storage"
                )
    if scratch is not None and dense is not None and overlaps(scratch, dense):
        raise ValueError("scratch and dense share memory; pass a separate scratch buffer")


def check_dc(
    dc_lambda: float,
    dc_held: torch.Tensor | None,
    param: torch.Tensor,
    state: dict,
    scratch: torch.Tensor | None,
    validate: bool,
) -> bool:
    """Validate the delay-compensation arguments; True when compensation is on (dc_lambda > 0).

    dc_lambda is always checked (a hyperparameter); dc_held's tensor properties only with ``validate``
    (its presence always, since the kernel would read it). Raises TypeError/ValueError naming the
    argument and what is allowed.
    """
    if isinstance(dc_lambda, bool) or not isinstance(dc_lambda, (int, float)):
        raise TypeError(f"dc_lambda must be a float, got {type(dc_lambda).__name__} ({dc_lambda!r})")
    lam = float(dc_lambda)
    if not (math.isfinite(lam) and lam >= 0.0):
        raise ValueError(
            f"dc_lambda must be a finite float >= 0 (0 turns delay compensation off), got {dc_lambda!r}"
        )
    if dc_held is None:
        if lam > 0.0:
            raise ValueError(
                "dc_lambda > 0 needs dc_held= (the n fp32 weights the pushing worker held when it "
                "computed the gradient); pass dc_held or dc_lambda=0.0"
            )
        return False
    if validate:
        if not isinstance(dc_held, torch.Tensor):
            raise TypeError(f"dc_held must be a torch.Tensor or None, got {type(dc_held).__name__}")
        n, device = param.numel(), param.device
        if dc_held.dtype != torch.float32:
            raise ValueError(f"dc_held must be fp32 (torch.float32) like param, got {dc_held.dtype}")
        if dc_held.device != device:
            raise ValueError(f"dc_held is on {dc_held.device} but param is on {device}; move it first")
        if not dc_held.is_contiguous():
            raise ValueError("dc_held must be contiguous; call .contiguous() first")
        if dc_held.numel() != n:
            raise ValueError(f"dc_held must have {n} elements (as param), got {dc_held.numel()}")
        written = {"param": param, **state, **({"scratch": scratch} if scratch is not None else {})}
        for name, w in written.items():
            if overlaps(dc_held, w):
                raise ValueError(
                    f"dc_held and {name} share memory; pass a copy of the held weights (the apply "
                    f"writes {name})"
                )
    return lam > 0.0


def check_sgd(
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first_step: bool,
    momentum_buffer: torch.Tensor | None,
) -> dict:
    """Validate the SGD hyperparameters as torch.optim.SGD does; returns the state tensors to check."""
    check_real("lr", lr, lo=0.0)
    check_real("momentum", momentum, lo=0.0)
    check_real("dampening", dampening)
    check_real("weight_decay", weight_decay, lo=0.0)
    check_bool("nesterov", nesterov)
    check_bool("maximize", maximize)
    check_bool("first_step", first_step)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov=True requires momentum > 0 and dampening == 0 (as torch.optim.SGD)")
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError(
                "momentum != 0 needs momentum_buffer= (an fp32 tensor like param; "
                "pass first_step=True on the first step to initialise it)"
            )
        return {"momentum_buffer": momentum_buffer}
    return {}


def check_adam(
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    step: int,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
) -> dict:
    """Validate the Adam/AdamW hyperparameters as torch.optim.Adam does; returns the state tensors."""
    check_real("lr", lr, lo=0.0)
    check_real("beta1", beta1, lo=0.0, hi=1.0)
    check_real("beta2", beta2, lo=0.0, hi=1.0)
    check_real("eps", eps, lo=0.0)
    check_real("weight_decay", weight_decay, lo=0.0)
    check_bool("decoupled_weight_decay", decoupled_weight_decay)
    check_bool("maximize", maximize)
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(
            f"step must be an int (the 1-based step count after this update), got {type(step).__name__}"
        )
    if step < 1:
        raise ValueError(f"step must be >= 1 (the 1-based step count after this update), got {step}")
    return {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def check_delayed_nesterov(
    lr: float, momentum: float, close_round: bool, momentum_buffer: torch.Tensor, accumulator: torch.Tensor
) -> dict:
    """Validate the delayed Nesterov hyperparameters; returns the state tensors to check."""
    check_real("lr", lr, lo=0.0)
    check_real("momentum", momentum, lo=0.0, hi=1.0)
    check_bool("close_round", close_round)
    return {"momentum_buffer": momentum_buffer, "accumulator": accumulator}


def adam_scalars(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(step_size, bias_correction2_sqrt) in double, exactly as torch.optim.Adam computes them."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return lr / bias_correction1, bias_correction2**0.5


# ---------------------------------------------------------------------------------------------------
# Launch


def _apply(
    param: torch.Tensor,
    payload: Payload | None,
    grad_scale: float,
    dense: torch.Tensor | None,
    dense_scale: float,
    scratch: torch.Tensor | None,
    state1: torch.Tensor | None,
    state2: torch.Tensor | None,
    opt: dict,
    num_threads: int | None,
    validate: bool = True,
    dc_lambda: float = 0.0,
    dc_held: torch.Tensor | None = None,
) -> None:
    """Launch one apply; dc_held is passed only when dc_lambda > 0 (checked by the caller), so a call
    without compensation is today's kernel path (Note [Delay compensation formula])."""
    nt = check_num_threads(num_threads)
    n = param.numel()
    if n == 0:
        return
    if payload is not None and payload.codec == "topk":
        # Scatter first (see Note [Fused apply]): g = dense_scale * dense + grad_scale * topk values,
        # with the same roundings as the inline path, then apply g as a dense gradient.
        from pyasync.ops.codecs import decode

        g = scratch if scratch is not None else torch.empty(n, dtype=torch.float32, device=param.device)
        if dense is not None:
            torch.mul(dense.view(-1), float(dense_scale), out=g)
        decode(
            payload,
            out=g,
            alpha=float(grad_scale),
            accumulate=dense is not None,
            num_threads=num_threads,
            validate=validate,
        )
        payload, dense, dense_scale = None, g, 1.0
    codec = payload.codec if payload is not None else "none"
    launch(
        "apply",
        param.device,
        codec=CODEC_IDS[codec],
        codes=addr(payload.codes) if payload is not None else 0,
        scales=addr(payload.scales) if payload is not None else 0,
        n=n,
        block=payload.block if payload is not None and codec in ("int8", "sign") else 0,
        grad_scale=float(grad_scale),
        dense=addr(dense),
        dense_scale=float(dense_scale),
        param=addr(param),
        state1=addr(state1),
        state2=addr(state2),
        opt=opt,
        dc_lambda=float(dc_lambda) if dc_held is not None else 0.0,
        dc_held=addr(dc_held),
        num_threads=nt,
    )


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
    validate: bool = True,
    dc_lambda: float = 0.0,
    dc_held: torch.Tensor | None = None,
) -> None:
    """One torch.optim.SGD step on ``param`` in place, from
    ``g = dense_scale * dense + grad_scale * decode(payload)`` (either term may be absent, not both).

    param: the fp32 master shard (1-D, contiguous, n elements); every tensor on its device.
    payload: an encoded gradient of n elements (any codec; top-k is scattered into ``scratch``).
    dense: n fp32 gradient values. grad_scale / dense_scale: multipliers of the two terms.
    lr, momentum, dampening, nesterov, weight_decay, maximize: as torch.optim.SGD.
    momentum_buffer: n fp32, updated in place; required when momentum != 0 (unused otherwise).
    first_step: the buffer is set to g, as torch does when it has no buffer yet.
    scratch: n fp32 used for top-k (allocated when None). num_threads: CPU threads (None: default).
    validate: False skips the checks of the tensors and the payload (the hyperparameters are always
    checked): for callers whose tensors are their own and whose payload was validated where it came in
    (the engine: its own encoder, or the wire).
    dc_lambda: DC-ASGD delay compensation (Zheng et al. 2017), a float >= 0; 0 (the default) is off and
    exactly the apply without it. When > 0 the step uses ``g + dc_lambda * g * g * (param - dc_held)``
    elementwise instead of ``g``, with g the decoded, scaled gradient above, taken before maximize and
    weight decay (see Note [Delay compensation formula] in csrc/include/pyasync/math/optim.h).
    dc_held: n fp32 (contiguous, on param's device, sharing no memory with param, state or scratch): the
    weights the pushing worker held when it computed the gradient; required when dc_lambda > 0,
    ignored (not read) when dc_lambda == 0.
    """
    state = check_sgd(lr, momentum, dampening, nesterov, weight_decay, maximize, first_step, momentum_buffer)
    if validate:
        check_gradient(param, payload, grad_scale, dense, dense_scale, scratch, state)
    dc = check_dc(dc_lambda, dc_held, param, state, scratch, validate)
    opt = {
        "kind": "sgd",
        "lr": float(lr),
        "momentum": float(momentum),
        "dampening": float(dampening),
        "nesterov": nesterov,
        "weight_decay": float(weight_decay),
        "maximize": maximize,
        "first_step": first_step,
    }
    _apply(
        param,
        payload,
        grad_scale,
        dense,
        dense_scale,
        scratch,
        state.get("momentum_buffer"),
        None,
        opt,
        num_threads,
        validate,
        dc_lambda if dc else 0.0,
        dc_held if dc else None,
    )


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
    validate: bool = True,
    dc_lambda: float = 0.0,
    dc_held: torch.Tensor | None = None,
) -> None:
    """One torch.optim.Adam step (AdamW with ``decoupled_weight_decay=True``; amsgrad=False) on
    ``param`` in place, from ``g = dense_scale * dense + grad_scale * decode(payload)``.

    param, payload, dense, grad_scale, dense_scale, scratch, num_threads, validate, dc_lambda, dc_held:
    as :func:`sgd_apply` (the compensated g enters Adam's moments; AdamW's decay acts on param as usual).
    lr, beta1, beta2, eps, weight_decay, maximize: as torch.optim.Adam (betas=(beta1, beta2)).
    step: the 1-based step count after this update (torch's state["step"] after its increment);
    the bias corrections are computed from it in double, as torch does.
    exp_avg, exp_avg_sq: n fp32 moment estimates, updated in place (zeros before the first step).
    """
    state = check_adam(
        lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize, step, exp_avg, exp_avg_sq
    )
    if validate:
        check_gradient(param, payload, grad_scale, dense, dense_scale, scratch, state)
    dc = check_dc(dc_lambda, dc_held, param, state, scratch, validate)
    step_size, bias_correction2_sqrt = adam_scalars(float(lr), float(beta1), float(beta2), step)
    opt = {
        "kind": "adam",
        "lr": float(lr),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(eps),
        "weight_decay": float(weight_decay),
        "decoupled_weight_decay": decoupled_weight_decay,
        "maximize": maximize,
        "step_size": step_size,
        "bias_correction2_sqrt": bias_correction2_sqrt,
    }
    _apply(
        param,
        payload,
        grad_scale,
        dense,
        dense_scale,
        scratch,
        exp_avg,
        exp_avg_sq,
        opt,
        num_threads,
        validate,
        dc_lambda if dc else 0.0,
        dc_held if dc else None,
    )


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
    validate: bool = True,
) -> None:
    """One arrival of the delayed Nesterov outer step on ``param`` in place, from
    ``g = dense_scale * dense + grad_scale * decode(payload)`` (Note [Delayed Nesterov] in
    csrc/include/pyasync/math/optim.h): ``accumulator += g``, ``param -= lr * g``; with ``close_round``
    also ``momentum_buffer = momentum * momentum_buffer + accumulator``, ``param -= lr * momentum *
    momentum_buffer`` and ``accumulator = 0``.

    param, payload, dense, grad_scale, dense_scale, scratch, num_threads, validate: as :func:`sgd_apply`.
    momentum_buffer, accumulator: n fp32 each, updated in place (zeros before the first arrival).
    """
    state = check_delayed_nesterov(lr, momentum, close_round, momentum_buffer, accumulator)
    if validate:
        check_gradient(param, payload, grad_scale, dense, dense_scale, scratch, state)
    opt = {"kind": "delayed_nesterov", "lr": float(lr), "momentum": float(momentum)}
    opt["close_round"] = close_round
    s1, s2 = momentum_buffer, accumulator
    _apply(param, payload, grad_scale, dense, dense_scale, scratch, s1, s2, opt, num_threads, validate)
