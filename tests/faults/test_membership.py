"""Elastic membership (session/membership.py): a worker SIGKILLed mid-run, the survivors agree on a new
epoch, re-shard and keep training. Real processes on loopback, real signals, bounded waits.

The ledger: SGD with lr=1 on one-hot gradients, so every push (worker w, step t) moves exactly one
element, by 1/n before the epoch change and by 1/m after it. Every survivor's push must be there exactly
once, those to the dead owner too (replayed on the freshest replica: engine/p2p/replay.py); replicas are
equal after close()."""

from __future__ import annotations

import datetime
import os
import signal

import pytest
import torch
from _dist import multiproc, run_workers

import pyasync
from pyasync.transport.gloo import GlooTransport

TIMEOUT = datetime.timedelta(seconds=30)
STEPS = 24
WORLD = 4


def _pos(w: int, t: int, n: int) -> int:
    return (w * STEPS + t) % n


def _ledger(rank: int, world: int, policy: str, victim: int, kill_at: int, where: str, n: int, codec):
    p = torch.nn.Parameter(torch.zeros(n))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0),
        policy=policy,
        compression=codec,
        timeout=TIMEOUT,
        elastic=True,
        bucket_cap_mb=64 * 4 / 2**20,  # several buckets: several shards per owner rank
    )
    if rank == victim and where == "step":  # inside step(), before anything of it is sent
        opt.register_step_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL) if t == kill_at else None)
    if rank == victim and where == "backward":  # inside backward()
        p.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL) if t == kill_at else None)
    for t in range(STEPS):
        opt.zero_grad()
        g = torch.zeros(n)
        g[_pos(rank, t, n)] = 1.0
        (p * g).sum().backward()  # p.grad = g
        opt.step()
    opt.close()
    st = opt.stats()
    return {"p": p.detach().clone(), "epochs": st.epochs, "clock": st.clock, "members": st.members}


@multiproc
@pytest.mark.parametrize(
    ("policy", "victim", "where", "codec"),
    [
        ("asp", 2, "step", None),
        ("ssp:2", 1, "backward", None),
        ("quorum:3", 3, "step", None),
        ("bsp:p2p", 2, "backward", None),
        ("asp", 1, "step", "int8"),
    ],
)
def test_survivors_finish_with_an_exact_ledger(policy, victim, where, codec):
    n = 4 * WORLD * STEPS + 8
    res = run_workers(
        _ledger, WORLD, args=(policy, victim, 7, where, n, codec), timeout=150, may_die=(victim,)
    )
    assert res[victim] is None
    live = [r for r in range(WORLD) if r != victim]
    for r in live:
        assert res[r]["clock"] == STEPS, res[r]
        assert res[r]["members"] == live
        (ch,) = res[r]["epochs"]
        assert ch["lost"] == [victim] and ch["members"] == live and ch["epoch"] == 1
        torch.testing.assert_close(res[r]["p"], res[live[0]]["p"], rtol=0, atol=0)
    p = -res[live[0]]["p"]
    if policy.startswith("quorum") or codec is not None:
        return  # Quorum drops late pushes by design; int8 is checked for equal replicas and survival
    assert all(res[r]["epochs"][0]["pushes_lost"] == 0 for r in live)
    resent = sum(res[r]["epochs"][0]["pushes_resent"] for r in live)
    assert resent == sum(res[r]["epochs"][0]["pushes_replayed"] for r in live)
    if policy == "bsp:p2p":  # the dead owner never completed the round of its own missing push
        assert resent >= len(live), resent
    seen = torch.zeros_like(p, dtype=torch.bool)
    for w in range(WORLD):
        for t in range(STEPS):
            i = _pos(w, t, n)
            seen[i] = True
            if w == victim:
                assert float(p[i]) in (0.0, 0.25), (w, t, float(p[i]))
                continue
            assert float(p[i]) in (0.25, pytest.approx(1 / 3)), (w, t, float(p[i]))
    assert float(p[~seen].abs().sum()) == 0.0


MOMENTUM_STEPS = 60


def _quadratic(rank, world, policy: str, victim: int, kill_at: int, codec=None, lr=0.1, mu=0.9):
    """SGD at momentum ``mu`` (0.9) on 0.5 * |p - 2|^2 on every rank, under a policy's defaults (look-
    ahead replies, moments per round, spike clipping); the victim is SIGKILLed inside step(). The same
    optimum on every rank: under ASP the point where workers with different optima meet depends on who
    pushed last, which the machine's load decides."""
    p = torch.nn.Parameter(torch.zeros(300))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=lr, momentum=mu),
        policy=policy,
        compression=codec,
        timeout=TIMEOUT,
        elastic=True,
        bucket_cap_mb=128 * 4 / 2**20,  # several buckets: several shards per owner rank
    )
    if rank == victim:
        opt.register_step_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL) if t == kill_at else None)
    for t in range(MOMENTUM_STEPS):  # noqa: B007 (the kill hook reads t)
        opt.zero_grad()
        p.grad = p.detach() - 2.0
        opt.step()
    opt.close()
    st = opt.stats()
    return {"p": p.detach().clone(), "epochs": st.epochs, "clock": st.clock}


@multiproc
@pytest.mark.parametrize(
    ("policy", "codec"), [("asp", None), ("ssp:2", None), ("asp", "topk:0.05"), ("bsp:p2p", "topk:0.05")]
)
def test_a_death_under_momentum_with_the_look_ahead_on(policy, codec):
    """The defaults of ASP and SSP answer with look-ahead values (Note [Look-ahead replies]), which the
    dead owner's shards are then rebuilt from: the survivors finish with equal, finite replicas that
    still converge to the optimum. With top-k the momentum lives in the workers' velocities
    (Note [Momentum correction for top-k]), which the epoch change re-cuts with the residuals; top-k runs
    at lr 0.01: at 0.1 (lr / (1 - momentum) = 1 / curvature, the edge of stability) error feedback's
    late delivery diverges with momentum, corrected (|p - 2| ~ 1e3) or not (~ 4e2), without a death.
    At 0.01 the correction converges (0.04 in a one-process model) where uncorrected top-k does not (0.8)."""
    victim = 2
    lr = 0.1 if codec is None else 0.01
    res = run_workers(_quadratic, WORLD, args=(policy, victim, 9, codec, lr), timeout=150, may_die=(victim,))
    assert res[victim] is None
    live = [r for r in range(WORLD) if r != victim]
    for r in live:
        assert res[r]["clock"] == MOMENTUM_STEPS and res[r]["epochs"][0]["lost"] == [victim], res[r]
        torch.testing.assert_close(res[r]["p"], res[live[0]]["p"], rtol=0, atol=0)
    p = res[live[0]]["p"]
    assert torch.isfinite(p).all()
    # From 0, 2 away. Top-k moves slowly here (each element is sent about every 20 steps; the survivors
    # keep their velocities and residuals at the death, re-cut onto the new shards) and overshoots, as
    # momentum does when mass arrives late: after 60 steps ASP's p measured 1.94-2.67 in six runs on an
    # idle machine, 2.03-2.81 in one CI run (bsp:p2p: 1.91-2.18 every time; 1.91-2.83 when the change
    # reset them), so its bound is "within half the start's distance, and not diverging" (a diverging
    # run ends hundreds away). The order of ASP's pushes, and so p, depends on the machine's load.
    bound = 0.2 if codec is None else 1.0
    assert float((p - 2.0).abs().max()) < bound, (float(p.min()), float(p.max()))


@multiproc
@pytest.mark.parametrize("policy", ["local:3", "local:3:quorum:3", "local:3:async"])
def test_a_death_under_local_steps(policy):
    """Local steps with elastic=True (outer BSP point to point, Quorum, ASP): a worker SIGKILLed inside
    step() between outer steps; the survivors park their progress, move to a new epoch and put it back
    on the installed values (Note [Local steps]), finish every outer step (the engine's clock counts
    them), with equal replicas at the optimum (measured 1.97-2.00, as without a death). The inner SGD has
    no momentum here: inner momentum 0.9 at this lr sits at the edge of stability, and the outer
    Nesterov step on top of it swings (2.6, async -4 after 60 steps, with no death)."""
    victim = 2
    args = (policy, victim, 10, None, 0.1, 0.0)
    res = run_workers(_quadratic, WORLD, args=args, timeout=150, may_die=(victim,))
    assert res[victim] is None
    live = [r for r in range(WORLD) if r != victim]
    for r in live:
        assert res[r]["clock"] == MOMENTUM_STEPS // 3 and res[r]["epochs"][0]["lost"] == [victim], res[r]
        torch.testing.assert_close(res[r]["p"], res[live[0]]["p"], rtol=0, atol=0)
    p = res[live[0]]["p"]
    assert torch.isfinite(p).all() and float((p - 2.0).abs().max()) < 0.05, (float(p.min()), float(p.max()))


def _local_fault(rank: int, world: int, policy: str, victim: int, at: int, fault: str):
    """Local steps (H = 3) with elastic=True on 0.5 * |p - 2|^2; before its step ``at`` (between outer
    steps) the victim stops (SIGSTOP: rank 0 wakes it once the survivors are done) or exits without
    close() (os._exit(0))."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    store.set(f"pid{rank}", str(os.getpid()))
    p = torch.nn.Parameter(torch.zeros(300))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.1), policy=policy, timeout=TIMEOUT, elastic=True, bucket_cap_mb=512 / 2**20
    )
    err = None
    try:
        for t in range(MOMENTUM_STEPS):
            if rank == victim and t == at:
                if fault == "exit":
                    os._exit(0)
                os.kill(os.getpid(), signal.SIGSTOP)  # a hang: no connection closes
            opt.zero_grad()
            p.grad = p.detach() - 2.0
            opt.step()
        opt.close()
    except pyasync.PeerFailure as e:
        err = str(e)
        opt.close()  # after the failure step() raised: stops quietly
    if rank == 0 and fault == "stop":  # the survivors are done: wake the stopped rank up
        os.kill(int(store.get(f"pid{victim}")), signal.SIGCONT)
    st = opt.stats()
    return {"p": p.detach().clone(), "err": err, "epochs": st.epochs, "clock": st.clock}


@multiproc
@pytest.mark.parametrize("fault", ["stop", "exit"])
@pytest.mark.parametrize("policy", ["local:3", "local:3:quorum:3", "local:3:async"])
def test_a_stopped_or_departed_worker_under_local_steps(policy, fault):
    """A worker SIGSTOPped, or gone without close(), between outer steps: the survivors drop it (the
    heartbeats, or its closed connections), finish every outer step with equal replicas at the optimum;
    the stopped one, woken up, is told it was dropped. Asynchronously this needs the outer ASP to wait
    for its answers without a patience (Note [Local steps]): with one, the stopped owner's shard ended at
    5-7 instead of 2 (every change measured from its frozen anchor, all replayed at the drop)."""
    victim = 2
    res = run_workers(_local_fault, WORLD, args=(policy, victim, 10, fault), timeout=150, may_die=(victim,))
    live = [r for r in range(WORLD) if r != victim]
    for r in live:
        assert res[r]["err"] is None, res[r]["err"]
        assert res[r]["clock"] == MOMENTUM_STEPS // 3 and res[r]["epochs"][0]["lost"] == [victim], res[r]
        torch.testing.assert_close(res[r]["p"], res[live[0]]["p"], rtol=0, atol=0)
    p = res[live[0]]["p"]
    assert float((p - 2.0).abs().max()) < 0.05, (float(p.min()), float(p.max()))
    if fault == "stop":
        assert "dropped from the job" in res[victim]["err"], res[victim]["err"]
    else:
        assert res[victim] is None


def _train_external_store(rank: int, world: int, victim: int):
    p = torch.nn.Parameter(torch.zeros(64))
    opt = pyasync.DistributedOptimizer(
        torch.optim.Adam([p], lr=0.01), policy="asp", timeout=TIMEOUT, elastic=True
    )
    for t in range(12):
        if rank == victim and t == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        p.grad = torch.full_like(p, float(rank + 1))
        opt.step()
    opt.close()
    return {"p": p.detach().clone(), "epochs": opt.stats().epochs}


@multiproc
def test_rank_zero_dies_with_a_store_outside_the_workers():
    res = run_workers(_train_external_store, 3, args=(0,), timeout=120, may_die=(0,), external_store=True)
    assert res[0] is None
    torch.testing.assert_close(res[1]["p"], res[2]["p"], rtol=0, atol=0)
    assert res[1]["epochs"][0]["lost"] == [0]
    assert any("optimizer state" in s for s in res[1]["epochs"][0]["reinitialized"])


def _refusals(rank: int, world: int):
    p = torch.nn.Parameter(torch.zeros(8))
    out = {}
    for name, kw in {
        "bsp": dict(policy="bsp"),
        "clip": dict(policy="bsp:p2p", max_grad_norm=1.0),
        "rmsprop": dict(policy="asp", optimizer=torch.optim.RMSprop),
        "flag": dict(policy="asp", elastic="yes"),
        "gloo": dict(policy="asp", transport=GlooTransport),
    }.items():
        cls = kw.pop("optimizer", torch.optim.SGD)
        kw.setdefault("elastic", True)
        try:
            pyasync.DistributedOptimizer(cls([p], lr=0.1), timeout=TIMEOUT, **kw).close()
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


@multiproc
def test_elastic_refuses_what_cannot_survive():
    (res,) = run_workers(_refusals, 1, timeout=60)
    assert "bsp:p2p" in res["bsp"] and "PeerFailure" in res["bsp"]
    assert "clip each push" in res["clip"]
    assert "RMSprop" in res["rmsprop"]
    assert res["flag"].startswith("TypeError")
    assert "heartbeats" in res["gloo"] and "GlooTransport" in res["gloo"]


def _stalls(rank: int, world: int, victim: int):
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    store.set(f"pid{rank}", str(os.getpid()))
    p = torch.nn.Parameter(torch.zeros(64))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.1, momentum=0.9), policy="asp", timeout=TIMEOUT, elastic=True
    )
    err = None
    try:
        for t in range(16):
            if rank == victim and t == 5:
                os.kill(os.getpid(), signal.SIGSTOP)  # a hang: no connection closes
            opt.zero_grad()
            p.grad = torch.full_like(p, float(rank + 1))
            opt.step()
        opt.close()
    except pyasync.PeerFailure as e:
        err = {"msg": str(e), "ranks": e.ranks}
        try:  # close() after the failure that step() raised: stops quietly (no internal error)
            opt.close()
            err["close"] = None
        except Exception as e2:
            err["close"] = f"{type(e2).__name__}: {e2}"
        err["closed"] = opt.closed
    st = opt.stats() if err is None else None
    if rank == 0:  # the survivors are done: wake the stalled rank up
        os.kill(int(store.get(f"pid{victim}")), signal.SIGCONT)
    return {"p": p.detach().clone(), "err": err, "epochs": None if st is None else st.epochs}


@multiproc
def test_a_stalled_worker_is_dropped_and_told_when_it_wakes_up():
    victim = 2
    res = run_workers(_stalls, WORLD, args=(victim,), timeout=150)
    live = [r for r in range(WORLD) if r != victim]
    for r in live:
        assert res[r]["err"] is None, res[r]
        (ch,) = res[r]["epochs"]
        assert ch["lost"] == [victim] and ch["members"] == live
        assert ch["seconds"] < TIMEOUT.total_seconds()
        torch.testing.assert_close(res[r]["p"], res[live[0]]["p"], rtol=0, atol=0)
    err = res[victim]["err"]
    assert err is not None and "dropped from the job" in err["msg"], err
    assert err["close"] is None and err["closed"], err


def _until_gone(opt, g: int) -> None:
    """Wait (at most TIMEOUT) until this rank's engine has seen global rank ``g`` leave, or ``g`` is no
    longer a member."""
    e = opt._engine
    with e.cond:
        e.cond.wait_for(
            lambda: g not in opt._globals or any(opt._globals[r] == g for r in e.lost),
            TIMEOUT.total_seconds(),
        )


def _deaths(rank: int, world: int, plan: dict, ckpt: str | None):
    """Train 20 steps under ASP; ``plan``: rank -> (step, where) at which it kills itself: "step" (at the
    start of step t), "later" (from step t on, once the first epoch change is done), "recovery" (inside
    the epoch change, after its drain), "save" (while writing its checkpoint file at step 4)."""
    import pyasync.checkpoint.save as save_mod
    import pyasync.session.membership as membership

    p = torch.nn.Parameter(torch.zeros(96))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.05, momentum=0.9),
        policy="asp",
        timeout=TIMEOUT,
        elastic=True,
        bucket_cap_mb=32 * 4 / 2**20,
    )
    at, where = plan.get(rank, (-1, None))
    if where == "recovery":
        real = membership.agree_members
        membership.agree_members = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL) or real(*a, **k)
    # ASP waits for nobody: without this, the others could take all their steps before they see a death.
    # Two steps after a planned death, every other rank waits (bounded) until it has seen it.
    sees = {a + 2: victim for victim, (a, w) in plan.items() if w in ("step", "later") and victim != rank}
    errors = []
    for t in range(20):
        if (t == at and where == "step") or (t >= at and where == "later" and opt.stats().epoch >= 1):
            os.kill(os.getpid(), signal.SIGKILL)
        if t in sees:
            _until_gone(opt, sees[t])
        opt.zero_grad()
        p.grad = torch.full_like(p, float(rank + 1)) * (1 + t % 3)
        opt.step()
        if ckpt is not None and t == 4:
            if where == "save":
                save_mod.atomic_write = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
            try:
                pyasync.save_checkpoint(ckpt, opt)
            except pyasync.CheckpointError as e:
                errors.append(str(e)[:200])
    opt.close()
    st = opt.stats()
    return {"p": p.detach().clone(), "epochs": st.epochs, "clock": st.clock, "errors": errors}


def _check_deaths(res, dead, changes):
    live = [r for r in range(len(res)) if r not in dead]
    for r in dead:
        assert res[r] is None
    for r in live:
        assert res[r]["clock"] == 20, res[r]
        assert len(res[r]["epochs"]) == changes, res[r]["epochs"]
        assert res[r]["epochs"][-1]["members"] == live
        assert sorted(g for c in res[r]["epochs"] for g in c["lost"]) == sorted(dead)
        torch.testing.assert_close(res[r]["p"], res[live[0]]["p"], rtol=0, atol=0)
    return [res[r] for r in live]


@multiproc
def test_two_deaths_in_a_row():
    plan = {3: (4, "step"), 1: (8, "later")}
    _check_deaths(run_workers(_deaths, WORLD, args=(plan, None), timeout=150, may_die=(1, 3)), [1, 3], 2)


@multiproc
def test_a_death_during_the_epoch_change():
    """Rank 3 dies; rank 2 dies inside the epoch change that follows (after its drain, before it meets
    the others): the survivors go on without both, in one more epoch."""
    plan = {3: (5, "step"), 2: (-1, "recovery")}
    recs = _check_deaths(
        run_workers(_deaths, WORLD, args=(plan, None), timeout=150, may_die=(2, 3)), [2, 3], 1
    )
    assert all(r["epochs"][0]["epoch"] >= 1 for r in recs)


@multiproc
def test_a_death_during_a_checkpoint_save(tmp_path):
    """Rank 2 dies while writing its checkpoint file: the survivors' save fails with a clear
    CheckpointError, and they go on training without it."""
    plan = {2: (-1, "save")}
    recs = _check_deaths(
        run_workers(_deaths, WORLD, args=(plan, str(tmp_path / "ck")), timeout=150, may_die=(2,)), [2], 1
    )
    assert all(len(r["errors"]) == 1 for r in recs)


@multiproc
def test_lost_optimizer_state_comes_from_the_last_checkpoint(tmp_path):
    plan = {1: (9, "step")}
    recs = _check_deaths(
        run_workers(_deaths, WORLD, args=(plan, str(tmp_path / "ck")), timeout=150, may_die=(1,)), [1], 1
    )
    for r in recs:
        (what,) = r["epochs"][0]["reinitialized"]
        assert "from the checkpoint" in what, what


def _asp(rank: int, steps: int, before=lambda t: None):
    """ASP under elastic=True for ``steps`` steps; ``before(t)`` runs at the start of step t (a fault),
    and what it returns, if anything, is returned at once (no close())."""
    p = torch.nn.Parameter(torch.zeros(64))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.1), policy="asp", timeout=TIMEOUT, elastic=True
    )
    for t in range(steps):
        out = before(t)
        if out is not None:
            return out
        opt.zero_grad()
        p.grad = torch.full_like(p, float(rank + 1))
        opt.step()
    opt.close()
    st = opt.stats()
    return {"p": p.detach().clone(), "epochs": st.epochs, "clock": st.clock}


def _leaves(rank: int, world: int, victim: int, how: str):
    """``victim`` stops after step 4 without close(): "return" (its optimizer is dropped) or "exit"
    (the interpreter exits at once)."""

    def before(t):
        if rank == victim and t == 5:
            if how == "exit":
                os._exit(0)
            return {"left": True}
        return None

    return _asp(rank, 12, before)


@multiproc
@pytest.mark.parametrize("how", ["return", "exit"])
def test_a_worker_that_leaves_without_close_is_a_departure(how):
    victim = 2
    res = run_workers(_leaves, WORLD, args=(victim, how), timeout=150, may_die=(victim,))
    assert res[victim] in (None, {"left": True})
    live = [r for r in range(WORLD) if r != victim]
    for r in live:
        assert res[r]["clock"] == 12
        (ch,) = res[r]["epochs"]
        assert ch["lost"] == [victim] and ch["members"] == live and ch["pushes_lost"] == 0
        torch.testing.assert_close(res[r]["p"], res[live[0]]["p"], rtol=0, atol=0)


def _slow_owner(rank: int, world: int, slow: int, pause: float):
    """Rank ``slow`` once stalls ``pause`` seconds inside its owner (one update) and once inside its
    training loop: longer than the heartbeats' shortest deadline (3 s), but alive."""
    import time

    import pyasync.engine.p2p.applier as applier_mod

    if rank == slow:
        real, calls = applier_mod.apply_push, [0]

        def stalled(*a, **k):
            calls[0] += 1
            if calls[0] == 6:
                time.sleep(pause)  # the fault: an owner that stops applying for a while
            return real(*a, **k)

        applier_mod.apply_push = stalled

    def before(t):
        if rank == slow and t == 10:
            time.sleep(pause)  # the fault: a worker that stops computing for a while

    return _asp(rank, 16, before)


@multiproc
def test_a_slow_owner_is_not_dropped_by_the_heartbeats():
    res = run_workers(_slow_owner, WORLD, args=(1, 4.0), timeout=150)
    for r in range(WORLD):
        assert res[r]["clock"] == 16 and res[r]["epochs"] == [], res[r]
        torch.testing.assert_close(res[r]["p"], res[0]["p"], rtol=0, atol=0)
