"""The update math of SSP and ASP, in-process against reference formulas: what a round of pushes means
for SGD and for Adam (Note [A round of pushes] in pyasync/policy.py), the momentum correction (Note
[Momentum correction]) and the delay-adaptive learning rate. The engine-level bounds are in
tests/engine/test_engine_ssp.py; the accuracy they buy is measured in bench/ (docs/benchmarks.md)."""

import pytest
import torch

from pyasync.engine.core.actions import Answer, Apply
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import build_layout
from pyasync.engine.p2p.applier import OwnedShard, apply_push, spike_clip
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
        ("asp", ASP(max_unanswered=0, patience="auto", lookahead="auto", round_moments=True, clip="auto")),
        ("asp:unanswered=2", ASP(max_unanswered=2)),
        ("asp:unanswered=0:mc=on", ASP(momentum_correction=True)),
        ("asp:unanswered=inf:patience=0.25", ASP(max_unanswered=None, patience=0.25)),
        ("asp:patience=inf", ASP(patience=float("inf"))),
        ("asp:moments=push", ASP(round_moments=False)),
        ("asp:delay", ASP(lr_scale="delay")),
        ("ssp:1:mc=on:moments=push", SSP(1, momentum_correction=True, round_moments=False)),
        ("ssp:2:delay", SSP(2, lr_scale="delay")),
        ("asp:lookahead=auto:clip=1.5", ASP(lookahead="auto", clip=1.5)),
        ("ssp:3:lookahead=2", SSP(3, lookahead=2)),
        ("asp:lookahead=stale", ASP(lookahead="stale")),
        ("ssp:3", SSP(3, lookahead="auto", round_moments=True, clip="auto")),
        ("ssp:1:clip=off", SSP(1, clip=0.0)),
        ("ssp:1:clip=2", SSP(1, clip=2.0)),
        ("asp:lookahead=off:clip=off:moments=push", ASP(lookahead=0, clip=0.0, round_moments=False)),
    ],
)
def test_policy_options_round_trip(spec, want):
    assert parse_policy(spec) == want
    assert parse_policy(want.spec()) == want


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("asp:unanswered=-1", "max_unanswered"),
        ("asp:patience=-1", "patience must be"),
        ("asp:patience=soon", "could not convert"),
        ("ssp:1:patience=1", "unknown option"),
        ("asp:mc=maybe", "mc must be"),
        ("ssp:1:moments=step", "moments must be"),
        ("ssp:1:unanswered=1", "unknown option"),
        ("asp:fast", "lr_scale"),
        ("bsp:mc=off", "no key=value"),
        ("asp:lookahead=-2", "lookahead must be"),
        ("asp:lookahead=soon", "invalid literal"),
        ("ssp:1:lookahead=none", "invalid literal"),
        ("ssp:1:clip=0.5", "clip must be"),
        ("ssp:1:clip=nan", "clip must be"),
        ("ssp:1:clip=sometimes", "could not convert"),
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


# -- Note [Look-ahead replies] and Note [Spike clipping] ----------------------------------------------
def _zero_grad_steps(cls, p0: torch.Tensor, grads: list[torch.Tensor], k: int, **kw) -> torch.Tensor:
    """torch's optimizer after ``grads``, then ``k`` more steps with zero gradients (and a zero weight
    decay): where the momentum alone carries the parameters."""
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    for _ in range(k):
        p.grad = torch.zeros_like(p)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("k", [1, 3, 6])
def test_sgd_lookahead_is_where_k_zero_gradient_steps_take_the_master(k):
    """SGD: w - lr * (mu + ... + mu^k) * buf, exactly torch's SGD after k steps with zero gradients."""
    torch.manual_seed(0)
    start, grads = torch.randn(N), [torch.randn(N) for _ in range(5)]
    kw = {"lr": 0.05, "momentum": 0.9}
    rule, sh = _shard(torch.optim.SGD([torch.zeros(1)], **kw), start)
    for i, g in enumerate(grads):  # each push applies g / n: feed torch the same g / n
        apply_push(rule, sh, _push(g, i % WORLD, i // WORLD), WORLD, 1.0)
    master = sh.state.master.clone()
    got = rule.lookahead(sh.state, k, WORLD)
    want = _zero_grad_steps(torch.optim.SGD, start, [g / WORLD for g in grads], k, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(sh.state.master, master)  # the master is not touched
    torch.testing.assert_close(rule.lookahead(sh.state, 0, WORLD), master, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_lookahead_follows_the_reference_formula(cls):
    """Adam/AdamW: w - lr/n * (b1 + ... + b1^k) * m_hat / (sqrt(v_hat) + eps)."""
    torch.manual_seed(1)
    start = torch.randn(N)
    lr, b1, b2, eps, k = 1e-2, 0.9, 0.999, 1e-8, 4
    rule, sh = _shard(cls([torch.zeros(1)], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0), start)
    for i in range(6):
        apply_push(rule, sh, _push(torch.randn(N), i % WORLD, i // WORLD), WORLD, 1.0)
    st, t = sh.state, sh.state.steps[0]
    m_hat, v_hat = st.state1 / (1 - b1**t), st.state2 / (1 - b2**t)
    reach = sum(b1**j for j in range(1, k + 1))
    want = st.master - lr / WORLD * reach * m_hat / (v_hat.sqrt() + eps)
    torch.testing.assert_close(rule.lookahead(st, k, WORLD), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [1, 3])
def test_sgd_lookahead_follows_moments_per_round(k):
    """With moments=round each push's momentum is mu^(1/n): the look-ahead of round_of=n is where k
    zero-gradient pushes of that kind take the master (applied to a copy of the shard)."""
    torch.manual_seed(3)
    start = torch.randn(N)
    opt = torch.optim.SGD([torch.zeros(1)], lr=0.05, momentum=0.9)
    rule, sh = _shard(opt, start)
    for i in range(6):
        apply_push(rule, sh, _push(torch.randn(N), i % WORLD, i // WORLD), WORLD, 1.0, per_round=True)
    got = rule.lookahead(sh.state, k, WORLD, round_of=WORLD)
    _, twin = _shard(opt, sh.state.master.clone())
    twin.state.state1.copy_(sh.state.state1)
    twin.state.steps[:] = sh.state.steps
    for j in range(k):
        apply_push(rule, twin, _push(torch.zeros(N), j % WORLD, 9), WORLD, 1.0, per_round=True)
    torch.testing.assert_close(got, twin.state.master, rtol=0, atol=1e-6)
    assert not torch.allclose(got, rule.lookahead(sh.state, k, WORLD))  # mu^(1/n), not mu


def test_lookahead_floor_is_a_share_of_the_momentums_memory():
    """Under "auto" the look-ahead spans at least LOOKAHEAD_MEMORY / (1 - mu) updates, mu per update."""
    from pyasync.engine.core.rule import lookahead_floor
    from pyasync.policy import LOOKAHEAD_MEMORY

    assert LOOKAHEAD_MEMORY == 0.5
    assert lookahead_floor(0.9, 0.5) == 5
    assert lookahead_floor(0.9 ** (1 / 4), 0.5) == 20  # momentum 0.9 per round of 4 pushes
    assert lookahead_floor(0.5, 0.5) == 1
    assert lookahead_floor(0.0, 0.5) == 0 and lookahead_floor(0.9, 0.0) == 0


@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9 ** (1 / 4), 0.999, 1.0])
def test_lookahead_reach_is_the_sum_of_the_momentums_powers(mu):
    from pyasync.engine.core.rule import _reach

    for k in (0, 1, 7, 20, 3000):
        assert _reach(mu, k) == pytest.approx(sum(mu**j for j in range(1, k + 1)), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("k", [0, 3, 30])
def test_lookahead_with_a_memory_floor_spans_the_longer_of_k_and_the_floor(k):
    torch.manual_seed(4)
    opt = torch.optim.SGD([torch.zeros(1)], lr=0.05, momentum=0.9)
    rule, sh = _shard(opt, torch.randn(N))
    for i in range(6):
        apply_push(rule, sh, _push(torch.randn(N), i % WORLD, i // WORLD), WORLD, 1.0, per_round=True)
    floor = 20  # 0.5 / (1 - 0.9 ** (1 / 4)) rounded up
    got = rule.lookahead(sh.state, k, WORLD, round_of=WORLD, memory=0.5)
    want = rule.lookahead(sh.state, max(k, floor), WORLD, round_of=WORLD)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_only_asp_under_auto_has_a_lookahead_floor():
    """Measured: the floor helps ASP and hurts SSP (docs/benchmarks.md, "A longer look-ahead")."""
    assert ASP().lookahead_memory == 0.5
    assert ASP(lookahead="stale").lookahead_memory == 0.0 and ASP(lookahead=3).lookahead_memory == 0.0
    assert SSP(1).lookahead_memory == 0.0 and SSP(1, lookahead="stale").lookahead_memory == 0.0


def test_lookahead_without_momentum_state_is_the_master():
    torch.manual_seed(2)
    rule, sh = _shard(torch.optim.SGD([torch.zeros(1)], lr=0.1), torch.randn(N))
    apply_push(rule, sh, _push(torch.randn(N)), WORLD, 1.0)
    assert torch.equal(rule.lookahead(sh.state, 5, WORLD), sh.state.master)


def test_the_round_looks_ahead_by_each_workers_running_staleness():
    """Answer.ahead: per dest, k under a fixed look-ahead; under "auto" and "stale" the rounded running
    mean (weight 1/8) of that worker's pushes' staleness, this push's included (ASP's owner stretches
    it to its floor under "auto"); nothing when off and nothing on the final answer."""
    for la in ("auto", "stale"):
        _check_running_staleness(ASP(lookahead=la).round(WORLD, 1))


def _check_running_staleness(rnd):
    mean: dict[int, float] = {}
    for i, (w, s) in enumerate([(0, 3), (1, 0), (0, 9), (1, 2), (0, 5), (2, 6)]):
        clock = sum(1 for x, _ in [(0, 3), (1, 0), (0, 9), (1, 2), (0, 5), (2, 6)][:i] if x == w)
        rnd.version = 50 + i
        acts = rnd.push(w, clock, 50 + i - s, True, (True,), object())
        mean[w] = float(s) if w not in mean else mean[w] + (s - mean[w]) / 8
        (ans,) = [a for a in acts if isinstance(a, Answer)]
        assert ans.dests == ((w, clock),) and ans.ahead == (round(mean[w]),)
    fixed = SSP(0, lookahead=2).round(WORLD, 1)
    for w in range(WORLD):
        acts = fixed.push(w, 0, 0, True, (True,), object())
    (ans,) = [a for a in acts if isinstance(a, Answer)]
    assert len(ans.dests) == WORLD and ans.ahead == (2,) * WORLD
    plain = ASP(lookahead=0).round(WORLD, 1)
    (ans,) = [a for a in plain.push(0, 0, 0, True, (True,), object()) if isinstance(a, Answer)]
    assert ans.ahead == ()
    for w in range(WORLD):
        out = rnd.close(w)
    assert [a.ahead for a in out if isinstance(a, Answer) and a.final] == [()]


def test_spike_clipping_scales_outliers_down_to_c_times_the_running_norm():
    """The first push sets the running norm; a push within c x it is untouched; an outlier is scaled to
    c x it; the running norm moves by 1/32 of the clipped norm's difference."""
    torch.manual_seed(3)
    _, sh = _shard(torch.optim.SGD([torch.zeros(1)], lr=0.1), torch.randn(N))
    g = torch.randn(N)
    g = g / g.norm()  # norm 1
    assert spike_clip(sh, _push(2.0 * g).payload, 1.5) == 1.0 and sh.norm == pytest.approx(2.0)
    assert spike_clip(sh, _push(2.5 * g).payload, 1.5) == 1.0
    ref = 2.0 + (2.5 - 2.0) / 32
    assert sh.norm == pytest.approx(ref)
    f = spike_clip(sh, _push(30.0 * g).payload, 1.5)
    assert f == pytest.approx(1.5 * ref / 30.0)
    assert sh.norm == pytest.approx(ref + (1.5 * ref - ref) / 32)
    # A coded push is measured on what it decodes to.
    code = Payload("int8", N, torch.full((N,), 127, dtype=torch.int8), torch.tensor([10.0 / 127]), block=N)
    before = sh.norm
    f = spike_clip(sh, code, 1.5)
    assert f == pytest.approx(1.5 * before / (10.0 * N**0.5), rel=1e-5)
    # A push without gradient on the shard leaves the running norm alone (a zero would pull it down and
    # clip the next real push).
    before = sh.norm
    assert spike_clip(sh, _push(torch.zeros(N)).payload, 1.5) == 1.0 and sh.norm == before
    fresh = _shard(torch.optim.SGD([torch.zeros(1)], lr=0.1), torch.randn(N))[1]
    assert spike_clip(fresh, _push(torch.zeros(N)).payload, 1.5) == 1.0 and fresh.norm is None


def test_clip_reaches_the_applied_update():
    """With clip, an outlier push moves the shard as far as a push of c x the running norm would."""
    torch.manual_seed(4)
    g = torch.randn(N)
    g = g / g.norm()
    start = torch.randn(N)
    rule, sh = _shard(torch.optim.SGD([torch.zeros(1)], lr=0.1), start)
    apply_push(rule, sh, _push(g), WORLD, 1.0, clip=2.0)
    before = sh.state.master.clone()
    apply_push(rule, sh, _push(100.0 * g, 1), WORLD, 1.0, clip=2.0)
    torch.testing.assert_close(before - sh.state.master, 0.1 * 2.0 * g / WORLD, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_auto_clip_acts_where_the_optimizer_keeps_moments(momentum):
    """clip="auto" (the default) clips an outlier at AUTO_CLIP x the running norm under SGD with momentum
    (and Adam), and leaves plain SGD's unbiased sum alone (Note [Spike clipping])."""
    from pyasync.policy import AUTO_CLIP

    torch.manual_seed(5)
    g = torch.randn(N)
    g = g / g.norm()
    rule, sh = _shard(torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=momentum), torch.randn(N))
    apply_push(rule, sh, _push(g), WORLD, 1.0, clip="auto")
    auto = sh.state.master.clone()
    rule2, sh2 = _shard(torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=momentum), sh.state.master.clone())
    if sh.state.state1 is not None:
        sh2.state.state1.copy_(sh.state.state1)
        sh2.state.steps[:] = sh.state.steps
    apply_push(rule, sh, _push(100.0 * g, 1), WORLD, 1.0, clip="auto")
    want = AUTO_CLIP if momentum else 100.0
    apply_push(rule2, sh2, _push(want * g, 1), WORLD, 1.0, clip=0.0)
    assert not torch.equal(auto, sh.state.master)
    torch.testing.assert_close(sh.state.master, sh2.state.master, rtol=1e-5, atol=1e-6)


# -- Note [Gap-aware penalty] --------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_the_gap_aware_penalty_matches_its_formula(cls):
    """Each push's gradient (as the step uses it) divided by max(1, |w - held| / C) per element, C the
    running mean (decay GAP_BETA) of each element's |change| per update, from GAP_WARMUP updates on;
    then the optimizer's step. Against torch's optimizer on the penalized gradients."""
    from pyasync.engine.core.rule import GAP_BETA, GAP_WARMUP

    torch.manual_seed(7)
    start = torch.randn(N)
    kw = {"lr": 0.1, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 1e-2, "weight_decay": 0.01}
    rule, sh = _shard(cls([torch.zeros(1)], **kw), start)
    rule.bind_gap(True)
    sh.state.gap_step = torch.zeros(N)  # what init_state allocates under bind_gap
    ref_p = torch.nn.Parameter(start.clone())
    ref_kw = dict(kw, lr=kw["lr"] / WORLD) if cls is not torch.optim.SGD else kw
    ref_opt = cls([ref_p], **ref_kw)
    c = torch.zeros(N)
    penalized = 0
    for t in range(GAP_WARMUP + 8):
        g = torch.randn(N)
        held = ref_p.detach() + 0.05 * torch.randn(N)  # what the pusher was answered with
        apply_push(rule, sh, _push(g, t % WORLD), WORLD, 1.0, gap_held=held)
        gs = g / WORLD if cls is torch.optim.SGD else g.clone()
        if t >= GAP_WARMUP:
            pen = ((ref_p.detach() - held).abs() / c.clamp_min(1e-12)).clamp_min(1.0)
            penalized += int((pen > 1).sum())
            gs = gs / pen
        before = ref_p.detach().clone()
        ref_p.grad = gs
        ref_opt.step()
        c = GAP_BETA * c + (1 - GAP_BETA) * (ref_p.detach() - before).abs()
        torch.testing.assert_close(sh.state.master, ref_p.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sh.state.gap_step, c, rtol=1e-5, atol=1e-8)
    assert penalized > N  # the penalty acted, on many elements
    assert sh.state.gap_updates == GAP_WARMUP + 8


def test_the_gap_aware_penalty_is_state_and_needs_a_fused_rule():
    """gap_step is one more state tensor (checkpointed, re-split by name); a push without held values
    is applied unpenalized but still counted into C; a generic optimizer is refused with a clear error."""
    from pyasync.engine.core.rule import GAP_BETA

    torch.manual_seed(8)
    start = torch.randn(N)
    opt = torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=0.9)
    rule = UpdateRule(opt)
    rule.bind_gap(True)
    assert rule.state_names() == ["state1", "gap_step"]
    layout = build_layout([[0]], [N * WORLD], [0], WORLD)[0].shards[0]
    s = rule.new_state(layout, start.clone())
    assert s.gap_step is not None and not s.gap_step.any()
    rule.apply(s, dense=torch.randn(N), seg_mask=[True])  # no gap_held: an ordinary update
    assert s.gap_updates == 1
    torch.testing.assert_close(s.gap_step, (1 - GAP_BETA) * (s.master - start).abs())
    saved = {k: v.clone() for k, v in rule.state_tensors(s).items()}
    assert "gap_step" in saved
    fresh = rule.new_state(layout, start.clone())
    rule.load_state_tensors(fresh, saved, "test")
    assert torch.equal(fresh.gap_step, s.gap_step) and torch.equal(fresh.state1, s.state1)
    assert "gap_step" not in UpdateRule(opt).state_names()  # off: no state
    with pytest.raises(ValueError, match="gap=on.*SGD, Adam or AdamW"):
        UpdateRule(torch.optim.RMSprop([torch.zeros(1)], lr=0.1)).bind_gap(True)


def test_gap_parses_and_takes_the_lookahead_to_the_staleness():
    p = parse_policy("asp:gap=on")
    assert p == ASP(gap=True) and p.spec() == "asp:gap=on" and parse_policy(p.spec()) == p
    assert p.lookahead_memory == 0.0 and ASP().lookahead_memory > 0  # "auto" is the staleness alone
    assert parse_policy("ssp:2:gap=on") == SSP(2, gap=True)
    assert parse_policy("asp:gap=off") == ASP()
    with pytest.raises(ValueError, match="gap must be 'on' or 'off'"):
        parse_policy("asp:gap=yes")
    with pytest.raises(ValueError, match="gap must be True or False"):
        ASP(gap=1)
