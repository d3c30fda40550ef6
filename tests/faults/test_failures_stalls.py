"""Ranks that are missing without dying, or before the optimizer exists: a SIGSTOPped rank (BSP, ASP),
a rank dead or late at construction, a step that timed out and goes on, close() while another rank
still trains or has stopped. Real processes over loopback, real signals; every wait bounded, no
duration asserted. See docs/reliability.md, "Faults: what each rank sees".
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import time

import pytest
import torch
from _dist import multiproc, run_workers
from _faults import ctx, describe, die, engine_threads, make, train_step, value_of, wait_state

pytestmark = multiproc

SHORT = datetime.timedelta(seconds=3)  # the optimizer's timeout where a test waits for it to pass
HARNESS_S = 150


# -- construction: a rank dead before it, a rank late to it ------------------------------------------


def _dead_before_construction(rank, world, victim):
    import pyasync

    if rank == victim:
        die()
    rec = {"error": None}
    try:
        make("bsp", world, SHORT)
    except pyasync.PeerFailure as e:
        rec["error"] = describe(e)
    rec["threads"] = engine_threads()
    return rec


def test_a_rank_dead_before_construction_is_named_by_the_others():
    world, victim = 3, 2
    codes: list = []
    res = run_workers(_dead_before_construction, world, args=(victim,), timeout=HARNESS_S, may_die=(victim,),
                      exitcodes=codes)
    assert codes == [0, 0, -signal.SIGKILL], codes
    for r in (0, 1):
        err = res[r]["error"]
        assert err is not None and err["ranks"] == (victim,), res[r]
        assert "did not reach the construction" in err["msg"] and f"[{victim}]" in err["msg"], err
        assert res[r]["threads"] == []


def _late_to_construction(rank, world, late, gave_up, done):
    rec = {"error": None}
    if rank == late:
        gave_up.wait(HARNESS_S)  # arrive only once every other rank has given up
    try:
        _, opt = make("bsp", world, SHORT)
        opt.close()
    except Exception as e:
        rec["error"] = describe(e)
    rec["threads"] = engine_threads()
    if rank == late:
        done.set()
    else:
        gave_up.wait(HARNESS_S)
        # Stay (rank 0 serves the job's store) until the late rank has its answer.
        assert done.wait(HARNESS_S), "the late rank never got an answer"
    return rec


def test_a_rank_late_to_construction():
    world, late = 3, 2
    gave_up, done = ctx().Barrier(world), ctx().Event()
    codes: list = []
    res = run_workers(_late_to_construction, world, args=(late, gave_up, done), timeout=HARNESS_S,
                      exitcodes=codes)
    assert codes == [0, 0, 0], codes
    for r in (0, 1):
        err = res[r]["error"]
        assert err is not None and err["type"] == "PeerFailure" and err["ranks"] == (late,), res[r]
        assert "did not reach the construction" in err["msg"], err
    err = res[late]["error"]
    assert err is not None, "the late rank constructed an optimizer although every other rank had given up"
    assert res[late]["threads"] == []


def test_a_rank_late_to_construction_is_told_who_gave_up():
    world, late = 3, 2
    res = run_workers(_late_to_construction, world, args=(late, ctx().Barrier(world), ctx().Event()),
                      timeout=HARNESS_S)
    err = res[late]["error"]
    assert err["type"] == "PeerFailure" and err["ranks"] == (0, 1), err


# -- SIGSTOP: a rank that hangs without dying ---------------------------------------------------------

STOP_AT = 2  # the stopped rank stops itself before this step


def _stopped_bsp(rank, world, victim, then, pid, timed_out, seen):
    """BSP; the victim SIGSTOPs itself before step STOP_AT. Each other rank's step times out; once all
    have, rank 0 sends ``then`` (SIGCONT or SIGKILL) to the victim, and every rank steps on."""
    model, opt = make("bsp:p2p", world, SHORT)
    rec: dict = {"timeout": None, "error": None, "close": None}
    for t in range(STOP_AT):
        train_step(model, opt, rank, t)
    if rank == victim:
        pid.value = os.getpid()
        os.kill(os.getpid(), signal.SIGSTOP)  # the others' step STOP_AT cannot complete until SIGCONT
        for t in range(STOP_AT, STOP_AT + 2):
            train_step(model, opt, rank, t)
    else:
        try:
            train_step(model, opt, rank, STOP_AT)
        except TimeoutError as e:
            rec["timeout"] = describe(e)
        timed_out.wait(HARNESS_S)  # every rank but the victim timed out
        if rank == 0:
            assert wait_state(value_of(pid), "T", 60) == "T", "the victim is not stopped"
            os.kill(pid.value, then)
        try:
            train_step(model, opt, rank, STOP_AT + 1)  # finishes step STOP_AT first (it stayed in flight)
        except Exception as e:
            rec["error"] = describe(e)
        if then == signal.SIGKILL:
            seen.wait(HARNESS_S)  # no survivor closes before all have seen the failure
    try:
        opt.close()
    except Exception as e:
        rec["close"] = describe(e)
    rec["threads"] = engine_threads()
    rec["clock"] = opt.stats().clock
    rec["params"] = [p.detach().clone() for p in model.parameters()]
    return rec


@pytest.mark.parametrize("then", ["SIGCONT", "SIGKILL"])
def test_a_stopped_rank_under_p2p_bsp_times_out_the_others(then):
    world, victim = 3, 2
    sig = getattr(signal, then)
    c = ctx()
    codes: list = []
    res = run_workers(_stopped_bsp, world,
                      args=(victim, sig, c.Value("i", 0), c.Barrier(world - 1), c.Barrier(world - 1)),
                      timeout=HARNESS_S, may_die=(victim,) if then == "SIGKILL" else (), exitcodes=codes)
    for r in (0, 1):
        rec = res[r]
        err = rec["timeout"]
        assert err is not None and err["type"] == "TimeoutError", rec
        assert f"[{victim}]" in err["msg"] and f"step {STOP_AT}" in err["msg"], err
        assert rec["threads"] == [] and codes[r] == 0, (rec, codes)
    if then == "SIGCONT":  # the step in flight and the next one complete, and all finish together
        assert codes == [0, 0, 0], codes
        for rec in res:
            assert rec["error"] is None and rec["close"] is None, rec
            assert rec["clock"] == STOP_AT + 2, rec
            assert all(torch.equal(a, b) for a, b in zip(rec["params"], res[0]["params"], strict=True))
    else:
        assert codes[victim] == -signal.SIGKILL, codes
        for r in (0, 1):
            err = res[r]["error"]
            assert err is not None and err["type"] == "PeerFailure" and err["ranks"] == (victim,), res[r]


def _stopped_collective(rank, world, victim, pid, answered):
    """BSP on collectives; the victim SIGSTOPs itself before step STOP_AT. The others' step fails: a
    collective that times out cannot be resumed (as in DDP), so they name the stopped rank and close.
    Then rank 0 sends SIGCONT: the victim's own step fails, naming the ranks that gave up on it."""
    model, opt = make("bsp", world, SHORT)
    rec: dict = {"error": None, "again": None, "close": None}
    for t in range(STOP_AT):
        train_step(model, opt, rank, t)
    if rank == victim:
        pid.value = os.getpid()
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        train_step(model, opt, rank, STOP_AT)
    except Exception as e:
        rec["error"] = describe(e)
    if rank != victim:
        try:
            train_step(model, opt, rank, STOP_AT + 1)  # the same failure again, at once
            rec["again"] = {"msg": "no error"}
        except Exception as e:
            rec["again"] = describe(e)
    try:
        opt.close()
    except Exception as e:
        rec["close"] = describe(e)
    rec["threads"] = engine_threads()
    if rank == 0:
        assert wait_state(value_of(pid), "T", 60) == "T", "the victim is not stopped"
        os.kill(pid.value, signal.SIGCONT)
    if rank == victim:
        answered.set()
    else:
        assert answered.wait(HARNESS_S), "the victim never got an answer"  # rank 0 serves the store
    return rec


def test_a_stopped_rank_under_bsp_on_collectives_is_named_and_told():
    world, victim = 3, 2
    c = ctx()
    codes: list = []
    res = run_workers(_stopped_collective, world, args=(victim, c.Value("i", 0), c.Event()),
                      timeout=HARNESS_S, exitcodes=codes)
    assert codes == [0, 0, 0], codes
    for r in (0, 1):
        rec = res[r]
        err = rec["error"]
        assert err is not None and err["type"] == "PeerFailure" and err["ranks"] == (victim,), rec
        assert f"step {STOP_AT}" in err["msg"], err
        assert rec["again"] is not None and rec["again"]["msg"] == err["msg"], rec  # the same cause
        assert rec["close"] is None and rec["threads"] == [], rec
    err = res[victim]["error"]
    assert err is not None and err["type"] == "PeerFailure" and set(err["ranks"]) <= {0, 1}, res[victim]
    assert f"[{victim}]" in err["msg"], err  # what the others stopped for: this rank


def _stopped_then_leave(rank, world, victim, late, pid):
    """BSP on collectives; the victim SIGSTOPs itself before step STOP_AT, and every survivor ends as
    soon as its step failed: rank 0's process, which hosts the job's store, included. Rank ``late``
    reaches the step 2 s after the others (a slower rank), so its roll call through the store ends after
    rank 0's; once it has its error it SIGKILLs the victim, which never resumes."""
    model, opt = make("bsp", world, SHORT)
    for t in range(STOP_AT):
        train_step(model, opt, rank, t)
    if rank == victim:
        pid.value = os.getpid()
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == late:
        time.sleep(2.0)  # the injected fault: this rank is slower, not a stand-in for synchronisation
    err = None
    try:
        train_step(model, opt, rank, STOP_AT)
    except Exception as e:
        err = describe(e)
    if rank == late:
        assert wait_state(value_of(pid), "T", 60) == "T", "the victim is not stopped"
        os.kill(pid.value, signal.SIGKILL)
    return err


def test_a_stopped_rank_is_named_by_survivors_that_leave_at_once():
    """Every survivor names the stopped rank, also the one whose roll call ends after rank 0 (the store's
    host) has its answer and leaves: a roll call waits until every rank that answered has read it."""
    world, victim, late = 4, 1, 3
    res = run_workers(
        _stopped_then_leave,
        world,
        args=(victim, late, ctx().Value("i", 0)),
        timeout=HARNESS_S,
        may_die=[victim],
    )
    for r in (0, 2, late):
        err = res[r]
        assert err is not None and err["type"] == "PeerFailure" and err["ranks"] == (victim,), (r, err)
        assert f"step {STOP_AT}" in err["msg"], (r, err)


ASP_STEPS = 50  # steps the others take while one rank is stopped


def _stopped_asp(rank, world, victim, pid, stepped):
    model, opt = make("asp", world, SHORT)
    rec: dict = {"steps_while_stopped": 0}
    for t in range(STOP_AT):
        train_step(model, opt, rank, t)
    if rank == victim:
        pid.value = os.getpid()
        os.kill(os.getpid(), signal.SIGSTOP)
        for t in range(STOP_AT, STOP_AT + 2):
            train_step(model, opt, rank, t)
    else:
        assert wait_state(value_of(pid), "T", 60) == "T", "the victim did not stop"
        for t in range(STOP_AT, STOP_AT + ASP_STEPS):
            train_step(model, opt, rank, t)  # never waits for the stopped rank
            rec["steps_while_stopped"] += 1
        rec["patience_expired"] = opt.stats().patience_expired
        # Resume the victim only once both have stepped past it: a rank slower to its first step (a
        # loaded machine) would otherwise look for a stopped victim that is running again.
        stepped.wait(HARNESS_S)
        if rank == 0:
            os.kill(pid.value, signal.SIGCONT)
    opt.close()  # the others wait (their deadline resets while it makes progress) until it closed too
    rec["threads"] = engine_threads()
    rec["params"] = [p.detach().clone() for p in model.parameters()]
    return rec


def test_asp_goes_on_while_a_rank_is_stopped():
    world, victim = 3, 2
    codes: list = []
    c = ctx()
    res = run_workers(_stopped_asp, world, args=(victim, c.Value("i", 0), c.Barrier(world - 1)),
                      timeout=HARNESS_S, exitcodes=codes)
    assert codes == [0, 0, 0], codes
    for r in (0, 1):
        assert res[r]["steps_while_stopped"] == ASP_STEPS
        # ASP waits for its own answers (Note [Patience with one's own answers]), but for the stopped
        # owner once, not at each of the 50 steps
        assert 1 <= res[r]["patience_expired"] < ASP_STEPS // 2, res[r]["patience_expired"]
    for rec in res:
        assert rec["threads"] == []
        assert all(torch.equal(a, b) for a, b in zip(rec["params"], res[0]["params"], strict=True))


@pytest.mark.parametrize("policy", ["bsp", "bsp:p2p", "asp:patience=inf"])
def test_a_rank_that_gives_up_does_not_hide_the_true_cause(policy):
    """BSP (or ASP waiting for its own answers without patience), rank 2 stopped: ranks 0 and 1 time out
    naming it. Rank 0 gives up (close(), which times out too). Rank 1 then steps again: it must keep
    failing with the true cause (rank 2), not blame rank 0."""
    world, victim = 3, 2
    c = ctx()
    args = (policy, victim, c.Value("i", 0), c.Event(), c.Event(), c.Barrier(world))
    res = run_workers(_gives_up, world, args=args, timeout=HARNESS_S, may_die=(victim,))
    err = res[1]["error"]
    assert err is not None and (f"[{victim}]" in err["msg"] or f"rank {victim}" in err["msg"]), err


def _gives_up(rank, world, policy, victim, pid, closed, retried, stepped):
    import pyasync

    model, opt = make(policy, world, SHORT)
    rec: dict = {"timeout": None, "error": None}
    train_step(model, opt, rank, 0)
    # Under ASP the victim's step 0 may end before its owner answered the others' pushes of step 0: it
    # stops only once every rank has its answers, so that step 1 is the first to miss it.
    stepped.wait(HARNESS_S)
    if rank == victim:
        pid.value = os.getpid()
        os.kill(os.getpid(), signal.SIGSTOP)
        return rec  # killed while stopped
    try:
        train_step(model, opt, rank, 1)
    except (TimeoutError, pyasync.PeerFailure) as e:  # bsp:p2p: the step times out; bsp: it fails
        rec["timeout"] = describe(e)
    if rank == 0:
        try:
            opt.close()
        except Exception as e:
            rec["error"] = describe(e)
        closed.set()
        assert retried.wait(HARNESS_S), "rank 1 never stepped again"
        assert wait_state(value_of(pid), "T", 60) == "T"
        os.kill(pid.value, signal.SIGKILL)
        return rec
    assert closed.wait(HARNESS_S), "rank 0 never closed"
    try:
        train_step(model, opt, rank, 2)
    except Exception as e:
        rec["error"] = describe(e)
    retried.set()
    with contextlib.suppress(Exception):  # only the step's error is under test
        opt.close()
    return rec


# -- a step that timed out goes on --------------------------------------------------------------------


def _slow_then_back(rank, world, released):
    import pyasync

    p = torch.nn.Parameter(torch.zeros(4 * world))
    opt = pyasync.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), policy="bsp:p2p", timeout=SHORT)
    rec: dict = {"timeout": None}
    for t in range(4):
        if rank == 1 and t == 1:
            assert released.wait(HARNESS_S), "rank 0 never timed out"  # slow: absent until rank 0 gave up
        opt.zero_grad()
        (-p.sum()).backward()  # every step, every rank: gradient -1 everywhere, so p moves by +1
        if rank == 0 and t == 1:
            try:
                opt.step()  # rank 1 has not pushed step 1: BSP cannot complete it
            except TimeoutError as e:
                rec["timeout"] = str(e)
            released.set()
            continue  # the next step() finishes step 1 (it stayed in flight), then does its own
        opt.step()
    rec["clock"] = opt.stats().clock
    rec["before_close"] = p.detach().clone()
    opt.close()
    rec["params"] = p.detach().clone()
    rec["threads"] = engine_threads()
    return rec


def test_the_step_after_a_timed_out_step_completes():
    """(The point-to-point BSP: on collectives a step that timed out is a failure, as in DDP.) Rank 1 is
    merely slow at step 1: rank 0's step 1 times out (naming rank 1); its next step() finishes
    step 1 once rank 1 catches up, then does step 2; both ranks end at the same clock and parameters."""
    res = run_workers(_slow_then_back, 2, args=(ctx().Event(),), timeout=HARNESS_S)
    msg = res[0]["timeout"]
    assert msg is not None and "worker ranks [1]" in msg and "step 1" in msg, msg
    # Rank 0 called step() 3 times after step 0 (one raised); rank 1 called it 3 times too.
    for rec in res:
        assert rec["clock"] == 4, rec
        assert torch.equal(rec["before_close"], torch.full((8,), 4.0)), rec
        assert torch.equal(rec["params"], torch.full((8,), 4.0)) and rec["threads"] == []


# -- close() while another rank still trains ------------------------------------------------------------

CLOSE_TIMEOUT = datetime.timedelta(seconds=2)
FAST_STEPS, LAG_STEPS, LAG_S = 5, 20, 0.25  # the laggard's extra steps (20 x 0.25 s = 5 s > the timeout)


def _laggard(rank, world, policy, laggard):
    import time

    model, opt = make(policy, world, CLOSE_TIMEOUT)
    rec: dict = {"close": None}
    steps = FAST_STEPS + (LAG_STEPS if rank == laggard else 0)
    for t in range(steps):
        if t >= FAST_STEPS:
            time.sleep(LAG_S)  # emulated slowness (a slow data loader), not synchronisation
        train_step(model, opt, rank, t)
    try:
        opt.close()  # the fast ranks wait here for the laggard: longer than the timeout, with progress
    except Exception as e:
        rec["close"] = describe(e)
    rec["clock"] = opt.stats().clock
    rec["threads"] = engine_threads()
    rec["params"] = [p.detach().clone() for p in model.parameters()]
    return rec


@pytest.mark.parametrize("policy", ["asp", "quorum"])
def test_close_waits_for_a_laggard_that_makes_progress(policy):
    world, laggard = 3, 2
    res = run_workers(_laggard, world, args=(policy, laggard), timeout=HARNESS_S)
    for r, rec in enumerate(res):
        assert rec["close"] is None, f"rank {r}: {rec['close']}"
        assert rec["clock"] == FAST_STEPS + (LAG_STEPS if r == laggard else 0)
        assert rec["threads"] == []
        assert all(torch.equal(a, b) for a, b in zip(rec["params"], res[0]["params"], strict=True)), r


def _stalled_laggard(rank, world, policy, pid, stepped):
    model, opt = make(policy, world, CLOSE_TIMEOUT)
    rec: dict = {"close": None}
    for t in range(FAST_STEPS):
        train_step(model, opt, rank, t)
    if rank == 1:
        # Stop once rank 0 has taken all its steps (under Quorum they need this rank's owner too).
        assert stepped.wait(HARNESS_S)
        pid.value = os.getpid()
        os.kill(os.getpid(), signal.SIGSTOP)
        return rec  # killed while stopped
    stepped.set()
    try:
        opt.close()
    except Exception as e:
        rec["close"] = describe(e)
    rec["threads"] = engine_threads()
    assert wait_state(value_of(pid), "T", 60) == "T"
    os.kill(pid.value, signal.SIGKILL)
    return rec


@pytest.mark.parametrize("policy", ["asp", "quorum"])
def test_close_fails_when_a_laggard_makes_no_progress(policy):
    """Two ranks (with three, the first rank whose close() times out would abort, and the other might
    name it instead: see test_a_rank_that_gives_up_does_not_hide_the_true_cause)."""
    codes: list = []
    res = run_workers(_stalled_laggard, 2, args=(policy, ctx().Value("i", 0), ctx().Event()),
                      timeout=HARNESS_S, may_die=(1,), exitcodes=codes)
    err = res[0]["close"]
    assert err is not None and err["type"] == "TimeoutError", res[0]
    assert "[1]" in err["msg"] and "close" in err["msg"], err
    assert res[0]["threads"] == [] and codes == [0, -signal.SIGKILL], (res[0], codes)


# -- construction again, after a rank's own construction failed --------------------------------------


def _retry_after_a_local_error(rank, world, first_done):
    import pyasync

    rec: dict = {"first": None, "second": None}
    params = [torch.nn.Parameter(torch.zeros(4 * world))]
    if rank == 1:  # a mistake on one rank only, caught before it meets the others
        params.append(torch.nn.Parameter(torch.zeros(2, 2).to_sparse()))
    try:
        pyasync.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), timeout=SHORT).close()
    except (TypeError, pyasync.PeerFailure) as e:
        rec["first"] = describe(e)
    if rank == 0:
        first_done.set()
    assert first_done.wait(HARNESS_S)  # rank 1 retries once rank 0's first attempt is over
    try:  # fixed: every rank builds the same optimizer again
        pyasync.DistributedOptimizer(torch.optim.SGD(params[:1], lr=1.0), timeout=SHORT).close()
    except Exception as e:
        rec["second"] = describe(e)
    return rec


def test_construction_works_again_after_a_rank_failed_before_the_meeting():
    res = run_workers(_retry_after_a_local_error, 2, args=(ctx().Event(),), timeout=HARNESS_S)
    assert res[1]["first"]["type"] == "TypeError" and "sparse" in res[1]["first"]["msg"], res[1]
    assert res[0]["first"]["type"] == "PeerFailure" and res[0]["first"]["ranks"] == (1,), res[0]
    assert res[0]["second"] is None and res[1]["second"] is None, res
