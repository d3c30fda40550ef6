"""The delayed Nesterov outer step of asynchronous local steps (Note [Delayed Nesterov] in
csrc/include/pyasync/math/optim.h): the fused apply (CPU; CUDA where a GPU exists) against its eager
twin pyasync.reference.apply.delayed_nesterov_apply, bit for bit on the CPU, under every codec the
apply decodes; the optimizer class against torch's Nesterov SGD; and a round of n pushes in the
owner's rule against one synchronous Nesterov step of their sum."""

from __future__ import annotations

import pytest
import torch

from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import build_layout
from pyasync.engine.p2p.applier import OwnedShard, apply_push
from pyasync.engine.p2p.messages import Push
from pyasync.ops import apply as ops
from pyasync.ops._common import Payload
from pyasync.optim import DelayedNesterov
from pyasync.policy import Local
from pyasync.reference import apply as ref
from tests.kernels.test_apply import _gpu_ready, make_payload, move

CODECS = ("none", "fp16", "bf16", "int8", "sign", "topk")


def _state(n: int, gen: torch.Generator, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.randn(n, generator=gen).to(device) for _ in range(3)]  # param, momentum, accumulator


def _run(fn, state, payload, dense, close: bool, **kw) -> None:
    p, m, a = state
    fn(p, payload=payload, grad_scale=0.25, dense=dense, dense_scale=0.5, lr=0.7, momentum=0.9,
       close_round=close, momentum_buffer=m, accumulator=a, **kw)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 7, 2048, 4097, 278011])
def test_cpu_equals_the_reference_bit_for_bit(codec: str, n: int) -> None:
    """Six arrivals, every third closing a round, a payload and a dense term: param, momentum and
    accumulator equal the eager twin's exactly (with one thread and with the default)."""
    gen = torch.Generator().manual_seed(n)
    start = _state(n, gen)
    for threads in (1, None):
        mine, want = [t.clone() for t in start], [t.clone() for t in start]
        g2 = torch.Generator().manual_seed(7)
        for step in range(6):
            pay = make_payload(codec, n, g2)
            dense = torch.randn(n, generator=g2)
            _run(ops.delayed_nesterov_apply, mine, pay, dense, step % 3 == 2, num_threads=threads)
            _run(ref.delayed_nesterov_apply, want, pay, dense, step % 3 == 2)
        for name, x, y in zip(("param", "momentum", "accumulator"), mine, want):
            assert torch.equal(x, y), f"{name} differs (max {(x - y).abs().max().item()})"
        assert torch.equal(mine[2], torch.zeros(n)), "a closed round leaves the accumulator at zero"


def test_delay_one_is_torch_nesterov_sgd() -> None:
    """DelayedNesterov(delay=1) is torch.optim.SGD(momentum, nesterov=True) (up to rounding: the
    gradient and momentum parts are two fmas rather than one)."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(300))
    b.data.copy_(a.data)
    mine = DelayedNesterov([a], lr=0.7, momentum=0.9, delay=1)
    theirs = torch.optim.SGD([b], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(20):
        g = torch.randn(300)
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        theirs.step()
    torch.testing.assert_close(a.data, b.data, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_a_round_of_pushes_is_one_nesterov_step_of_their_mean(world: int) -> None:
    """Equal workers, no delay: the owner's rule under local:H:async applies each push's share at once
    and the momentum once per round of ``world`` pushes, so after every round the shard is where one
    Nesterov SGD step on the round's mean puts it; per-push Nesterov (delay 1) is not."""
    n = 64
    layout = build_layout([[0]], [n * world], [0], world)[0].shards[0]
    policy = Local(4, mode="async")
    rule = UpdateRule(DelayedNesterov([torch.zeros(1)], lr=0.7, momentum=0.9))
    start = torch.randn(n, generator=torch.Generator().manual_seed(1))
    rnd = policy.outer().round(world, len(layout.segments), 0)
    sh = OwnedShard(rnd, rule.new_state(layout, start.clone()))
    sync = torch.nn.Parameter(start.clone())
    outer = torch.optim.SGD([sync], lr=0.7, momentum=0.9, nesterov=True)
    naive = torch.nn.Parameter(start.clone())
    per_push = torch.optim.SGD([naive], lr=0.7, momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(2)
    for rnd in range(5):
        gs = [torch.randn(n, generator=gen) for _ in range(world)]
        for w, g in enumerate(gs):
            apply_push(rule, sh, Push(0, w, rnd, 0, Payload("none", n, g.clone()), (True,)), world, 1.0,
                       per_round=True)
            naive.grad = g / world
            per_push.step()
        sync.grad = sum(gs) / world
        outer.step()
        torch.testing.assert_close(sh.state.master, sync.detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(naive.detach(), sync.detach(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"momentum": 1.0}, ValueError, "momentum"),
        ({"lr": -1.0}, ValueError, "lr"),
        ({"close_round": 1}, TypeError, "close_round"),
    ],
)
def test_bad_arguments(kw, exc, match) -> None:
    p, m, a = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    args = {"dense": torch.ones(8), "lr": 0.7, "momentum": 0.9, "close_round": True,
            "momentum_buffer": m, "accumulator": a, **kw}
    with pytest.raises(exc, match=match):
        ops.delayed_nesterov_apply(p, **args)
    with pytest.raises(exc, match=match):
        ref.delayed_nesterov_apply(p, **args)
    with pytest.raises(ValueError, match="delay"):
        DelayedNesterov([torch.nn.Parameter(torch.zeros(1))], delay=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_cuda_equals_cpu(codec: str, offset: int) -> None:
    """The CUDA kernel (vector path when aligned, scalar path when not) against the CPU loop."""
    if not _gpu_ready():
        pytest.skip("pyasync was built without CUDA kernels")
    n = 278011
    start = _state(n, torch.Generator().manual_seed(3))
    cpu = [t.clone() for t in start]
    dev = []
    for t in start:
        view = torch.empty(n + offset, device="cuda")[offset:]
        view.copy_(t)
        dev.append(view)
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        pay, dense = make_payload(codec, n, gen), torch.randn(n, generator=gen)
        _run(ops.delayed_nesterov_apply, cpu, pay, dense, step % 2 == 1)
        _run(ops.delayed_nesterov_apply, dev, move(pay, "cuda"), dense.cuda(), step % 2 == 1)
    torch.cuda.synchronize()
    for x, y in zip(cpu, dev):
        torch.testing.assert_close(y.cpu(), x, rtol=1e-6, atol=1e-6)
