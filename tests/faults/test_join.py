"""A replacement worker joins a running elastic job (Note [Joining a running job] in
pyasync/session/joining.py): a worker SIGKILLed mid-run, a new process started with PYASYNC_JOIN=1 on the
job's store, admitted at the members' next epoch change. Real processes on loopback, real signals,
bounded waits.

The ledger: SGD with lr=1 on one-hot gradients, every push (worker id w, step t) at its own position, so
each push moves exactly one element by 1/m, m the members of the epoch it was applied in (4, then 3, then
4 again). Every push of every worker that finished must be there exactly once; replicas are equal after
close()."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
from _dist import multiproc, run_with_replacements

import pyasync

TIMEOUT = datetime.timedelta(seconds=30)
WORLD = 4
MAXT = 4000  # steps per worker at most (positions of the ledger)
AFTER = 12  # steps every worker takes once the job is back at full size


def _members(opt) -> list[int]:
    return opt.stats().members


def _push(opt, p: torch.nn.Parameter, me: int, t: int) -> None:
    """One step of worker ``me``: a one-hot gradient at its own position for step ``t``."""
    opt.zero_grad()
    g = torch.zeros(p.numel())
    g[me * MAXT + t] = 1.0
    (p * g).sum().backward()
    opt.step()


def _check_ledger(done: list[dict], allowed: tuple) -> torch.Tensor:
    """Every push of every worker that finished is in the replica once (its value in ``allowed``); the
    positions seen, for the caller to check the rest."""
    p = -done[0]["p"]
    seen = torch.zeros_like(p, dtype=torch.bool)
    for r in done:
        for t in range(r["steps"]):
            i = r["me"] * MAXT + t
            seen[i] = True
            assert float(p[i]) in allowed, (r["me"], t, float(p[i]))
    return seen


def _ledger(rank: int, world: int, k: int | None, policy: str, victim: int, kill_at: int, back_at: int = 2):
    n = (world + 2) * MAXT
    p = torch.nn.Parameter(torch.zeros(n))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0),
        policy=policy,
        timeout=TIMEOUT,
        elastic=True,
        bucket_cap_mb=n // 3 * 4 / 2**20,  # several buckets: several shards per owner
    )
    ep = opt.epoch
    me = ep.members[ep.rank]
    t, full_since = 0, None
    deadline = time.monotonic() + 90
    while True:
        if k is None and rank == victim and t == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        _push(opt, p, me, t)
        t += 1
        back = len(_members(opt)) == world and (k is not None or opt.stats().epoch >= back_at)
        if back and full_since is None:
            full_since = t
        if full_since is not None and t - full_since >= AFTER:
            break
        if t >= kill_at + 2 and full_since is None:  # waiting for the replacement: pace, do not spin
            time.sleep(0.02)
        assert t < MAXT and time.monotonic() < deadline, "the replacement never joined"
    opt.close()
    st = opt.stats()
    return {"p": p.detach().clone(), "epochs": st.epochs, "me": me, "steps": t, "members": st.members}


@multiproc
@pytest.mark.parametrize("policy", ["asp", "ssp:2", "quorum:3", "bsp:p2p"])
def test_a_replacement_joins_and_the_ledger_is_exact(policy):
    victim = 2
    ranks, joiners = run_with_replacements(_ledger, WORLD, 1, args=(policy, victim, 5), timeout=180)
    assert ranks[victim] is None
    (j,) = joiners
    done = [r for r in ranks if r is not None] + [j]
    assert len(done) == WORLD
    ids = sorted(r["me"] for r in done)
    assert j["me"] == WORLD and ids == [0, 1, 3, 4], ids
    for r in done:
        assert r["members"] == ids, r["members"]
        torch.testing.assert_close(r["p"], done[0]["p"], rtol=0, atol=0)
    assert j["epochs"][0]["joined"] == [WORLD]
    for r in ranks:
        if r is None:
            continue
        lost, joined = r["epochs"][0], r["epochs"][1]
        assert lost["lost"] == [victim] and joined["joined"] == [WORLD], r["epochs"]
    if policy.startswith("quorum"):
        return  # Quorum drops late pushes by design: equal replicas and the membership are checked
    p = -done[0]["p"]
    seen = _check_ledger(done, (0.25, pytest.approx(1 / 3)))
    for t in range(5):  # the victim's pushes before it died: applied once or not at all
        i = victim * MAXT + t
        seen[i] = True
        assert float(p[i]) in (0.0, 0.25), (victim, t, float(p[i]))
    assert float(p[~seen].abs().sum()) == 0.0


def _join_in_a_death(rank: int, world: int, k: int | None, stage: str):
    """A replacement asks while the survivors change epoch after a death. ``agree``: before they agree on
    the members (the death's change admits it too); ``move``: after they agreed, while the state moves
    (the next change admits it). The survivors hold there until its request is in the store."""
    import pyasync.session.membership as membership
    from pyasync.session import meet

    st, wait = meet.store(), datetime.timedelta(seconds=60)
    if k is not None:  # the replacement: ask only once the survivors are inside the change
        st.wait(["test/changing"], wait)
    elif rank != 2:
        name = "_agree" if stage == "agree" else "_rebuild"
        real, first = getattr(membership, name), [True]

        def held(*a, **kw):
            if first[0]:  # the first change only: the death's
                first[0] = False
                st.set("test/changing", "1")
                key = st.get("pyasync/elastic/job").decode()
                st.wait([f"{key}/joiner/{world}"], wait)  # the replacement's request
            return real(*a, **kw)

        setattr(membership, name, held)
    return _ledger(rank, world, k, "asp", 2, 5, 1 if stage == "agree" else 2)


@multiproc
@pytest.mark.parametrize("stage", ["agree", "move"])
def test_a_join_during_a_deaths_change(stage):
    ranks, (j,) = run_with_replacements(_join_in_a_death, WORLD, 1, args=(stage,), timeout=180)
    assert ranks[2] is None and j is not None
    done = [r for r in ranks if r is not None] + [j]
    for r in done:
        assert r["members"] == [0, 1, 3, 4], r["members"]
        torch.testing.assert_close(r["p"], done[0]["p"], rtol=0, atol=0)
    for r in done[:-1]:
        changes = [(e["lost"], e["joined"]) for e in r["epochs"]]
        want = [([2], [4])] if stage == "agree" else [([2], []), ([], [4])]
        assert changes == want, changes
    p = -done[0]["p"]
    seen = _check_ledger(done, (0.25, pytest.approx(1 / 3)))
    for t in range(5):  # the victim's pushes before it died: applied once or not at all
        i = 2 * MAXT + t
        seen[i] = True
        assert float(p[i]) in (0.0, 0.25), (t, float(p[i]))
    assert float(p[~seen].abs().sum()) == 0.0


def _grow(rank: int, world: int, k: int | None, target: int, die_after_asking: bool, settle: bool = False):
    """Train under ASP until the job has ``target`` members, then AFTER steps more (``settle``: with at
    least one membership change seen first, for a joiner expected to fail)."""
    import pyasync.session.joining as joining_mod

    if k is not None and die_after_asking:  # registered, then gone before the members meet it
        real = joining_mod.ask
        joining_mod.ask = lambda *a: real(*a) and os.kill(os.getpid(), signal.SIGKILL)
    n = 8 * MAXT
    p = torch.nn.Parameter(torch.zeros(n))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), policy="asp", timeout=TIMEOUT, elastic=True
    )
    ep = opt.epoch
    me = ep.members[ep.rank]
    t, full_since, deadline = 0, None, time.monotonic() + 90
    while full_since is None or t - full_since < AFTER:
        _push(opt, p, me, t)
        t += 1
        if full_since is None and len(_members(opt)) == target and (not settle or opt.stats().epoch >= 1):
            full_since = t
        if full_since is None:
            time.sleep(0.02)  # the joiners are starting: pace the steps
        assert t < MAXT and time.monotonic() < deadline, f"the job never reached {target} members"
    opt.close()
    st = opt.stats()
    return {"p": p.detach().clone(), "epochs": st.epochs, "me": me, "steps": t, "members": st.members}


@multiproc
def test_two_joiners_at_once_grow_the_job():
    ranks, joiners = run_with_replacements(_grow, 2, 0, args=(4, False), timeout=150, joiners=2)
    done = ranks + joiners
    assert sorted(r["me"] for r in done) == [0, 1, 2, 3]
    for r in done:
        assert r["members"] == [0, 1, 2, 3]
        torch.testing.assert_close(r["p"], done[0]["p"], rtol=0, atol=0)
    seen = _check_ledger(done, (0.5, pytest.approx(1 / 3), 0.25))
    assert float(done[0]["p"][~seen].abs().sum()) == 0.0
    assert sorted(g for r in ranks for c in r["epochs"] for g in c["joined"]) == [2, 2, 3, 3]


@multiproc
def test_a_job_of_one_worker_grows():
    """A job started with one elastic worker publishes its record too (its prefix from
    meet.solo_key()): two workers join it, the ledger is exact."""
    ranks, joiners = run_with_replacements(_grow, 1, 0, args=(3, False), timeout=150, joiners=2)
    done = ranks + joiners
    assert sorted(r["me"] for r in done) == [0, 1, 2]
    for r in done:
        assert r["members"] == [0, 1, 2]
        torch.testing.assert_close(r["p"], done[0]["p"], rtol=0, atol=0)
    seen = _check_ledger(done, (1.0, 0.5, pytest.approx(1 / 3)))
    assert float(done[0]["p"][~seen].abs().sum()) == 0.0


@multiproc
def test_a_job_that_shrank_to_one_worker_grows_back():
    """Two workers, one SIGKILLed: the survivor trains alone (an epoch of one member, no group, no
    transport), then the replacement joins it; the ledger is exact."""
    ranks, (j,) = run_with_replacements(_ledger, 2, 1, args=("asp", 1, 5), timeout=150)
    assert ranks[1] is None
    done = [ranks[0], j]
    for r in done:
        assert r["members"] == [0, 2], r["members"]
        torch.testing.assert_close(r["p"], done[0]["p"], rtol=0, atol=0)
    assert [c["lost"] for c in ranks[0]["epochs"]] == [[1], []], ranks[0]["epochs"]
    p = -done[0]["p"]
    seen = _check_ledger(done, (0.5, 1.0))
    for t in range(5):  # the victim's pushes before it died: applied once or not at all
        seen[MAXT + t] = True
        assert float(p[MAXT + t]) in (0.0, 0.5), (t, float(p[MAXT + t]))
    assert float(p[~seen].abs().sum()) == 0.0


@multiproc
def test_a_joiner_that_dies_before_it_is_met_is_dropped():
    ranks, joiners = run_with_replacements(_grow, 3, 0, args=(3, True), timeout=150, joiners=1)
    assert joiners == [None]
    for r in ranks:
        assert r["members"] == [0, 1, 2]
        torch.testing.assert_close(r["p"], ranks[0]["p"], rtol=0, atol=0)


def _local(rank: int, world: int, k: int | None, policy: str, victim: int, kill_at: int):
    """Local steps (H = 3, inner SGD at lr 0.1) on 0.5 * |p - 2|^2 with elastic=True: the victim is
    SIGKILLed before its step ``kill_at`` (between outer steps), its replacement joins, and every worker
    takes AFTER more steps (whole outer steps) once the job is back at full size."""
    p = torch.nn.Parameter(torch.zeros(300))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.1), policy=policy, timeout=TIMEOUT, elastic=True, bucket_cap_mb=512 / 2**20
    )
    t, full_since, deadline = 0, None, time.monotonic() + 90
    while full_since is None or t - full_since < 4 * AFTER:
        if k is None and rank == victim and t == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        p.grad = p.detach() - 2.0
        opt.step()
        t += 1
        if full_since is None and len(_members(opt)) == world and opt.stats().epoch >= 2 - (k is not None):
            full_since = t
        if t >= kill_at + 2 and full_since is None:
            time.sleep(0.02)  # waiting for the replacement: pace, do not spin
        assert t < MAXT and time.monotonic() < deadline, "the replacement never joined"
    opt.close()
    st = opt.stats()
    return {"p": p.detach().clone(), "epochs": st.epochs, "members": st.members, "outer": st.clock}


@multiproc
@pytest.mark.parametrize("policy", ["local:3", "local:3:quorum:3", "local:3:async", "local:3:async:adaptive"])
def test_a_replacement_joins_under_local_steps(policy):
    """Note [Joining under local steps]: the replacement anchors at the replica it received, starts its
    inner optimizer empty and pushes its first change H steps later; the job ends at full size with equal
    replicas at the optimum (2; measured within 0.01 with no death)."""
    victim = 2
    ranks, (j,) = run_with_replacements(_local, WORLD, 1, args=(policy, victim, 7), timeout=180)
    assert ranks[victim] is None
    done = [r for r in ranks if r is not None] + [j]
    for r in done:
        assert r["members"] == [0, 1, 3, 4], r["members"]
        torch.testing.assert_close(r["p"], done[0]["p"], rtol=0, atol=0)
    assert j["epochs"][0]["joined"] == [WORLD] and j["outer"] >= AFTER, j  # 4 * AFTER steps, H_i <= 3
    p = done[0]["p"]
    assert float((p - 2.0).abs().max()) < 0.05, (float(p.min()), float(p.max()))


def _owed(rank: int, world: int, k: int | None, target: int, codec: str):
    """ASP (lr 1, no clipping) with a compressing codec until the job has ``target`` members, then AFTER
    steps more. Each step's gradient is random (fixed by worker and step) and does not depend on the
    parameters; the worker returns the sum of what it asked for, each gradient divided by the members of
    the epoch it was applied in: the first ``clock0`` of the last epoch (the pushes this worker had
    applied before the change, Note [Membership epochs]) by the old members, the rest by the new."""
    n = 3000
    p = torch.nn.Parameter(torch.zeros(n))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), policy="asp:clip=off", compression=codec, timeout=TIMEOUT, elastic=True
    )
    ep = opt.epoch
    me, d_old = ep.members[ep.rank], ep.world
    grads = []
    t, full_since, deadline = 0, None, time.monotonic() + 90
    while full_since is None or t - full_since < AFTER:
        gen = torch.Generator().manual_seed(1000 * me + t)
        grads.append(torch.randn(n, generator=gen))
        opt.zero_grad()
        p.grad = grads[-1].clone()
        opt.step()
        t += 1
        if full_since is None and len(_members(opt)) == target:
            full_since = t
        if full_since is None:
            time.sleep(0.02)  # the joiner is starting: pace the steps
        assert t < MAXT and time.monotonic() < deadline, f"the job never reached {target} members"
    opt.close()
    before, d_new = opt.epoch.clock0, opt.epoch.world
    asked = sum(g.double() / (d_old if i < before else d_new) for i, g in enumerate(grads))
    res = opt.compressor.state_dict()
    owed = torch.cat(  # this worker's residual over the whole bucket, in the final epoch's shards
        [res.get((0, r), torch.zeros(sh.numel)).double() for r, sh in enumerate(opt.epoch.layouts[0].shards)]
    )
    st = opt.stats()
    return {
        "p": p.detach().clone(),
        "asked": asked,
        "owed": owed,
        "members": st.members,
        "epochs": st.epochs,
        "before": before,
    }


@multiproc
@pytest.mark.parametrize("codec", ["topk:0.1", "int8"])
def test_what_the_workers_owe_survives_a_join(codec):
    """Error feedback across a join (Note [Membership epochs], step 5): the members keep their residuals,
    cut at the new shard bounds and scaled by divisor(m + 1) / divisor(m), and the joiner starts owing
    nothing, so the model is what every gradient asked for, less what the workers still owe: -p =
    sum_w asked_w - sum_w owed_w / 3 (owed in the final epoch's units). Resetting the residuals at the
    join (as before) loses what was owed then: about |e| / 2 per element for top-k at 10%, far above
    float32 rounding (checked)."""
    ranks, (j,) = run_with_replacements(_owed, 2, 0, args=(3, codec), timeout=150, joiners=1)
    done = ranks + [j]
    for r in done:
        assert r["members"] == [0, 1, 2], r["members"]
        torch.testing.assert_close(r["p"], done[0]["p"], rtol=0, atol=0)
    for r in ranks:
        (change,) = r["epochs"]
        assert change["joined"] == [2] and change["reinitialized"] == [], change
    asked = sum(r["asked"] for r in done)
    owed = sum(r["owed"][: asked.numel()] for r in done) / 3
    assert all(float(r["owed"][asked.numel() :].abs().sum()) == 0.0 for r in done)
    gap = -done[0]["p"].double() - (asked - owed)
    assert float(gap.abs().max()) < 1e-3, float(gap.abs().max())


def _refused(rank: int, world: int, k: int | None, what: str):
    shape, lr, codec = 64, 0.1, None
    if k is not None:
        shape, lr, codec = {
            "model": (65, lr, codec),
            "lr": (shape, 0.2, codec),
            "codec": (shape, lr, "int8"),
            "job": (shape, lr, codec),
        }[what]
        if what == "job":
            os.environ["PYASYNC_JOB_ID"] = "another-job"
    p = torch.nn.Parameter(torch.zeros(shape))
    try:
        opt = pyasync.DistributedOptimizer(
            torch.optim.SGD([p], lr=lr), policy="asp", compression=codec, timeout=TIMEOUT, elastic=True
        )
    except ValueError as e:
        return {"refused": str(e)}
    for _ in range(20):
        opt.zero_grad()
        p.grad = torch.ones_like(p)
        opt.step()
    opt.close()
    return {"members": opt.stats().members, "p": p.detach().clone()}


@multiproc
@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("model", "its parameters differ"),
        ("lr", "its hyperparameters differ"),
        ("codec", "its compression differ"),
        ("job", "its job id is 'another-job', the job's on this store is ''"),
    ],
)
def test_a_joiner_that_does_not_belong_is_refused(what, says):
    ranks, (j,) = run_with_replacements(_refused, 2, 0, args=(what,), timeout=90, joiners=1)
    assert "cannot join the running job" in j["refused"] and says in j["refused"], j
    for r in ranks:
        assert r["members"] == [0, 1]
        torch.testing.assert_close(r["p"], torch.full((64,), -2.0), rtol=0, atol=1e-6)


def _transfer_fault(rank: int, world: int, k: int | None, who: str):
    import pyasync.session.membership as membership

    if (who == "joiner" and k is not None) or (who == "donor" and k is None and rank == 1):

        def dying(epoch, setup, mem):  # inside the change's collectives, while the state moves
            os.kill(os.getpid(), signal.SIGKILL)

        membership._give_replica = dying
    return _grow(rank, world, k, 3, False, settle=True)


def _stopped_joiner(rank: int, world: int, k: int | None):
    """The joiner stops (SIGSTOP: its connections stay open) inside the change, while the state moves;
    rank 0 SIGKILLs it once the members are done."""
    from torch.distributed.distributed_c10d import _get_default_store

    import pyasync.session.membership as membership

    st = _get_default_store()
    if k is not None:
        st.set("stopped", str(os.getpid()))
        membership._give_replica = lambda epoch, setup, mem: os.kill(os.getpid(), signal.SIGSTOP)
    out = _grow(rank, world, k, 3, False, settle=True)
    if rank == 0:
        os.kill(int(st.get("stopped")), signal.SIGKILL)
    return out


def _corrupted(rank: int, world: int, k: int | None):
    """The joiner's replica arrives with one value changed: every member's change must fail, naming it."""
    import pyasync.session.membership as membership

    if k is not None:
        real = membership._give_replica

        def flipped(epoch, setup, mem):
            real(epoch, setup, mem)
            with torch.no_grad():
                setup.params[0].view(-1)[7] += 1.0

        membership._give_replica = flipped
    try:
        _grow(rank, world, k, 3, False)
    except RuntimeError as e:
        return str(e)
    return "no error"


@multiproc
def test_a_corrupted_transfer_fails_the_join_naming_who_differs():
    ranks, (j,) = run_with_replacements(_corrupted, 2, 0, timeout=150, joiners=1)
    for said in [*ranks, j]:
        assert "the replicas of members [2] differ from member 0's (buckets [0])" in said, said


@multiproc
def test_a_joiner_stopped_while_the_state_moves_is_dropped():
    """A hung joiner (SIGSTOP, no connection ends): the members' change fails at the timeout (30 s
    here: gloo's send to it never completes), they find it gone (it marked nothing, Note [Joining a
    running job]) and change again without it, at their size, within the timeout and the grace
    (measured 40 s)."""
    from pyasync.session.joining import GRACE_S

    ranks, (j,) = run_with_replacements(_stopped_joiner, 3, 0, timeout=200, joiners=1)
    assert j is None
    for r in ranks:
        assert r["members"] == [0, 1, 2], r["members"]
        torch.testing.assert_close(r["p"], ranks[0]["p"], rtol=0, atol=0)
        (change,) = r["epochs"]
        assert change["joined"] == [] and change["seconds"] < TIMEOUT.total_seconds() + GRACE_S + 10, change


@multiproc
@pytest.mark.parametrize("who", ["joiner", "donor"])
def test_a_death_while_the_state_moves(who):
    ranks, (j,) = run_with_replacements(_transfer_fault, 3, 0, args=(who,), timeout=150, joiners=1)
    if who == "joiner":  # the job goes on at its size without it
        assert j is None
        done = ranks
        assert all(r["members"] == [0, 1, 2] for r in done)
    else:  # the joiner gets in without the dead donor; the job is back at 3 + 1 - 1
        assert ranks[1] is None and j is not None
        done = [ranks[0], ranks[2], j]
        assert all(r["members"] == [0, 2, 3] for r in done), [r["members"] for r in done]
    for r in done:
        torch.testing.assert_close(r["p"], done[0]["p"], rtol=0, atol=0)
