"""Momentum-corrected top-k (DGC): the velocity step and the factor masking of the top-k encode, CPU
and CUDA, against pyasync.reference.topk bit for bit; then the compressor's ledger.

See Note [Momentum correction for top-k] in csrc/include/pyasync/math/topk.h.
"""

from __future__ import annotations

import pytest
import torch

from pyasync.compression import TopK, from_spec
from pyasync.ops import codecs
from pyasync.reference.topk import dgc_encode, dgc_velocity

MU = 0.9


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen), 0.3 * torch.randn(n, generator=gen)


def _kernel_step(g, u, e, k, nesterov, num_threads=None):
    """The two kernels as the compressor calls them: velocity into a new buffer, x aliased to it
    without Nesterov, encode masking that buffer. Returns (payload, new velocity, new residual)."""
    u_new = torch.full_like(u, 777.0)
    x_out = torch.full_like(u, 555.0) if nesterov else None
    x = codecs.dgc_velocity(g, u, u_new, momentum=MU, nesterov=nesterov, x_out=x_out, num_threads=num_threads)
    e_new = torch.full_like(e, 12345.0)
    p = codecs.encode("topk", x, residual_in=e, residual_out=e_new, k=k, mask_out=u_new,
                      num_threads=num_threads)
    return p, u_new, e_new


def _same(a, b) -> None:
    (pa, ua, ea), (pb, ub, eb) = a, b
    assert torch.equal(pa.indices.cpu(), pb.indices.cpu()), "index sets differ"
    assert torch.equal(_bits(pa.codes.cpu()), _bits(pb.codes.cpu())), "values differ"
    assert pa.finite == pb.finite
    if pa.finite:
        assert torch.equal(_bits(ua.cpu()), _bits(ub.cpu())), "velocities differ"
        assert torch.equal(_bits(ea.cpu()), _bits(eb.cpu())), "residuals differ"


@pytest.mark.parametrize("nesterov", [False, True], ids=["plain", "nesterov"])
@pytest.mark.parametrize("n", [1, 4097, 278011, 1_000_003], ids=lambda n: f"n{n}")
def test_matches_reference(n: int, nesterov: bool) -> None:
    g, u, e = _data(n, n)
    for k in sorted({1, max(1, n // 100), max(1, n // 2)}):  # n // 2: the streaming select
        _same(_kernel_step(g, u, e, k, nesterov), dgc_encode(g, u, e, k, MU, nesterov))


def test_velocity_formula() -> None:
    """u' = mu * u + g and (Nesterov) x = g + mu * u', each operation rounded on its own."""
    g, u, _ = _data(10_007, 3)
    u_new = torch.empty_like(u)
    x = torch.empty_like(u)
    codecs.dgc_velocity(g, u, u_new, momentum=MU, nesterov=True, x_out=x)
    mu32 = float(torch.tensor(MU, dtype=torch.float32))  # the kernel's fp32 momentum
    want_u = (u.double() * mu32).float() + g  # fp32 product (exact in double, rounded once), then the sum
    assert torch.equal(_bits(u_new), _bits(want_u))
    assert torch.equal(_bits(x), _bits(g + (want_u.double() * mu32).float()))
    ref_u, ref_x = dgc_velocity(g, u, MU, nesterov=True)
    assert torch.equal(_bits(u_new), _bits(ref_u)) and torch.equal(_bits(x), _bits(ref_x))
    in_place = u.clone()  # u_out may be u_in itself
    codecs.dgc_velocity(g, in_place, in_place, momentum=MU)
    assert torch.equal(_bits(in_place), _bits(want_u))


def test_masking_zeroes_exactly_the_sent_velocity() -> None:
    n, k = 50_000, 500
    g, u, e = _data(n, 5)
    p, u_new, e_new = _kernel_step(g, u, e, k, False)
    idx = p.indices.long()
    sent = torch.zeros(n, dtype=torch.bool)
    sent[idx] = True
    assert bool((u_new[sent] == 0).all()) and bool((e_new[sent] == 0).all())
    unmasked, _ = dgc_velocity(g, u, MU)
    assert torch.equal(u_new[~sent], unmasked[~sent])
    assert torch.equal(e_new[~sent], (unmasked + e)[~sent])  # the unsent velocity is owed


def test_nonfinite_flags_the_payload() -> None:
    g, u, e = _data(4097, 9)
    g[17] = float("nan")
    p, _, _ = _kernel_step(g, u, e, 40, False)
    assert not p.finite


@pytest.mark.parametrize("num_threads", [1, 3])
def test_threads_agree(num_threads: int) -> None:
    g, u, e = _data(1_000_003, 11)
    _same(_kernel_step(g, u, e, 10_000, True, num_threads), _kernel_step(g, u, e, 10_000, True, 2))


def test_bad_arguments() -> None:
    g, u, _ = _data(64, 1)
    with pytest.raises(ValueError, match="momentum must be in"):
        codecs.dgc_velocity(g, u, torch.empty(64), momentum=1.0)
    with pytest.raises(ValueError, match="Nesterov velocity step needs x_out"):
        codecs.dgc_velocity(g, u, torch.empty(64), momentum=0.5, nesterov=True)
    with pytest.raises(ValueError, match="must not overlap grad"):
        codecs.dgc_velocity(g, u, g, momentum=0.5)
    with pytest.raises(ValueError, match="mask_out is for the 'topk' codec only"):
        codecs.encode("int8", g, mask_out=torch.zeros(64))
    with pytest.raises(ValueError, match="mask_out must be grad itself"):
        r = torch.zeros(64)
        codecs.encode("topk", g, residual_in=r, residual_out=r, k=3, mask_out=r)


# ------------------------------------------------------------------------------------ compressor


def test_compressor_is_dgc_over_steps() -> None:
    """TopK bound to a momentum runs dgc_encode step after step (velocity and residual carried), and
    what it sent plus what it still owes is what momentum SGD's updates summed to, except for the
    velocity masked away once delivered."""
    n, k, steps = 20_000, 200, 12
    comp = TopK(ratio=k / n)
    comp.bind_momentum(MU)
    assert comp.spec() == "topk(ratio=0.01,ef=1)" and comp.momentum == MU
    gen = torch.Generator().manual_seed(2)
    u, e = torch.zeros(n), torch.zeros(n)
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        p = comp.compress(g, key="s")
        ref, u, e = dgc_encode(g, u, e, k, MU)
        _same((p, comp.velocity("s"), comp.residual("s")), (ref, u, e))


def test_undo_and_nonfinite_keep_velocity_and_residual() -> None:
    n = 4096
    comp = TopK(ratio=0.01)
    comp.bind_momentum(MU)
    g = torch.randn(n)
    comp.compress(g, key=0)
    u0, e0 = comp.velocity(0).clone(), comp.residual(0).clone()
    comp.compress(2 * g, key=0)
    comp.undo(0)  # the second compress taken back: both buffers as after the first
    assert torch.equal(comp.velocity(0), u0) and torch.equal(comp.residual(0), e0)
    bad = g.clone()
    bad[3] = float("inf")
    assert not comp.compress(bad, key=0).finite
    assert torch.equal(comp.velocity(0), u0) and torch.equal(comp.residual(0), e0)


def test_masking_follows_the_ratio() -> None:
    """mask="auto" masks where ratio < 1 - momentum (Note [Momentum correction for top-k]); True and
    False force it. An unmasked run keeps the sent velocity."""
    cases = [(0.01, "auto", True), (0.25, "auto", False), (0.25, True, True), (0.01, False, False)]
    for ratio, mask, want in cases:
        comp = TopK(ratio=ratio, mask=mask)
        comp.bind_momentum(MU)
        assert comp.masking is want, (ratio, mask)
        g = torch.randn(1000)
        p = comp.compress(g, key=0)
        _, u_ref, _ = dgc_encode(g, torch.zeros(1000), torch.zeros(1000), p.k, MU, mask=want)
        assert torch.equal(comp.velocity(0), u_ref)
    comp = TopK(ratio=0.25)  # set_ratio (a sparsity schedule) resolves "auto" again at each fraction
    comp.bind_momentum(MU)
    assert not comp.masking
    comp.set_ratio(0.01)
    assert comp.topk_ratio == 0.01 and comp.masking
    comp.set_ratio(0.5)
    assert not comp.masking
    unbound = TopK(ratio=0.25)
    unbound.set_ratio(0.01)  # no momentum bound: nothing to mask
    assert not unbound.masking
    with pytest.raises(ValueError, match="ratio"):
        comp.set_ratio(0.0)
    assert TopK(mask=False).spec() == "topk(ratio=0.01,mask=0,ef=1)"
    assert from_spec("topk:0.1:mask=1") == TopK(ratio=0.1, mask=True)
    with pytest.raises(ValueError, match="mask must be"):
        TopK(mask="sometimes")


def test_binding_rules() -> None:
    off = TopK(dgc="off")
    off.bind_momentum(MU)
    assert off.momentum is None
    auto = TopK()
    auto.bind_momentum(0.0)  # plain SGD or Adam: nothing to correct
    assert auto.momentum is None
    with pytest.raises(ValueError, match="needs SGD with momentum"):
        TopK(dgc="on").bind_momentum(0.0)
    with pytest.raises(ValueError, match="needs error_feedback=True"):
        TopK(dgc="on", error_feedback=False)
    with pytest.raises(ValueError, match="dgc must be"):
        TopK(dgc="maybe")
    assert from_spec("topk:0.01:dgc=0") == TopK(ratio=0.01, dgc="off")
    assert from_spec(TopK(dgc="on").spec()) == TopK(dgc="on")


def test_velocity_state_round_trip() -> None:
    comp = TopK(ratio=0.05)
    comp.bind_momentum(MU)
    comp.compress(torch.randn(1000), key=(0, 1))
    saved = comp.velocity_state_dict()
    other = TopK(ratio=0.05)
    other.bind_momentum(MU)
    other.load_velocity_state_dict(saved)
    assert torch.equal(other.velocity((0, 1)), comp.velocity((0, 1)))
    with pytest.raises(ValueError, match="runs no momentum correction"):
        TopK(dgc="off").load_velocity_state_dict(saved)


# ---------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("nesterov", [False, True], ids=["plain", "nesterov"])
def test_cuda_equals_cpu(nesterov: bool) -> None:
    n = 1_000_003
    g, u, e = _data(n, 31)
    for k in (1, n // 100, n // 2):
        cpu = _kernel_step(g, u, e, k, nesterov)
        gpu = _kernel_step(g.cuda(), u.cuda(), e.cuda(), k, nesterov)
        _same(cpu, gpu)
        _same(gpu, dgc_encode(g, u, e, k, MU, nesterov))


def test_the_rule_hands_its_momentum_to_the_workers() -> None:
    """UpdateRule.bind_worker_momentum: SGD momentum moves onto the workers (the owners keep no buffer
    and step with momentum 0); per-group momenta leave dgc="auto" off and make dgc="on" an error."""
    from pyasync.engine.core.rule import UpdateRule

    w = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))]
    rule = UpdateRule(torch.optim.SGD(w, lr=0.1, momentum=MU))
    comp = TopK()
    rule.bind_worker_momentum(comp)
    assert comp.momentum == MU and rule.worker_momentum == MU and rule.state_names() == []
    groups = [{"params": [w[0]], "momentum": 0.9}, {"params": [w[1]], "momentum": 0.5}]
    mixed = torch.optim.SGD(groups, lr=0.1)
    comp = TopK()
    UpdateRule(mixed).bind_worker_momentum(comp)
    assert comp.momentum is None
    with pytest.raises(ValueError, match="one SGD momentum"):
        UpdateRule(mixed).bind_worker_momentum(TopK(dgc="on"))
    adam = UpdateRule(torch.optim.AdamW(w, lr=1e-3))
    comp = TopK()
    adam.bind_worker_momentum(comp)
    assert comp.momentum is None and adam.worker_momentum == 0.0
    with pytest.raises(ValueError, match="needs SGD with momentum"):
        adam.bind_worker_momentum(TopK(dgc="on"))


def test_a_momentum_schedule_reaches_the_velocity_step() -> None:
    """The engine binds the param groups' momentum as a source read at every compress: a scheduler that
    changes it (OneCycleLR's cycle_momentum) changes the workers' velocity step; groups that disagree
    are an error, not a silent mix."""
    from pyasync.engine.core.rule import UpdateRule

    w = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))]
    sgd = torch.optim.SGD([{"params": [w[0]]}, {"params": [w[1]]}], lr=0.1, momentum=MU)
    comp = TopK(ratio=0.5)
    UpdateRule(sgd).bind_worker_momentum(comp)
    g = torch.randn(1000)
    comp.compress(g, key=0)
    u1 = comp.velocity(0).clone()
    for grp in sgd.param_groups:
        grp["momentum"] = 0.5
    comp.compress(g, key=0)
    _, u_ref, _ = dgc_encode(g, u1, comp.residual(0) * 0, 500, 0.5, mask=False)
    assert torch.equal(comp.velocity(0), u_ref)  # 0.5 * u1 + g (ratio 0.5 >= 1 - 0.9: no masking)
    sgd.param_groups[0]["momentum"] = 0.8
    with pytest.raises(ValueError, match="one SGD momentum in every param group"):
        comp.compress(g, key=0)
