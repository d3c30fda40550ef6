"""BSP equals DDP: same seed, same data split, same model, over 20 steps (gloo, CPU, 3 ranks)."""

import copy
import datetime

import pytest
import torch
from _dist import multiproc, run_workers

pytestmark = multiproc
STEPS = 20


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))


def _optim(kind: str, model: torch.nn.Module, own_group: bool) -> torch.optim.Optimizer:
    first, rest = list(model[0].parameters()), list(model[2].parameters())
    groups = (
        [{"params": first, "lr": 0.03, "weight_decay": 0.01}, {"params": rest}]
        if own_group
        else [{"params": first + rest}]
    )
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-3)
    if kind == "plain":
        return torch.optim.SGD(groups, lr=0.1)
    if kind == "nesterov":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.8, nesterov=True)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=1e-2, weight_decay=0.01)
    if kind == "rmsprop":  # the generic path: a private torch optimizer per shard
        return torch.optim.RMSprop(groups, lr=1e-2, momentum=0.5)
    raise ValueError(kind)


def _bsp_vs_ddp(rank, world, kinds, with_scheduler):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pyasync

    out = {}
    variants = [(k, own, False, "bsp") for k in kinds for own in (False, True)]
    if with_scheduler:
        variants += [(kinds[0], own, True, "bsp") for own in (False, True)]
    else:
        # Quorum(n) equals BSP; SSP(0) equals BSP for plain SGD (n separate updates of g_w / n).
        variants += [("adamw", True, False, f"quorum:{world}"), ("plain", False, False, "ssp:0")]
    for kind, own_group, scheduler, policy in variants:
        model = _model(seed=rank)  # different on every rank: both sides broadcast rank 0's
        ref = DDP(copy.deepcopy(model))
        opt = pyasync.DistributedOptimizer(
            _optim(kind, model, own_group),
            policy=policy,
            bucket_cap_mb=1e-4,
            timeout=datetime.timedelta(seconds=30),
        )
        ref_opt = _optim(kind, ref.module, own_group)
        scheds = []
        if scheduler:
            scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (opt, ref_opt)]
        g = torch.Generator().manual_seed(1000 + rank)
        worst = 0.0
        for _ in range(STEPS):
            x = torch.randn(16, 6, generator=g)
            y = torch.randn(16, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            for s in scheds:
                s.step()
            worst = max(
                worst,
                max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.module.parameters())),
            )
        moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), _model(0).parameters()))
        st = opt.stats()
        opt.close()
        out[(kind, own_group, scheduler, policy)] = (
            worst,
            moved,
            st.clock,
            st.min_included_clock,
            dict(st.staleness),
            opt.param_groups[0]["lr"],
        )
    return out


@pytest.mark.parametrize(
    "kinds, with_scheduler",
    [(("sgd", "adamw"), True), (("nesterov", "adam", "rmsprop"), False)],
    ids=["sgd-adamw-steplr", "nesterov-adam-rmsprop-quorum-ssp0"],
)
def test_bsp_equals_ddp(kinds, with_scheduler):
    """With and without a param group of its own lr (and weight decay), and with a StepLR scheduler
    driving the shared param_groups."""
    res = run_workers(_bsp_vs_ddp, 3, args=(kinds, with_scheduler), timeout=150)
    for r in res:
        assert len(r) == 2 * len(kinds) + 2
        for (kind, own, sched, policy), (worst, moved, clock, mic, stale, lr) in r.items():
            what = f"{policy} {kind} own_group={own} scheduler={sched}"
            assert moved > 1e-2, f"{what}: the model did not train"
            assert worst < 2e-5, f"{what}: BSP differs from DDP by {worst}"
            assert clock == STEPS and mic == STEPS - 1
            if policy != "ssp:0":
                assert set(stale) == {0}  # BSP never applies a stale gradient
            if sched:
                base = 0.03 if own else {"sgd": 0.1, "adamw": 1e-2}[kind]
                assert lr == pytest.approx(base * 0.5 ** (STEPS // 5))
