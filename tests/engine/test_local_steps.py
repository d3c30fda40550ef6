"""Local steps (policy "local:H", Note [Local steps] in pyasync/local.py) on real processes over loopback:
the synchronous outer step is DiLoCo (each worker's inner optimizer on its own replica, Nesterov SGD on
the mean change), checked against a single-process reference; the quorum and asynchronous modes train
to the same optimum with equal replicas; gradients, GradScaler and clipping act on the inner steps; and
what is not supported says so. The delayed Nesterov math itself: tests/kernels/test_apply_outer.py."""

import datetime
import time

import pytest
import torch

import pyasync
from tests._dist import multiproc, run_workers

pytestmark = multiproc

DIM, H, T = 24, 4, 32  # parameters, local steps per outer step, inner steps per worker
TARGET = torch.linspace(-1.0, 1.0, DIM)


def _data(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s batch of step ``t``: a least-squares problem whose optimum is TARGET."""
    g = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(8, DIM, generator=g)
    return x, x @ TARGET


def _loss(w: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    x, y = _data(rank, t)
    return ((x @ w - y) ** 2).mean()


def _inner(params, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.01, momentum=0.5)


def _train(rank: int, world: int, policy: str, kind: str, steps: int = T, **kw) -> dict:
    w = torch.nn.Parameter(torch.zeros(DIM))
    opt = pyasync.DistributedOptimizer(
        _inner([w], kind), policy=policy, timeout=datetime.timedelta(seconds=60), **kw
    )
    outer = []  # the values right after each outer step
    for t in range(steps):
        opt.zero_grad()
        _loss(w, rank, t).backward()
        before = w.grad.clone()
        opt.step()
        assert torch.equal(w.grad, before), "the user's gradient must be left as backward() made it"
        if (t + 1) % H == 0:
            outer.append(w.detach().clone())
    clock = opt.engine.clock
    opt.close()
    return {"w": w.detach().clone(), "clock": clock, "sent": opt.stats().pushes_sent, "outer": outer}


OUTER_LR, OUTER_MU = pyasync.Local(H).outer_lr, pyasync.Local(H).outer_momentum  # 0.5, 0.8


def _diloco(world: int, kind: str, outer_lr: float = OUTER_LR, mu: float = OUTER_MU) -> torch.Tensor:
    """DiLoCo in one process: each worker's inner optimizer (its own state) for H steps from the global
    values, then one Nesterov SGD step on the mean change."""
    glob = torch.nn.Parameter(torch.zeros(DIM))
    outer = torch.optim.SGD([glob], lr=outer_lr, momentum=mu, nesterov=mu > 0)
    reps = [torch.nn.Parameter(torch.zeros(DIM)) for _ in range(world)]
    inners = [_inner([r], kind) for r in reps]
    for t0 in range(0, T, H):
        for r in reps:
            r.data.copy_(glob.data)
        for w, (r, inner) in enumerate(zip(reps, inners)):
            for t in range(t0, t0 + H):
                inner.zero_grad()
                _loss(r, w, t).backward()
                inner.step()
        glob.grad = sum(glob.data - r.data for r in reps) / world
        outer.step()
    return glob.detach()


@pytest.mark.parametrize(("policy", "extra"), [("local:4", {}), ("local:4", {"elastic": True})])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_synchronous_local_steps_are_diloco(policy, extra, kind):
    """local:H on 3 workers (BSP on collectives, and point-to-point with elastic=True) ends where
    single-process DiLoCo does, every replica equal, with one push per H steps."""
    world = 3
    res = run_workers(_train_kw, world, args=(policy, kind, extra), timeout=120)
    ref = _diloco(world, kind)
    for r in res:
        assert r["clock"] == T // H
        assert torch.equal(r["w"], res[0]["w"]), "replicas differ"
    torch.testing.assert_close(res[0]["w"], ref, rtol=1e-5, atol=1e-5)
    # it trained (outer Nesterov swings on so small a problem: closer, not close)
    assert (res[0]["w"] - TARGET).norm() < 0.75 * TARGET.norm()  # measured: sgd 0.49, adamw 0.62


def _train_kw(rank: int, world: int, policy: str, kind: str, extra: dict) -> dict:
    return _train(rank, world, policy, kind, **extra)


@pytest.mark.parametrize(
    ("policy", "codec"),
    [("local:4:quorum:3", None), ("local:4:async", None), ("local:4", "int8"), ("local:4:async", "int8")],
)
def test_quorum_asynchronous_and_compressed_local_steps_train_to_equal_replicas(policy, codec):
    """local:H:quorum:K and local:H:async on 4 workers, and the changes int8-coded with error feedback
    both ways: one push per H steps, equal replicas after close(), and the model trained (the async
    outer step is the delayed Nesterov one)."""
    steps = 96  # 24 outer steps: synchronous DiLoCo ends at 0.05 of the start's distance here
    extra = {"steps": steps, "compression": codec}
    res = run_workers(_train_kw, 4, args=(policy, "sgd", extra), timeout=120)
    for r in res:
        assert r["clock"] == steps // H
        assert torch.equal(r["w"], res[0]["w"]), "replicas differ"
        if policy == "local:4":  # synchronous: every worker installs the same values at each outer step
            assert all(torch.equal(a, b) for a, b in zip(r["outer"], res[0]["outer"], strict=True))
        assert torch.isfinite(r["w"]).all()
    assert (res[0]["w"] - TARGET).norm() < 0.3 * TARGET.norm()  # measured with 0.7 and 0.9: async 0.18


def _amp(rank: int, world: int, mode: str) -> dict:
    """local:2 with inner SGD for 8 steps. "scaler": through a GradScaler (a power of two: exact);
    "scaler-inf": the same with rank 1's gradient at step 3 made inf; "clip": max_grad_norm=0.5."""
    w = torch.nn.Parameter(torch.zeros(DIM))
    kw = {"max_grad_norm": 0.5} if mode == "clip" else {}
    opt = pyasync.DistributedOptimizer(
        _inner([w], "sgd"), policy="local:2", timeout=datetime.timedelta(seconds=60), **kw
    )
    scaler = None
    if mode.startswith("scaler"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    for t in range(8):
        opt.zero_grad()
        loss = _loss(w, rank, t)
        if scaler is None:
            loss.backward()
            opt.step()
            continue
        scaler.scale(loss).backward()
        if mode == "scaler-inf" and rank == 1 and t == 3:
            w.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
    clock = opt.engine.clock
    opt.close()
    return {"w": w.detach().clone(), "clock": clock, "inner": opt.local_steps.inner_steps}


def _local_reference(world: int, steps: int, h: int, clip=None) -> torch.Tensor:
    """local:h in one process with inner SGD; ``clip``: clip_grad_norm_ before each inner step."""
    glob = torch.nn.Parameter(torch.zeros(DIM))
    outer = torch.optim.SGD([glob], lr=OUTER_LR, momentum=OUTER_MU, nesterov=True)
    reps = [torch.nn.Parameter(torch.zeros(DIM)) for _ in range(world)]
    inners = [_inner([r], "sgd") for r in reps]
    for t0 in range(0, steps, h):
        for w, (r, inner) in enumerate(zip(reps, inners)):
            r.data.copy_(glob.data)
            for t in range(t0, t0 + h):
                inner.zero_grad()
                _loss(r, w, t).backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_([r], clip)
                inner.step()
        glob.grad = sum(glob.data - r.data for r in reps) / world
        outer.step()
    return glob.detach()


def test_grad_scaler_and_clipping_act_on_the_inner_steps():
    """A GradScaler's scale is divided out before each inner step (a power of two: bit-identical to no
    scaler); a step where it found an inf is skipped, not counted, and nothing non-finite reaches
    the model; max_grad_norm clips each inner step's gradient on the worker."""
    plain = run_workers(_amp, 2, args=("plain",), timeout=120)
    scaled = run_workers(_amp, 2, args=("scaler",), timeout=120)
    torch.testing.assert_close(plain[0]["w"], _local_reference(2, 8, 2), rtol=1e-5, atol=1e-6)
    for a, b in zip(plain, scaled):
        assert torch.equal(a["w"], b["w"])
    inf = run_workers(_amp, 2, args=("scaler-inf",), timeout=120)
    assert [r["inner"] for r in inf] == [8, 7]
    assert [r["clock"] for r in inf] == [4, 3]
    assert torch.equal(inf[0]["w"], inf[1]["w"]) and torch.isfinite(inf[0]["w"]).all()
    clipped = run_workers(_amp, 2, args=("clip",), timeout=120)
    torch.testing.assert_close(clipped[0]["w"], _local_reference(2, 8, 2, clip=0.5), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(clipped[0]["w"], plain[0]["w"]), "the clip did nothing"


def _slow_outer_step(rank: int, world: int, stall: bool) -> dict:
    """local:2:quorum:2 on 2 workers, timeout 2 s; ``stall``: rank 1 stalls 3.5 s before its second
    outer push, so rank 0's second outer step times out and rank 0 calls step() again."""
    w = torch.nn.Parameter(torch.zeros(DIM))
    opt = pyasync.DistributedOptimizer(
        _inner([w], "sgd"), policy="local:2:quorum:2", timeout=datetime.timedelta(seconds=2)
    )
    timeouts, anchors = 0, []
    for t in range(8):
        opt.zero_grad()
        _loss(w, rank, t).backward()
        if stall and rank == 1 and t == 3:
            time.sleep(3.5)  # a stalled worker (fault injection), not synchronisation
        try:
            opt.step()
        except TimeoutError:
            timeouts += 1
        if len(anchors) < opt.local_steps.outer_steps:
            anchors.append(opt.local_steps.anchor[0].clone())
    opt.close()
    return {"w": w.detach().clone(), "timeouts": timeouts, "anchors": anchors}


def test_an_outer_step_that_timed_out_is_finished_by_the_next_step_and_pushed_once():
    """A TimeoutError leaves the outer step in flight; the next step() installs its answer and takes it
    as the anchor before its inner step, so its change is applied once: the global values after each
    outer step equal those of a run without the stall, bit for bit, up to the one after the stall.
    From there the runs differ a little, and only because that one step's gradient was computed (by
    the user's backward, before step()) on the replica the late answer had not yet replaced."""
    calm = run_workers(_slow_outer_step, 2, args=(False,), timeout=120)
    res = run_workers(_slow_outer_step, 2, args=(True,), timeout=120)
    assert [r["timeouts"] for r in calm] == [0, 0] and [r["timeouts"] for r in res] == [1, 0]
    for r in res:
        assert len(r["anchors"]) == 4
        assert torch.equal(r["w"], res[0]["w"])
        for k in (0, 1):  # outer step 1 (the stalled one) is 0-based index 1
            assert torch.equal(r["anchors"][k], calm[0]["anchors"][k]), k
    torch.testing.assert_close(res[0]["w"], _local_reference(2, 8, 2), rtol=0, atol=0.01)
    torch.testing.assert_close(calm[0]["w"], _local_reference(2, 8, 2), rtol=1e-5, atol=1e-6)


# -- dynamic local steps (Note [Dynamic local steps] in pyasync/local.py) ---------------------------------
def test_the_speed_board_gives_slower_workers_fewer_steps():
    import torch.distributed as dist

    from pyasync.local import SpeedBoard

    st = dist.HashStore()
    fast, slow = SpeedBoard(st, "job/e0/speed", 0, 2), SpeedBoard(st, "job/e0/speed", 1, 2)
    assert fast.steps(0.1, 16) == 16, "the other worker has not published: H"
    assert slow.steps(0.2, 16) == 8 and fast.steps(0.1, 16) == 16
    assert slow.steps(0.35, 16) == 5 and slow.steps(100.0, 16) == 1  # rounded, at least 1
    assert fast.steps(float("nan"), 16) == 16 and fast.failures == 0  # nothing measured yet
    st.set("job/e0/speed/0", "nonsense")
    assert slow.steps(0.2, 16) == 16 and slow.failures == 1

    class Broken:
        def set(self, *a):
            raise RuntimeError("store gone")

    gone = SpeedBoard(Broken(), "job/e0/speed", 0, 2)
    assert gone.steps(0.1, 16) == 16 and gone.failures == 1


def _adaptive(rank: int, world: int, slow_s: float) -> dict:
    """local:4:async:adaptive, 40 steps; rank 2 takes ``slow_s`` more per step (a slow device)."""
    w = torch.nn.Parameter(torch.zeros(DIM))
    opt = pyasync.DistributedOptimizer(
        _inner([w], "sgd"), policy="local:4:async:adaptive", timeout=datetime.timedelta(seconds=60)
    )
    targets = []
    for t in range(40):
        if rank == 2:
            time.sleep(slow_s)  # the emulated slow device: the quantity being adapted to
        opt.zero_grad()
        _loss(w, rank, t).backward()
        opt.step()
        targets.append(opt.local_steps.target)
    loc = opt.local_steps
    out = {"targets": targets, "outer": loc.outer_steps, "failures": loc.board.failures}
    opt.close()
    out["w"] = w.detach().clone()
    return out


def test_adaptive_local_steps_give_a_slow_worker_fewer_steps_per_outer_step():
    res = run_workers(_adaptive, 3, args=(0.05,), timeout=120)
    assert all(r["failures"] == 0 for r in res)
    assert res[2]["targets"][-1] < H, res[2]["targets"]  # ~50 ms against a few ms: 1
    assert res[0]["targets"][-1] == res[1]["targets"][-1] == H
    assert res[2]["outer"] > res[0]["outer"] == 40 // H  # more outer steps for the same 40 step() calls
    for r in res:
        assert torch.equal(r["w"], res[0]["w"]) and torch.isfinite(r["w"]).all()
