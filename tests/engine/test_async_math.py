"""The update math of SSP and ASP, in-process against reference formulas: what a round of pushes means
for SGD and for Adam (Note [A round of pushes] in pyasync/policy.py), the momentum correction (Note
[Momentum correction]) and the delay-adaptive learning rate. The engine-level bounds are in
tests/engine/test_engine_ssp.py; the accuracy they buy is measured in bench/ (docs/benchmarks.md)."""

import pytest
import torch

from pyasync.engine.core.actions import Apply
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import build_layout
from pyasync.engine.p2p.applier import OwnedShard, apply_push
from pyasync.engine.p2p.messages import Push
from pyasync.ops._common import Payload
from pyasync.policy import ASP, SSP, parse_policy

N, WORLD = 64, 4  # one bucket of N * WORLD elements; the shard of rank 0 (N elements)


def _shard(opt: torch.optim.Optimizer, start: torch.Tensor) -> tuple[UpdateRule, OwnedShard]:
    layout = build_layout([[0]], [N * WORLD], [0], WORLD)[0].shards[0]
    rule = UpdateRule(opt)
    policy = ASP()
    return rule, OwnedShard(
        policy.round(WORLD, len(layout.segments), 0), rule.new_state(layout, start.clone())
    )


def _push(g: torch.Tensor, worker: int = 0, clock: int = 0) -> Push:
    return Push(0, worker, clock, 0, Payload("none", N, g.clone()), (True,))


def _torch_step(cls, start: torch.Tensor, grads: list[torch.Tensor], **kw) -> torch.Tensor:
    p = torch.nn.Parameter(start.clone())
    opt = cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_a_round_of_adam_pushes_moves_as_far_as_one_bsp_step(cls):
    """Equal workers, no delay: n pushes of the same gradient (lr / n each) move the shard as one BSP
    step of their mean does; with the gradient scaled by 1/n instead, they moved n times as far."""
    torch.manual_seed(0)
    start, g = torch.randn(N), torch.randn(N)
    kw = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    rule, sh = _shard(cls([torch.zeros(1)], **kw), start)
    for w in range(WORLD):
        apply_push(rule, sh, _push(g, w), WORLD, 1.0)
    bsp = _torch_step(cls, start, [g], **kw)
    torch.testing.assert_close(sh.state.master, bsp, rtol=0, atol=1e-6)
    # The old rule (every push a full Adam step of g / n) moved WORLD times as far.
    old = _torch_step(cls, start, [g / WORLD] * WORLD, **kw)
    torch.testing.assert_close(start - old, WORLD * (start - bsp), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_round_of_sgd_pushes_sums_to_the_mean(momentum):
    """Plain SGD: n pushes of g_i / n move the shard exactly as one step of the mean (no momentum); with
    momentum each push is torch's SGD step on g_i / n."""
    torch.manual_seed(1)
    start, gs = torch.randn(N), [torch.randn(N) for _ in range(WORLD)]
    rule, sh = _shard(torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=momentum), start)
    for w, g in enumerate(gs):
        apply_push(rule, sh, _push(g, w), WORLD, 1.0)
    ref = _torch_step(torch.optim.SGD, start, [g / WORLD for g in gs], lr=0.1, momentum=momentum)
    torch.testing.assert_close(sh.state.master, ref, rtol=1e-6, atol=1e-6)
    if momentum == 0.0:
        mean = _torch_step(torch.optim.SGD, start, [sum(gs) / WORLD], lr=0.1)
        torch.testing.assert_close(sh.state.master, mean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("cls", "shift"), [(torch.optim.SGD, 0.3), (torch.optim.SGD, 0.95), (torch.optim.Adam, 0.3)]
)
def test_momentum_correction_takes_the_implicit_momentum_off_the_explicit(cls, shift):
    """A push applied with implicit momentum ``shift`` is the optimizer's step with momentum (SGD) or
    beta1 (Adam) max(0, beta - shift), the rest of its state carried over."""
    torch.manual_seed(2)
    start, gs = torch.randn(N), [torch.randn(N) for _ in range(3)]
    if cls is torch.optim.SGD:
        kw, ref_kw = {"lr": 0.1, "momentum": 0.9}, {"lr": 0.1, "momentum": max(0.0, 0.9 - shift)}
        grads = [g / WORLD for g in gs]
    else:
        kw = {"lr": 1e-2, "betas": (0.9, 0.999)}
        ref_kw = {"lr": 1e-2 / WORLD, "betas": (max(0.0, 0.9 - shift), 0.999)}
        grads = gs
    rule, sh = _shard(cls([torch.zeros(1)], **kw), start)
    for w, g in enumerate(gs):
        apply_push(rule, sh, _push(g, w), WORLD, 1.0, implicit=shift)
    torch.testing.assert_close(
        sh.state.master, _torch_step(cls, start, grads, **ref_kw), rtol=1e-5, atol=1e-6
    )


def test_the_round_reports_the_implicit_momentum_of_its_running_staleness():
    """Apply.implicit is tau_bar / (tau_bar + 1), tau_bar the running mean (weight 1/64) of the applied
    pushes' staleness; 0 with the correction off (the default)."""
    for policy, on in (
        (parse_policy("asp:mc=on"), True),
        (ASP(), False),
        (SSP(3, momentum_correction=True), True),
    ):
        rnd = policy.round(WORLD, 1)
        stales, mean, got, want = [0, 3, 5, 1, 7, 2, 2, 9], None, [], []
        for i, s in enumerate(stales):
            rnd.version = 100 + i  # the push below was computed s versions ago
            acts = rnd.push(i % WORLD, i // WORLD, 100 + i - s, True, (True,), object())
            got += [a.implicit for a in acts if isinstance(a, Apply)]
            mean = float(s) if mean is None else mean + (s - mean) / 64
            want.append(mean / (mean + 1) if on else 0.0)
        assert got == pytest.approx(want, abs=1e-12), policy


@pytest.mark.parametrize(("stale", "want"), [(0, 1.0), (3, 1.0), (4, 1.0), (8, 0.5), (16, 0.25)])
def test_delay_adaptive_lr_keeps_a_full_step_up_to_n_and_shrinks_beyond(stale, want):
    assert parse_policy("asp:delay").lr_factor(stale, WORLD) == pytest.approx(want)
    assert parse_policy("ssp:2:delay").lr_factor(stale, WORLD) == pytest.approx(want)
    assert parse_policy("asp:inverse").lr_factor(stale, WORLD) == pytest.approx(1.0 / max(1, stale))


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("asp", ASP()),
        ("asp:unanswered=2", ASP(max_unanswered=2)),
        ("asp:unanswered=0:mc=on", ASP(max_unanswered=0, momentum_correction=True)),
        ("asp:unanswered=inf", ASP()),
        ("asp:moments=round", ASP(round_moments=True)),
        ("asp:delay", ASP(lr_scale="delay")),
        ("ssp:1:mc=on:moments=round", SSP(1, momentum_correction=True, round_moments=True)),
        ("ssp:2:delay", SSP(2, lr_scale="delay")),
    ],
)
def test_policy_options_round_trip(spec, want):
    assert parse_policy(spec) == want
    assert parse_policy(want.spec()) == want


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("asp:unanswered=-1", "max_unanswered"),
        ("asp:mc=maybe", "mc must be"),
        ("ssp:1:moments=step", "moments must be"),
        ("ssp:1:unanswered=1", "unknown option"),
        ("asp:fast", "lr_scale"),
        ("bsp:mc=off", "no key=value"),
    ],
)
def test_bad_policy_options_say_what_is_allowed(spec, says):
    with pytest.raises(ValueError, match=says):
        parse_policy(spec)


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_moments_per_round_sgd_is_the_rooted_momentum_with_scaled_gradient(wd):
    """round_moments: a push is torch's SGD step with momentum beta^(1/n) on (g / n) * f, weight decay
    x f / n, f = (1 - beta^(1/n)) / (1 - beta)."""
    torch.manual_seed(3)
    start, gs = torch.randn(N), [torch.randn(N) for _ in range(5)]
    beta = 0.9
    mu = beta ** (1 / WORLD)
    f = (1 - mu) / (1 - beta)
    rule, sh = _shard(torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=beta, weight_decay=wd), start)
    for w, g in enumerate(gs):
        apply_push(rule, sh, _push(g, w % WORLD), WORLD, 1.0, per_round=True)
    ref = _torch_step(
        torch.optim.SGD, start, [g * f / WORLD for g in gs], lr=0.1, momentum=mu, weight_decay=wd * f / WORLD
    )
    torch.testing.assert_close(sh.state.master, ref, rtol=1e-5, atol=1e-6)


def test_moments_per_round_adam_roots_the_betas():
    torch.manual_seed(4)
    start, gs = torch.randn(N), [torch.randn(N) for _ in range(5)]
    rule, sh = _shard(
        torch.optim.AdamW([torch.zeros(1)], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1), start
    )
    for w, g in enumerate(gs):
        apply_push(rule, sh, _push(g, w % WORLD), WORLD, 1.0, per_round=True)
    betas = (0.9 ** (1 / WORLD), 0.99 ** (1 / WORLD))
    ref = _torch_step(torch.optim.AdamW, start, gs, lr=1e-2 / WORLD, betas=betas, weight_decay=0.1)
    torch.testing.assert_close(sh.state.master, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_rounds_of_pushes_follow_bsp_with_equal_workers_and_no_delay(cls):
    """Equal workers, no delay, moments per round: R rounds of n pushes of the round's gradient end
    within 5% of R BSP steps (per push, SGD's momentum forgot 4x sooner and Adam moved n x as far)."""
    torch.manual_seed(5)
    start = torch.randn(N)
    rounds = [torch.randn(N) * (1 + 0.1 * r) for r in range(40)]
    kw = {"lr": 0.05, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 1e-2, "betas": (0.9, 0.999)}
    rule, sh = _shard(cls([torch.zeros(1)], **kw), start)
    for r, g in enumerate(rounds):
        for w in range(WORLD):
            apply_push(rule, sh, _push(g, w, r), WORLD, 1.0, per_round=True)
    bsp = _torch_step(cls, start, rounds, **kw)
    moved, want = sh.state.master - start, bsp - start
    assert float((moved - want).norm() / want.norm()) < 0.05


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_delay_compensation_reaches_the_fused_kernels(cls):
    """A push with dc = (lambda, held) is the optimizer's step on g + lambda * g * g * (w - held), g the
    push's gradient as the step uses it (x 1/n for SGD)."""
    torch.manual_seed(6)
    start, g, held = torch.randn(N), torch.randn(N), torch.randn(N)
    kw = {"lr": 0.1, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 1e-2, "weight_decay": 0.01}
    rule, sh = _shard(cls([torch.zeros(1)], **kw), start)
    apply_push(rule, sh, _push(g), WORLD, 1.0, dc=(0.5, held))
    gs = g / WORLD if cls is torch.optim.SGD else g
    ref_kw = dict(kw, lr=kw["lr"] / WORLD) if cls is not torch.optim.SGD else kw
    ref = _torch_step(cls, start, [gs + 0.5 * gs * gs * (start - held)], **ref_kw)
    torch.testing.assert_close(sh.state.master, ref, rtol=1e-5, atol=1e-6)


def test_replies_keep_what_each_worker_holds_for_delay_compensation():
    """With exact replies and track=True (a policy with dc > 0) the owner keeps, per worker, the values
    it last answered with; without it, nothing is kept."""
    from pyasync.engine.core.replies import ReplyFrames

    master = torch.randn(N)
    kw = {"rank": 0, "world_size": 1, "transport": None, "compressor": None, "timeout": None}
    kept = ReplyFrames(masters={0: master}, track=True, **kw)
    assert torch.equal(kept.held[(0, 0)], master)  # at first: the agreed parameters
    master.add_(1.0)
    out = kept.local(0, 1, master, final=False)
    assert torch.equal(out, master) and torch.equal(kept.held[(0, 0)], master)
    assert kept.held[(0, 0)].data_ptr() != master.data_ptr()
    assert ReplyFrames(masters={0: master}, **kw).held == {}
