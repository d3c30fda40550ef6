"""Fused apply-to-shard (pyasync.ops.apply) against torch.optim and pyasync.reference.apply.

The oracle for the optimizer is the real torch.optim.SGD / Adam / AdamW (single-tensor path), fed the
decoded gradient, so only the apply is tested; payloads are built directly from random codes and
decoded here by an independent few-line decoder (not by pyasync's codecs). Tolerances: rtol 1e-6,
atol 1e-7 on values of order 1. SGD is in fact bit-exact on FMA CPUs; Adam differs by about an ulp
because torch's CPU sqrt is not correctly rounded (see Note [Fused apply] in math/optim.h).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import pytest
import torch

from pyasync.ops import apply as ops
from pyasync.ops._common import Payload
from pyasync.reference import apply as ref

CODECS = ("none", "fp16", "bf16", "int8", "sign", "topk")
SIZES = (1, 255, 4097, 278011)
BLOCK = 64
RTOL, ATOL = 1e-6, 1e-7
STEPS = 10

cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_ready() -> bool:
    from pyasync import _ext

    return torch.cuda.is_available() and _ext.available() and _ext.has_cuda() and _ext.cuda_device_count() > 0


# ------------------------------------------------------------------------------------------------
# Payloads from random codes, and an independent decoder


def make_payload(
    codec: str, n: int, gen: torch.Generator, device: str = "cpu", block: int = BLOCK
) -> Payload:
    nb = -(-n // block)
    if codec == "none":
        p = Payload("none", n, torch.randn(n, generator=gen))
    elif codec in ("fp16", "bf16"):
        dt = torch.float16 if codec == "fp16" else torch.bfloat16
        p = Payload(codec, n, torch.randn(n, generator=gen).to(dt))
    elif codec == "int8":
        codes = torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int8)
        p = Payload("int8", n, codes, scales=torch.rand(nb, generator=gen) * 0.02, block=block)
    elif codec == "sign":
        codes = torch.randint(0, 256, (-(-n // 8),), generator=gen, dtype=torch.uint8)
        p = Payload("sign", n, codes, scales=torch.rand(nb, generator=gen), block=block)
    elif codec == "topk":
        k = max(1, n // 10)
        idx = torch.randperm(n, generator=gen)[:k].sort().values.to(torch.int32)
        p = Payload("topk", n, torch.randn(k, generator=gen), indices=idx, k=k)
    else:
        raise AssertionError(codec)
    return move(p, device)


def move(p: Payload, device: str) -> Payload:
    return replace(
        p,
        codes=p.codes.to(device),
        scales=None if p.scales is None else p.scales.to(device),
        indices=None if p.indices is None else p.indices.to(device),
    )


def decoded(p: Payload) -> torch.Tensor:
    """The fp32 gradient a payload stands for, written independently of pyasync's codecs."""
    if p.codec == "none":
        return p.codes.clone()
    if p.codec in ("fp16", "bf16"):
        return p.codes.float()
    scale = p.scales.repeat_interleave(p.block)[: p.n] if p.scales is not None else None
    if p.codec == "int8":
        return p.codes.float() * scale
    if p.codec == "sign":
        bits = (p.codes.long().unsqueeze(1) >> torch.arange(8, device=p.codes.device)) & 1
        return torch.where(bits.flatten()[: p.n].bool(), scale, -scale)
    out = torch.zeros(p.n, device=p.codes.device)
    out[p.indices.long()] = p.codes
    return out


def oracle_grad(
    payload: Payload | None, grad_scale: float, dense: torch.Tensor | None, dense_scale: float
) -> torch.Tensor:
    g = None if payload is None else decoded(payload) * grad_scale
    if dense is not None:
        g = dense * dense_scale if g is None else dense * dense_scale + g
    return g


# ------------------------------------------------------------------------------------------------
# Optimizer configurations: (name, pyasync function, kwargs, torch factory)

SGD_CONFIGS = {
    "sgd": dict(lr=0.1),
    "sgd-wd": dict(lr=0.05, weight_decay=0.01),
    "sgd-momentum": dict(lr=0.1, momentum=0.9),
    "sgd-momentum-dampening-wd": dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.02),
    "sgd-nesterov-wd": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-maximize-momentum": dict(lr=0.05, momentum=0.5, maximize=True),
}
ADAM_CONFIGS = {
    "adam": dict(lr=1e-2),
    "adam-l2": dict(lr=1e-2, weight_decay=0.1),
    "adamw": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "adam-maximize-betas": dict(lr=3e-2, beta1=0.5, beta2=0.99, eps=1e-6, maximize=True),  # lerp weight 0.5
    "adamw-amsbetas": dict(lr=1e-3, beta1=0.95, beta2=0.95, weight_decay=0.5, decoupled_weight_decay=True),
}
CONFIGS = {**SGD_CONFIGS, **ADAM_CONFIGS}


class Runner:
    """One shard under pyasync (`impl`) and the same shard under torch.optim, stepped together."""

    def __init__(
        self, name: str, n: int, gen: torch.Generator, device: str = "cpu", impl=ops, fused: bool = False
    ):
        """fused: the torch side is torch.optim's fused implementation instead of the single-tensor one."""
        self.cfg = dict(CONFIGS[name])
        self.adam = name in ADAM_CONFIGS
        self.impl = impl
        p0 = torch.randn(n, generator=gen).to(device)
        self.param = p0.clone()
        self.tparam = torch.nn.Parameter(p0.clone())
        self.step = 0
        c = self.cfg
        impl_kw = {"fused": True} if fused else {"foreach": False}
        if self.adam:
            self.exp_avg = torch.zeros(n, device=device)
            self.exp_avg_sq = torch.zeros(n, device=device)
            cls = torch.optim.AdamW if c.get("decoupled_weight_decay") else torch.optim.Adam
            self.opt = cls(
                [self.tparam],
                lr=c["lr"],
                betas=(c.get("beta1", 0.9), c.get("beta2", 0.999)),
                eps=c.get("eps", 1e-8),
                weight_decay=c.get("weight_decay", 0.0),
                maximize=c.get("maximize", False),
                **impl_kw,
            )
        else:
            self.buf = torch.full((n,), float("nan"), device=device)  # first_step must overwrite it
            self.opt = torch.optim.SGD([self.tparam], **impl_kw, **c)

    def apply(self, **grad) -> None:
        self.step += 1
        if self.adam:
            self.impl.adam_apply(
                self.param,
                **grad,
                **self.cfg,
                step=self.step,
                exp_avg=self.exp_avg,
                exp_avg_sq=self.exp_avg_sq,
            )
        else:
            self.impl.sgd_apply(
                self.param, **grad, **self.cfg, momentum_buffer=self.buf, first_step=self.step == 1
            )

    def torch_step(self, g: torch.Tensor) -> None:
        self.tparam.grad = g.clone()
        self.opt.step()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The pyasync side's shard and state."""
        out = [("param", self.param)]
        if self.adam:
            out += [("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)]
        elif self.cfg.get("momentum", 0.0):
            out.append(("momentum_buffer", self.buf))
        return out

    def pairs(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        st = self.opt.state[self.tparam]
        out = [("param", self.param, self.tparam.detach())]
        if self.adam:
            out += [
                ("exp_avg", self.exp_avg, st["exp_avg"]),
                ("exp_avg_sq", self.exp_avg_sq, st["exp_avg_sq"]),
            ]
        elif self.cfg.get("momentum", 0.0):
            out.append(("momentum_buffer", self.buf, st["momentum_buffer"]))
        return out

    def check(self, rtol: float = RTOL, atol: float = ATOL) -> None:
        for what, mine, theirs in self.pairs():
            torch.testing.assert_close(
                mine, theirs, rtol=rtol, atol=atol, msg=lambda m, what=what: f"{what} step {self.step}: {m}"
            )


def gradient_args(mode: str, codec: str, n: int, gen: torch.Generator, device: str = "cpu") -> dict:
    """apply's gradient keywords for mode 'payload' | 'dense' | 'both' (grad_scale != 1 throughout)."""
    args: dict = {}
    if mode in ("payload", "both"):
        args["payload"] = make_payload(codec, n, gen, device)
        args["grad_scale"] = 0.25
    if mode in ("dense", "both"):
        args["dense"] = torch.randn(n, generator=gen).to(device)
        args["dense_scale"] = 0.5
    return args


def run_against_torch(
    name: str, codec: str, mode: str, n: int, seed: int, device: str = "cpu", steps: int = STEPS
) -> Runner:
    gen = torch.Generator().manual_seed(seed)
    r = Runner(name, n, gen, device)
    for _ in range(steps):
        args = gradient_args(mode, codec, n, gen, device)
        r.apply(**args)
        r.torch_step(
            oracle_grad(
                args.get("payload"),
                args.get("grad_scale", 1.0),
                args.get("dense"),
                args.get("dense_scale", 1.0),
            )
        )
        r.check()
    return r


# ------------------------------------------------------------------------------------------------
# Against torch.optim


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_torch_optim(name: str, codec: str) -> None:
    mode = "both" if codec in ("int8", "topk") else "payload"
    run_against_torch(name, codec, mode, 4097, seed=zlib.crc32(f"{name}/{codec}".encode()))


@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adam-l2", "adamw"])
def test_dense_only_matches_torch_optim(name: str) -> None:
    run_against_torch(name, "none", "dense", 4097, seed=3)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", ["sgd-momentum-dampening-wd", "adamw"])
def test_sizes(name: str, codec: str, n: int) -> None:
    run_against_torch(name, codec, "both", n, seed=n, steps=STEPS if n < 100_000 else 3)


def test_large_shard() -> None:
    """25M/4 elements: many threads' tiles and blocks, still element-wise equal to torch.optim."""
    run_against_torch("adamw", "int8", "both", 25_000_000 // 4, seed=11, steps=2)


def test_sgd_first_step_overwrites_buffer_and_zero_size_is_a_no_op() -> None:
    gen = torch.Generator().manual_seed(0)
    param, buf = torch.randn(300, generator=gen), torch.full((300,), float("nan"))
    g = torch.randn(300, generator=gen)
    ops.sgd_apply(param, dense=g, lr=0.1, momentum=0.9, momentum_buffer=buf, first_step=True)
    assert torch.equal(buf, g)
    empty = torch.empty(0)
    ops.adam_apply(
        empty, dense=torch.empty(0), lr=0.1, step=1, exp_avg=torch.empty(0), exp_avg_sq=torch.empty(0)
    )
    ops.sgd_apply(empty, payload=make_payload("int8", 0, gen), lr=0.1)


# ------------------------------------------------------------------------------------------------
# Against pyasync.reference.apply (which uses pyasync.reference.codecs.decode)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adam-maximize-betas", "adamw"])
def test_matches_reference(name: str, codec: str) -> None:
    pytest.importorskip("pyasync.reference.codecs")
    n = 5003
    gen = torch.Generator().manual_seed(5)
    a, b = Runner(name, n, gen), Runner(name, n, gen, impl=ref)
    b.param.copy_(a.param)
    for _ in range(4):
        args = gradient_args("both", codec, n, gen)
        a.apply(**args)
        b.apply(**args)
    for (what, x), (_, y) in zip(a.tensors(), b.tensors()):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, msg=lambda m, what=what: f"{what}: {m}")


# ------------------------------------------------------------------------------------------------
# Threads, alignment, scratch


@pytest.mark.parametrize("codec", ["fp16", "sign", "topk"])
def test_num_threads_one_equals_default(codec: str) -> None:
    n = 278011
    gen = torch.Generator().manual_seed(1)
    args = gradient_args("both", codec, n, gen)
    p0, m0, v0 = (torch.randn(n, generator=gen) for _ in range(3))
    v0 = v0.abs()
    outs = []
    for nt in (1, None):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        ops.adam_apply(
            p,
            **args,
            lr=1e-2,
            weight_decay=0.1,
            decoupled_weight_decay=True,
            step=3,
            exp_avg=m,
            exp_avg_sq=v,
            num_threads=nt,
        )
        outs.append((p, m, v))
    for x, y in zip(*outs):
        assert torch.equal(x, y)


def test_misaligned_views_and_scratch() -> None:
    """Shards that start mid-tensor (not 16-byte aligned) give the same bits; a given scratch is used."""
    n = 4097
    gen = torch.Generator().manual_seed(2)
    args = gradient_args("both", "int8", n, gen)
    base = torch.randn(3, n + 1, generator=gen)
    base[2].abs_()
    p1, m1, v1 = (base[i, 1:].clone() for i in range(3))
    p2, m2, v2 = (base[i, 1:] for i in range(3))  # views at a 4-byte offset
    common = dict(lr=1e-2, step=2)
    ops.adam_apply(p1, **args, **common, exp_avg=m1, exp_avg_sq=v1)
    ops.adam_apply(p2, **args, **common, exp_avg=m2, exp_avg_sq=v2)
    assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)
    targs = gradient_args("both", "topk", n, gen)
    scratch = torch.full((n,), float("nan"))
    q1, q2 = p1.clone(), p1.clone()
    ops.sgd_apply(q1, **targs, lr=0.1, scratch=scratch)
    ops.sgd_apply(q2, **targs, lr=0.1)
    assert torch.equal(q1, q2)
    torch.testing.assert_close(
        scratch, oracle_grad(targs["payload"], 0.25, targs["dense"], 0.5), rtol=0, atol=0
    )


# ------------------------------------------------------------------------------------------------
# Bad arguments


def _sgd(**kw):
    n = kw.pop("n", 16)
    base = dict(param=torch.zeros(n), dense=torch.zeros(n), lr=0.1)
    base.update(kw)
    p = base.pop("param")
    ops.sgd_apply(p, **base)


def _adam(**kw):
    n = 16
    base = dict(
        param=torch.zeros(n),
        dense=torch.zeros(n),
        lr=0.1,
        step=1,
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
    )
    base.update(kw)
    p = base.pop("param")
    ops.adam_apply(p, **base)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: _sgd(dense=None), ValueError, "needs a gradient"),
        (lambda: _sgd(lr=-1.0), ValueError, "lr must be >= 0"),
        (lambda: _sgd(lr=float("nan")), ValueError, "lr must be finite"),
        (lambda: _sgd(lr="0.1"), TypeError, "lr must be a float"),
        (lambda: _sgd(momentum=-0.1), ValueError, "momentum must be >= 0"),
        (lambda: _sgd(weight_decay=-1e-3), ValueError, "weight_decay must be >= 0"),
        (lambda: _sgd(nesterov=True), ValueError, "nesterov=True requires momentum > 0"),
        (
            lambda: _sgd(nesterov=True, momentum=0.9, dampening=0.1, momentum_buffer=torch.zeros(16)),
            ValueError,
            "dampening == 0",
        ),
        (lambda: _sgd(momentum=0.9), ValueError, "needs momentum_buffer"),
        (
            lambda: _sgd(momentum=0.9, momentum_buffer=torch.zeros(15)),
            ValueError,
            "momentum_buffer must have 16",
        ),
        (
            lambda: _sgd(momentum=0.9, momentum_buffer=torch.zeros(16, dtype=torch.float64)),
            TypeError,
            "momentum_buffer must have dtype",
        ),
        (lambda: _sgd(first_step=1), TypeError, "first_step must be a bool"),
        (lambda: _sgd(param=torch.zeros(4, 4), dense=torch.zeros(16)), ValueError, "param must be 1-D"),
        (lambda: _sgd(param=torch.zeros(32)[::2]), ValueError, "param must be contiguous"),
        (lambda: _sgd(param=torch.zeros(16, dtype=torch.float16)), TypeError, "param must have dtype"),
        (lambda: _sgd(dense=torch.zeros(17)), ValueError, "dense must have 16 elements"),
        (
            lambda: _sgd(grad_scale=float("inf"), payload=make_payload("none", 16, torch.Generator())),
            ValueError,
            "grad_scale must be finite",
        ),
        (lambda: _sgd(payload=make_payload("int8", 15, torch.Generator())), ValueError, "15 elements"),
        (
            lambda: _sgd(payload=replace(make_payload("fp16", 16, torch.Generator()), finite=False)),
            ValueError,
            "payload.finite is False",
        ),
        (lambda: _sgd(payload="int8"), TypeError, "payload must be a pyasync Payload"),
        (lambda: _sgd(num_threads=-1), ValueError, "num_threads"),
        (lambda: _sgd(scratch=torch.zeros(3)), ValueError, "scratch must have 16"),
        (lambda: _adam(beta1=1.0), ValueError, "beta1 must be < 1"),
        (lambda: _adam(beta2=-0.1), ValueError, "beta2 must be >= 0"),
        (lambda: _adam(eps=-1e-8), ValueError, "eps must be >= 0"),
        (lambda: _adam(step=0), ValueError, "step must be >= 1"),
        (lambda: _adam(step=1.0), TypeError, "step must be an int"),
        (lambda: _adam(step=True), TypeError, "step must be an int"),
        (lambda: _adam(exp_avg=torch.zeros(8)), ValueError, "exp_avg must have 16"),
        (lambda: _adam(exp_avg_sq=None), TypeError, "exp_avg_sq must be a torch.Tensor"),
        (lambda: _adam(decoupled_weight_decay="yes"), TypeError, "decoupled_weight_decay must be a bool"),
    ],
)
def test_bad_arguments(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_shared_state_memory_is_rejected() -> None:
    p = torch.zeros(16)
    with pytest.raises(ValueError, match="share memory"):
        ops.adam_apply(p, dense=torch.zeros(16), lr=0.1, step=1, exp_avg=p, exp_avg_sq=torch.zeros(16))
    m = torch.zeros(16)
    with pytest.raises(ValueError, match="share memory"):
        ops.adam_apply(torch.zeros(16), dense=m, lr=0.1, step=1, exp_avg=m, exp_avg_sq=torch.zeros(16))
    big = torch.zeros(32)
    with pytest.raises(ValueError, match="share memory"):
        ops.sgd_apply(big[:16], dense=torch.zeros(16), lr=0.1, momentum=0.9, momentum_buffer=big[8:24])


def test_reference_rejects_what_ops_rejects() -> None:
    with pytest.raises(ValueError, match="nesterov"):
        ref.sgd_apply(torch.zeros(4), dense=torch.zeros(4), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="step must be >= 1"):
        ref.adam_apply(
            torch.zeros(4),
            dense=torch.zeros(4),
            lr=0.1,
            step=0,
            exp_avg=torch.zeros(4),
            exp_avg_sq=torch.zeros(4),
        )


def test_bias_correction_scalars_are_torchs() -> None:
    step_size, bc2 = ops.adam_scalars(1e-3, 0.9, 0.999, 7)
    assert step_size == 1e-3 / (1 - 0.9**7)
    assert bc2 == math.sqrt(1 - 0.999**7) or bc2 == (1 - 0.999**7) ** 0.5


# ------------------------------------------------------------------------------------------------
# CUDA


@cuda
@needs_gpu
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "name", ["sgd-nesterov-wd", "sgd-momentum-dampening-wd", "adam-maximize-betas", "adamw"]
)
def test_cuda_matches_torch_optim(name: str, codec: str) -> None:
    if not _gpu_ready():
        pytest.skip("pyasync was built without CUDA kernels")
    for n in (1, 255, 4097, 278011):
        run_against_torch(name, codec, "both", n, seed=n, device="cuda", steps=STEPS if n < 100_000 else 3)


@cuda
@needs_gpu
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adamw", "adam-l2"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_cuda_matches_cpu(name: str, codec: str, offset: int) -> None:
    """CPU loop and CUDA kernel (vector path when aligned, scalar path when not) agree element-wise."""
    if not _gpu_ready():
        pytest.skip("pyasync was built without CUDA kernels")
    n = 278011
    gen = torch.Generator().manual_seed(9)
    cpu = Runner(name, n, gen)
    dev = Runner(name, n, torch.Generator().manual_seed(0), device="cuda")
    if offset:  # shards that start 4 bytes into their storage: the kernel must take the scalar path
        for t in ("param", "exp_avg", "exp_avg_sq", "buf"):
            if hasattr(dev, t):
                src = getattr(dev, t)
                view = torch.empty(n + offset, device="cuda")[offset:]
                view.copy_(src)
                setattr(dev, t, view)
    dev.param.copy_(cpu.param)
    for _ in range(4):
        args = gradient_args("both", codec, n, gen)
        cpu.apply(**args)
        dargs = {
            k: (move(v, "cuda") if isinstance(v, Payload) else v.cuda() if torch.is_tensor(v) else v)
            for k, v in args.items()
        }
        dev.apply(**dargs)
    torch.cuda.synchronize()
    for (what, x), (_, y) in zip(cpu.tensors(), dev.tensors()):
        torch.testing.assert_close(y.cpu(), x, rtol=RTOL, atol=ATOL, msg=lambda m, what=what: f"{what}: {m}")


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[cuda, needs_gpu])]
FUSED_RTOL, FUSED_ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", ["adam", "adamw", "adam-maximize-betas", "sgd-nesterov-wd"])
def test_matches_torch_fused_optimizer(name: str, codec: str, device: str) -> None:
    """Against torch.optim's fused implementation (``fused=True``: one kernel per step, the one an
    owner would otherwise run after decoding), element-wise over STEPS steps. Looser than against the
    single-tensor path: torch's fused CUDA kernels compute the bias corrections in fp32 and exp_avg as
    beta1 * m + (1 - beta1) * g rather than lerp, which moves results by a few ulps."""
    if device == "cuda" and not _gpu_ready():
        pytest.skip("pyasync was built without CUDA kernels")
    n = 278011
    gen = torch.Generator().manual_seed(41)
    try:
        r = Runner(name, n, gen, device, fused=True)
    except (RuntimeError, ValueError) as e:
        if "fused" not in str(e):
            raise
        pytest.skip(f"this torch has no fused {name} on {device}: {e}")
    for _ in range(STEPS):
        args = gradient_args("both", codec, n, gen, device)
        r.apply(**args)
        r.torch_step(
            oracle_grad(
                args.get("payload"),
                args.get("grad_scale", 1.0),
                args.get("dense"),
                args.get("dense_scale", 1.0),
            )
        )
        r.check(rtol=FUSED_RTOL, atol=FUSED_ATOL)


@cuda
@needs_gpu
def test_cuda_device_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="dense is on cpu"):
        ops.sgd_apply(torch.zeros(16, device="cuda"), dense=torch.zeros(16), lr=0.1)
