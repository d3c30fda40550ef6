"""DC-ASGD delay compensation in the fused apply (``dc_lambda``, ``dc_held`` of pyasync.ops.apply).

The oracle is written in plain torch: decode the payload (test_apply's independent decoder), scale it,
compensate it, ``g + lambda * g * g * (w - held)`` with w the torch side's current parameter, and hand
the result to the real torch.optim.SGD / Adam / AdamW (single-tensor path) as its gradient. The
compensation is taken before maximize and weight decay (See Note [Delay compensation formula] in
csrc/include/pyasync/math/optim.h), which is exactly what feeding it to torch.optim as `.grad` does.
Tolerances as test_apply (SGD is bit-exact on FMA CPUs; Adam within about an ulp of torch's sqrt).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from test_apply import (
    ATOL,
    CODECS,
    RTOL,
    Runner,
    _adam,
    _gpu_ready,
    _sgd,
    gradient_args,
    make_payload,
    move,
    oracle_grad,
)

from pyasync.ops import apply as ops
from pyasync.ops._common import Payload

cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAMBDAS = (0.0, 0.04, 1.0)
DC_CONFIGS = (
    "sgd",  # momentum 0
    "sgd-momentum",  # momentum 0.9
    "sgd-nesterov-wd",
    "sgd-wd",
    "sgd-maximize-momentum",  # maximize acts on the compensated gradient
    "adam",
    "adam-l2",
    "adamw",
)
STEPS = 5


def compensated(g: torch.Tensor, lam: float, w: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The DC-ASGD gradient, in plain torch (Zheng et al. 2017, eq. 10 with the diagonal estimate)."""
    return g + lam * g * g * (w - held)


def stale_weights(w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """What a pushing worker held: the current weights moved back by a few steps' worth of noise."""
    return (w.cpu() + 0.1 * torch.randn(w.numel(), generator=gen)).to(w.device)


def run_dc_against_torch(
    name: str, codec: str, lam: float, n: int, seed: int, device: str = "cpu", steps: int = STEPS
) -> Runner:
    gen = torch.Generator().manual_seed(seed)
    r = Runner(name, n, gen, device)
    mode = "both" if codec in ("int8", "topk") else "payload"
    for _ in range(steps):
        args = gradient_args(mode, codec, n, gen, device)
        held = stale_weights(r.tparam.detach(), gen)
        g = oracle_grad(
            args.get("payload"), args.get("grad_scale", 1.0), args.get("dense"), args.get("dense_scale", 1.0)
        )
        g_dc = compensated(g, lam, r.tparam.detach(), held)
        r.apply(**args, dc_lambda=lam, dc_held=held)
        r.torch_step(g_dc)
        r.check()
    return r


# ------------------------------------------------------------------------------------------------
# Against torch.optim on the compensated gradient


@pytest.mark.parametrize("lam", LAMBDAS, ids=lambda x: f"lambda{x}")
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", DC_CONFIGS)
def test_dc_matches_torch_optim(name: str, codec: str, lam: float) -> None:
    run_dc_against_torch(name, codec, lam, 4097, seed=zlib.crc32(f"{name}/{codec}/{lam}".encode()))


@pytest.mark.parametrize("n", (1, 255, 278011))
@pytest.mark.parametrize("codec", ("none", "int8", "sign", "topk"))
@pytest.mark.parametrize("name", ("sgd-nesterov-wd", "adamw"))
def test_dc_sizes(name: str, codec: str, n: int) -> None:
    """Awkward sizes: one element, tails of tiles and blocks, many threads' tiles."""
    run_dc_against_torch(name, codec, 1.0, n, seed=n, steps=3)


def test_dc_is_the_torch_expression_bit_for_bit() -> None:
    """SGD with lr=1 and nothing else: param_new = param - g_dc with one rounding (FMA or not), so
    the kernel's compensation must round exactly like eager torch's `g + lam * g * g * (w - held)`."""
    n = 4097
    gen = torch.Generator().manual_seed(7)
    for codec in ("none", "bf16", "int8", "sign", "topk"):
        args = gradient_args("both", codec, n, gen)
        w = torch.randn(n, generator=gen)
        held = stale_weights(w, gen)
        g = oracle_grad(args["payload"], args["grad_scale"], args["dense"], args["dense_scale"])
        p = w.clone()
        ops.sgd_apply(p, **args, lr=1.0, dc_lambda=0.5, dc_held=held)
        expected = w - compensated(g, 0.5, w, held)
        assert torch.equal(p, expected), f"{codec}: {(p - expected).abs().max().item()}"


def test_dc_changes_the_step_and_held_equal_to_param_does_not() -> None:
    """A test that can fail both ways: lambda > 0 moves the result away from the uncompensated step,
    and with held == param (no delay) the compensation term is exactly zero."""
    n = 4097
    gen = torch.Generator().manual_seed(8)
    args = gradient_args("both", "int8", n, gen)
    w = torch.randn(n, generator=gen)
    cfg = dict(lr=1e-2, step=1, weight_decay=0.1, decoupled_weight_decay=True)

    def run(**dc) -> torch.Tensor:
        p, m, v = w.clone(), torch.zeros(n), torch.zeros(n)
        ops.adam_apply(p, **args, **cfg, exp_avg=m, exp_avg_sq=v, **dc)
        return torch.cat([p, m, v])

    plain = run()
    assert not torch.equal(run(dc_lambda=1.0, dc_held=stale_weights(w, gen)), plain)
    assert torch.equal(run(dc_lambda=1.0, dc_held=w.clone()), plain)


# ------------------------------------------------------------------------------------------------
# lambda == 0 is today's path, bit for bit


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", ("sgd-nesterov-wd", "sgd-maximize-momentum", "adam-l2", "adamw"))
def test_lambda_zero_is_bit_identical_to_no_arguments(name: str, codec: str) -> None:
    """dc_lambda=0 with or without dc_held equals the call without the arguments, bit for bit, even
    when held is all NaN (so it is never read, and never multiplied by zero)."""
    n = 4097
    gen = torch.Generator().manual_seed(zlib.crc32(f"zero/{name}/{codec}".encode()))
    base = Runner(name, n, gen)
    variants = []
    for dc in ({"dc_lambda": 0.0}, {"dc_lambda": 0, "dc_held": torch.full((n,), float("nan"))}):
        r = Runner(name, n, torch.Generator().manual_seed(0))
        r.param.copy_(base.param)
        variants.append((r, dc))
    for _ in range(3):
        args = gradient_args("both", codec, n, gen)
        base.apply(**args)
        for r, dc in variants:
            r.apply(**args, **dc)
    for r, dc in variants:
        for (what, x), (_, y) in zip(base.tensors(), r.tensors()):
            assert torch.equal(x, y), f"{what} differs with {sorted(dc)}"


@pytest.mark.parametrize("codec", ("fp16", "sign", "topk"))
def test_dc_num_threads_one_equals_default(codec: str) -> None:
    """Compensation is per element inside each tile: the thread count does not change a bit."""
    n = 278011
    gen = torch.Generator().manual_seed(1)
    args = gradient_args("both", codec, n, gen)
    p0, m0, v0 = (torch.randn(n, generator=gen) for _ in range(3))
    v0 = v0.abs()
    held = stale_weights(p0, gen)
    outs = []
    for nt in (1, None):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        ops.adam_apply(
            p, **args, lr=1e-2, step=3, exp_avg=m, exp_avg_sq=v, num_threads=nt, dc_lambda=0.04, dc_held=held
        )
        outs.append((p, m, v))
    for x, y in zip(*outs):
        assert torch.equal(x, y)


def test_dc_with_validate_false_and_misaligned_held() -> None:
    """The engine's path (validate=False) compensates the same; held may start mid-storage."""
    n = 4097
    gen = torch.Generator().manual_seed(3)
    args = gradient_args("both", "fp16", n, gen)
    w = torch.randn(n, generator=gen)
    held_store = torch.empty(n + 1)
    held = held_store[1:]
    held.copy_(stale_weights(w, gen))
    a, b = w.clone(), w.clone()
    ops.sgd_apply(a, **args, lr=0.1, dc_lambda=0.04, dc_held=held)
    ops.sgd_apply(b, **args, lr=0.1, dc_lambda=0.04, dc_held=held.clone(), validate=False)
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Bad arguments


H = torch.zeros(16)
_shared = torch.zeros(16)
_big = torch.zeros(32)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: _sgd(dc_lambda=-0.1, dc_held=H), ValueError, "dc_lambda must be a finite float >= 0"),
        (lambda: _sgd(dc_lambda=float("nan"), dc_held=H), ValueError, "dc_lambda must be a finite float"),
        (lambda: _adam(dc_lambda=float("inf"), dc_held=H), ValueError, "dc_lambda must be a finite float"),
        (lambda: _sgd(dc_lambda="0.1", dc_held=H), TypeError, "dc_lambda must be a float"),
        (lambda: _sgd(dc_lambda=True, dc_held=H), TypeError, "dc_lambda must be a float"),
        (lambda: _sgd(dc_lambda=0.1), ValueError, "dc_lambda > 0 needs dc_held"),
        (lambda: _adam(dc_lambda=0.1), ValueError, "dc_lambda > 0 needs dc_held"),
        (lambda: _sgd(dc_lambda=0.1, validate=False), ValueError, "dc_lambda > 0 needs dc_held"),
        (lambda: _sgd(dc_lambda=0.1, dc_held=torch.zeros(15)), ValueError, "dc_held must have 16 elements"),
        (
            lambda: _adam(dc_lambda=0.1, dc_held=torch.zeros(16, dtype=torch.float64)),
            ValueError,
            "dc_held must be fp32",
        ),
        (lambda: _sgd(dc_lambda=0.1, dc_held=torch.zeros(32)[::2]), ValueError, "dc_held must be contiguous"),
        (lambda: _sgd(dc_lambda=0.1, dc_held=[0.0] * 16), TypeError, "dc_held must be a torch.Tensor"),
        (lambda: _sgd(param=_shared, dc_lambda=0.1, dc_held=_shared), ValueError, "dc_held and param share"),
        (
            lambda: _sgd(momentum=0.9, momentum_buffer=_big[:16], dc_lambda=0.1, dc_held=_big[8:24]),
            ValueError,
            "dc_held and momentum_buffer share memory",
        ),
        (lambda: _adam(exp_avg_sq=_shared, dc_lambda=1.0, dc_held=_shared), ValueError, "exp_avg_sq share"),
        (
            lambda: _sgd(
                payload=make_payload("topk", 16, torch.Generator()),
                scratch=_shared,
                dc_lambda=1.0,
                dc_held=_shared,
            ),
            ValueError,
            "dc_held and scratch share",
        ),
    ],
)
def test_bad_dc_arguments(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_core_rechecks_the_dc_arguments() -> None:
    """The C++ core refuses what would read through a null pointer or compute with a bad lambda, even
    when called past the Python checks."""
    from pyasync import _ext

    c = _ext.C()
    p, d = torch.zeros(16), torch.ones(16)
    kw = dict(
        codec=0,
        codes=0,
        scales=0,
        n=16,
        block=0,
        grad_scale=1.0,
        dense=d.data_ptr(),
        dense_scale=1.0,
        param=p.data_ptr(),
        state1=0,
        state2=0,
        opt={"kind": "sgd", "lr": 0.1},
        num_threads=0,
    )
    with pytest.raises(ValueError, match="dc_lambda > 0 needs dc_held"):
        c.apply_cpu(**kw, dc_lambda=0.5, dc_held=0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="dc_lambda must be finite and >= 0"):
            c.apply_cpu(**kw, dc_lambda=bad, dc_held=d.data_ptr())
    assert torch.equal(p, torch.zeros(16))
    c.apply_cpu(**kw, dc_lambda=0.0, dc_held=0)
    torch.testing.assert_close(p, torch.full((16,), -0.1))


# ------------------------------------------------------------------------------------------------
# CUDA


@cuda
@needs_gpu
@pytest.mark.parametrize("lam", (0.04, 1.0), ids=lambda x: f"lambda{x}")
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "name", ("sgd-momentum", "sgd-nesterov-wd", "sgd-maximize-momentum", "adam-l2", "adamw")
)
def test_cuda_dc_matches_torch_optim(name: str, codec: str, lam: float) -> None:
    if not _gpu_ready():
        pytest.skip("pyasync was built without CUDA kernels")
    for n in (1, 255, 4097, 278011):
        run_dc_against_torch(name, codec, lam, n, seed=n, device="cuda", steps=STEPS if n < 100_000 else 2)


@cuda
@needs_gpu
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", ("sgd-nesterov-wd", "adamw", "adam-l2"))
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned-held"])
def test_cuda_dc_matches_cpu(name: str, codec: str, offset: int) -> None:
    """CPU tile pass and CUDA kernel (vector path; scalar path when held is misaligned) agree."""
    if not _gpu_ready():
        pytest.skip("pyasync was built without CUDA kernels")
    n = 278011
    gen = torch.Generator().manual_seed(9)
    cpu = Runner(name, n, gen)
    dev = Runner(name, n, torch.Generator().manual_seed(0), device="cuda")
    dev.param.copy_(cpu.param)
    for _ in range(4):
        args = gradient_args("both", codec, n, gen)
        held = stale_weights(cpu.param, gen)
        cpu.apply(**args, dc_lambda=1.0, dc_held=held)
        dheld = torch.empty(n + offset, device="cuda")[offset:]
        dheld.copy_(held)
        dargs = {
            k: (move(v, "cuda") if isinstance(v, Payload) else v.cuda() if torch.is_tensor(v) else v)
            for k, v in args.items()
        }
        dev.apply(**dargs, dc_lambda=1.0, dc_held=dheld)
    torch.cuda.synchronize()
    for (what, x), (_, y) in zip(cpu.tensors(), dev.tensors()):
        torch.testing.assert_close(y.cpu(), x, rtol=RTOL, atol=ATOL, msg=lambda m, what=what: f"{what}: {m}")


@cuda
@needs_gpu
@pytest.mark.parametrize("name", ("sgd-nesterov-wd", "adamw"))
def test_cuda_lambda_zero_is_bit_identical(name: str) -> None:
    if not _gpu_ready():
        pytest.skip("pyasync was built without CUDA kernels")
    n = 278011
    gen = torch.Generator().manual_seed(4)
    a = Runner(name, n, gen, device="cuda")
    b = Runner(name, n, torch.Generator().manual_seed(0), device="cuda")
    b.param.copy_(a.param)
    nan_held = torch.full((n,), float("nan"), device="cuda")
    for _ in range(3):
        args = gradient_args("both", "int8", n, gen, "cuda")
        a.apply(**args)
        b.apply(**args, dc_lambda=0.0, dc_held=nan_held)
    torch.cuda.synchronize()
    for (what, x), (_, y) in zip(a.tensors(), b.tensors()):
        assert torch.equal(x, y), what


@cuda
@needs_gpu
def test_cuda_dc_held_on_the_wrong_device_is_rejected() -> None:
    with pytest.raises(ValueError, match="dc_held is on cpu"):
        ops.sgd_apply(
            torch.zeros(16, device="cuda"),
            dense=torch.zeros(16, device="cuda"),
            lr=0.1,
            dc_lambda=0.1,
            dc_held=torch.zeros(16),
        )
