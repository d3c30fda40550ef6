"""A rank that dies: SIGKILL at several points under every policy, a rank that exits (or drops its
optimizer) without close(); and the start-up checks of item 6 of "Drop-in safety" (hyperparameters
that differ between ranks, sparse parameters, one optimizer wrapped twice, gradients of the wrong
shape or dtype), state_dict() after close(). Real processes over loopback, real signals; every wait
bounded, no duration asserted. See docs/reliability.md, "Faults: what each rank sees".

What every survivor of a death must see: ``pyasync.PeerFailure`` naming exactly the dead rank (the
same type and ranks on every survivor), from the first call that needs the dead rank; ``close()``
returns or raises without hanging; no engine thread is left; the process exits with code 0.
"""

from __future__ import annotations

import datetime
import gc
import os
import signal

import pytest
import torch
from _dist import multiproc, run_workers
from _faults import Net, ctx, describe, die, engine_threads, make, train_step, value_of, wait_state

pytestmark = multiproc

TIMEOUT = datetime.timedelta(seconds=10)  # the optimizer's; a PeerFailure comes long before it
HARNESS_S = 150  # run_workers' limit for a whole run
KILL_AT = 3  # the victim dies at this step
MAX_STEPS = 400  # survivors step until something raises, at most this many steps


class _Failed(Exception):
    pass


def _call(rec: dict, what: str, fn, *args):
    """Run one call; on an exception, record it with the call's name and stop the run."""
    try:
        return fn(*args)
    except Exception as e:
        rec["failed_call"], rec["error"] = what, describe(e)
        raise _Failed from e


def _close(rec: dict, opt) -> dict:
    """close() after whatever happened (it must return or raise, never hang), then what is left."""
    try:
        opt.close()
        rec["close"] = None
    except Exception as e:
        rec["close"] = describe(e)
    rec["threads"] = engine_threads()
    return rec


# -- SIGKILL of one rank --------------------------------------------------------------------------------

# (policy, point): every point under BSP and ASP, three or four under SSP(1) and Quorum(n - 1).
# PYASYNC_FAULT_MATRIX=full runs every policy at every point.
POINTS = ["backward", "before_step", "step_pre_hook", "mid_push", "save", "barrier"]
CASES = [(p, x) for p in ("bsp", "asp") for x in POINTS] + [
    ("ssp:1", "before_step"), ("ssp:1", "mid_push"), ("ssp:1", "save"),
    ("quorum", "backward"), ("quorum", "step_pre_hook"), ("quorum", "save"), ("quorum", "barrier"),
    # coded replies and pushes (int8 both ways): the same promises
    ("asp+int8", "mid_push"), ("ssp:1+int8", "before_step"), ("bsp+int8", "backward"),
]
if os.environ.get("PYASYNC_FAULT_MATRIX") == "full":
    CASES = [(p, x) for p in ("bsp", "ssp:1", "asp", "quorum") for x in POINTS]


def _arm(opt, point: str, armed: list) -> None:
    """Make this rank SIGKILL itself at ``point`` of the step at which ``armed[0]`` is set."""
    if point == "step_pre_hook":  # inside step(), before anything is pushed
        opt.register_step_pre_hook(lambda *_: die() if armed[0] else None)
    elif point == "mid_push" and not hasattr(opt.engine, "pusher"):  # BSP on collectives: between the
        gather = opt.engine._gather  # reduce-scatter and the all-gather of the step

        def die_before_gather(t):
            if armed[0]:
                die()
            return gather(t)

        opt.engine._gather = die_before_gather
    elif point == "mid_push":  # inside step(), in the push thread: one message of the step is out
        tp = opt.engine.transport
        send = tp.send

        def send_then_die(buf, dst, flow):
            h = send(buf, dst, flow)
            if armed[0] and flow == "push":
                die()
            return h

        tp.send = send_then_die
    elif point == "save":  # inside save_checkpoint, after its first collectives, writing its file
        import pyasync.checkpoint.save as save_mod

        save_mod.atomic_write = lambda *a, **k: die()


def _killed(rank, world, policy, point, victim, ready, seen, tmp):
    """Train until a call raises; the victim SIGKILLs itself at step KILL_AT, at ``point``.

    A survivor closes only once every survivor has seen the failure (``seen``): a survivor's close()
    after a failure aborts its connections, which others may report as its own death (see
    test_a_rank_that_gives_up_does_not_hide_the_true_cause in test_failures_stalls.py)."""
    import pyasync

    policy, _, codec = policy.partition("+")  # "asp+int8": ASP with int8 pushes and replies
    model, opt = make(policy, world, TIMEOUT, compression=codec or None)
    me = rank == victim
    armed = [False]
    if me:
        _arm(opt, point, armed)
    rec: dict = {"rank": rank, "steps": 0, "failed_call": None, "error": None, "after": None}
    try:
        for t in range(MAX_STEPS):
            if t == KILL_AT and point == "save":
                _call(rec, "save_checkpoint", pyasync.save_checkpoint, tmp, opt)
            if t == KILL_AT and point == "barrier":
                # The victim dies inside opt.barrier(), after its PAUSE, once every survivor is about to
                # call it. (A plain barrier here could strand a rank lagging one step behind under
                # Quorum: Note [Barriers and quorums].)
                if me:
                    opt._meet = lambda what: [ready.acquire(timeout=60) for _ in range(world - 1)] and die()
                else:
                    ready.release()
                _call(rec, "barrier", opt.barrier)
            armed[0] = me and t == KILL_AT
            _call(rec, "step", train_step, model, opt, rank, t,
                  die if armed[0] and point == "backward" else None,
                  die if armed[0] and point == "before_step" else None)
            rec["steps"] = t + 1
    except _Failed:
        try:  # the optimizer keeps failing with the same cause
            train_step(model, opt, rank, -1)
        except Exception as e:
            rec["after"] = describe(e)
        seen.wait(60)  # threading.BrokenBarrierError: another survivor never saw the failure
        return _close(rec, opt)
    _close(rec, opt)  # every step went through: close() is the call that needs the dead rank
    rec["failed_call"], rec["error"] = "close", rec["close"]
    seen.wait(60)
    return rec


def _check_survivors(res: list, codes: list, victim: int) -> list[dict]:
    """The promises every survivor of a SIGKILLed rank keeps; their records."""
    survivors = [r for r in range(len(res)) if r != victim]
    assert codes[victim] == -signal.SIGKILL, f"victim exit code {codes[victim]}"
    kinds = set()
    for r in survivors:
        rec = res[r]
        assert codes[r] == 0, f"rank {r} exited with {codes[r]} (-6: SIGABRT at exit)"
        err = rec["error"]
        assert err is not None, f"rank {r} never saw rank {victim} fail: {rec}"
        assert rec["threads"] == [], f"rank {r}: engine threads left after close(): {rec['threads']}"
        kinds.add((err["type"], err["ranks"]))
    assert len(kinds) == 1, f"the survivors raised different things: {kinds}"
    return [res[r] for r in survivors]


def _peer_failure_naming(err: dict | None, victim: int) -> bool:
    return err is not None and err["type"] == "PeerFailure" and err["ranks"] == (victim,)


def _run_kill(policy: str, point: str, world: int, victim: int, tmp) -> list[dict]:
    codes: list = []
    c = ctx()
    args = (policy, point, victim, c.Semaphore(0), c.Barrier(world - 1), str(tmp))
    res = run_workers(_killed, world, args=args, timeout=HARNESS_S, may_die=(victim,), exitcodes=codes)
    recs = _check_survivors(res, codes, victim)
    for rec in recs:
        err = rec["error"]
        if point == "save":
            assert rec["failed_call"] == "save_checkpoint", rec
            assert err["type"] == "CheckpointError", err
            assert any(_peer_failure_naming(c, victim) for c in err["chain"]), err
        else:
            assert _peer_failure_naming(err, victim), rec
            assert f"rank {victim} failed" in err["msg"], err
        if policy.partition("+")[0] == "bsp" and rec["failed_call"] == "step":
            assert "resume from the last checkpoint" in err["msg"], err
        if point == "barrier":
            assert rec["failed_call"] == "barrier", rec
        if rec["failed_call"] != "close":
            assert _peer_failure_naming(rec["after"], victim), rec  # later calls fail with the same cause
    return recs


@pytest.mark.parametrize(("policy", "point"), CASES)
def test_sigkill_of_one_rank(policy, point, tmp_path):
    _run_kill(policy, point, 3, 1, tmp_path)


@pytest.mark.parametrize(("policy", "point"), [("bsp", "mid_push"), ("asp", "backward")])
def test_sigkill_of_rank_0_of_4(policy, point, tmp_path):
    """Rank 0 also serves the job's TCPStore here: the engine does not need it once built."""
    _run_kill(policy, point, 4, 0, tmp_path)


def _killed_after_a_slow_reader(rank, world, policy, point, victim, ready, seen, tmp, left, pid):
    """``_killed``, with rank 2 slow to read the keys of the constructor's last meeting: it reads them
    only once the victim (the store's host) has returned from its constructor and died (or 5 s later,
    when the victim is still in its constructor: Note [The store's host leaves last])."""
    import pyasync.session.bootstrap as bootstrap_mod
    import pyasync.session.meet as meet

    if rank == victim:
        pid.value = os.getpid()
        settle = bootstrap_mod.settle

        def settle_then_say(*a, **k):
            out = settle(*a, **k)
            left.set()
            return out

        bootstrap_mod.settle = settle_then_say
    elif rank == 2:
        wait_keys = meet._wait_keys

        def read_late(st, keys, timeout, look=None, **k):
            if getattr(look, "__qualname__", "") == "settle.<locals>.look" and left.wait(5):
                wait_state(value_of(pid), "ZX", HARNESS_S)
            return wait_keys(st, keys, timeout, look, **k)

        meet._wait_keys = read_late
    return _killed(rank, world, policy, point, victim, ready, seen, tmp)


def test_the_store_host_leaves_construction_last(tmp_path):
    """Rank 0 hosts the store and dies at its third step while rank 2 still reads the construction's
    keys: without the host waiting for every reader, rank 2's constructor failed (the store gone) while
    the others' returned (a CI run of test_sigkill_of_rank_0_of_4)."""
    world, victim, codes = 4, 0, []
    c = ctx()
    args = (
        "asp",
        "backward",
        victim,
        c.Semaphore(0),
        c.Barrier(world - 1),
        str(tmp_path),
        c.Event(),
        c.Value("i", 0),
    )
    res = run_workers(
        _killed_after_a_slow_reader, world, args=args, timeout=HARNESS_S, may_die=(victim,), exitcodes=codes
    )
    for rec in _check_survivors(res, codes, victim):
        assert _peer_failure_naming(rec["error"], victim), rec


# -- exit without close() -------------------------------------------------------------------------------

_KEEP: list = []  # what a rank keeps alive until its interpreter exits


def _leaves(rank, world, how, leaver, pid, gone, seen, done):
    """Rank ``leaver`` takes KILL_AT steps and then leaves without close(): it returns from the worker
    (``return``: the optimizer is freed then; ``exit``: it is kept alive until the interpreter exits) or
    drops the optimizer (``del``) and stays. ASP: the others step on until a call raises."""
    model, opt = make("asp", world, TIMEOUT)
    rec: dict = {"failed_call": None, "error": None}
    if rank == leaver:
        for t in range(KILL_AT):
            train_step(model, opt, rank, t)
        pid.value = os.getpid()
        if how == "exit":
            _KEEP.append(opt)
        elif how == "del":
            del opt
            gc.collect()
            rec["threads"] = engine_threads()  # stopped by the finalizer
            gone.set()
            assert done.wait(HARNESS_S)  # stay alive until the others have seen it leave
        return rec
    if how == "del":
        assert gone.wait(HARNESS_S)
    else:
        assert wait_state(value_of(pid), "ZX", HARNESS_S) in "ZX", "the leaver's process did not end"
    try:
        for t in range(MAX_STEPS):
            _call(rec, "step", train_step, model, opt, rank, t)
    except _Failed:
        pass
    seen.wait(HARNESS_S)
    _close(rec, opt)
    done.set()
    return rec


@pytest.mark.parametrize("how", ["return", "exit", "del"])
def test_a_rank_that_leaves_without_close(how):
    """Its own process exits normally (code 0, no SIGABRT); the others get PeerFailure naming it."""
    world, leaver = 3, 2
    c = ctx()
    codes: list = []
    args = (how, leaver, c.Value("i", 0), c.Event(), c.Barrier(world - 1), c.Event())
    res = run_workers(_leaves, world, args=args, timeout=HARNESS_S, exitcodes=codes)
    assert codes == [0, 0, 0], f"exit codes {codes} (-6: SIGABRT at exit)"
    for r in (0, 1):
        assert _peer_failure_naming(res[r]["error"], leaver), res[r]
        assert res[r]["failed_call"] == "step" and res[r]["threads"] == [], res[r]
    if how == "del":
        assert res[leaver]["threads"] == [], res[leaver]


def _leaves_after_the_others_closed(rank, world):
    model, opt = make("bsp", world, TIMEOUT)
    rec: dict = {"failed_call": None, "error": None}
    try:
        for t in range(KILL_AT):
            _call(rec, "step", train_step, model, opt, rank, t)
        if rank == 1:
            return rec  # no close(): the optimizer is freed as the worker returns
        _call(rec, "close", opt.close)  # waits for rank 1's close, which never comes
    except _Failed:
        # Rank 1's last step may return before its owner's answer to rank 0 left: then rank 0's last
        # step is the call that sees it go.
        pass
    return _close(rec, opt)


def test_close_reports_a_rank_that_left_without_close():
    """BSP, two ranks: rank 1 returns without close(); rank 0's close() (or its last step, when rank 1
    left before its owner answered it) raises PeerFailure naming rank 1."""
    codes: list = []
    res = run_workers(_leaves_after_the_others_closed, 2, timeout=HARNESS_S, exitcodes=codes)
    assert codes == [0, 0], codes
    assert _peer_failure_naming(res[0]["error"], 1), res[0]
    assert res[0]["failed_call"] in ("close", "step") and res[0]["threads"] == [], res[0]


# -- start-up checks and misuse (item 6), state after close() -----------------------------------------


def _attempt(make_opt) -> dict | None:
    """Build an optimizer (and close it); what it raised, or None."""
    try:
        opt = make_opt()
    except Exception as e:
        return describe(e)
    opt.close()
    return None


def _wrap(optimizer, **kw):
    import pyasync

    return pyasync.DistributedOptimizer(optimizer, timeout=TIMEOUT, **kw)


def _misuse(rank, world):
    from torch.optim import SGD, Adam, AdamW

    other = rank == world - 1  # the last rank passes something else
    params = lambda: torch.nn.Linear(4, 4).parameters()  # noqa: E731
    out: dict = {
        "lr": _attempt(lambda: _wrap(SGD(params(), lr=0.2 if other else 0.1))),
        "momentum": _attempt(lambda: _wrap(SGD(params(), lr=0.1, momentum=0.8 if other else 0.9))),
        "betas": _attempt(lambda: _wrap(Adam(params(), betas=(0.9, 0.99) if other else (0.9, 0.999)))),
        "weight_decay": _attempt(lambda: _wrap(AdamW(params(), weight_decay=0.02 if other else 0.01))),
        "same": _attempt(lambda: _wrap(AdamW(params(), weight_decay=0.01))),
    }
    sparse = torch.nn.Parameter(torch.zeros(4, 4).to_sparse())
    out["sparse"] = _attempt(lambda: _wrap(SGD([sparse, torch.nn.Parameter(torch.zeros(3))], lr=0.1)))

    # One torch optimizer wrapped twice: refused while the first wrapper is open, fine after its close().
    sgd = SGD(params(), lr=0.1)
    first = _wrap(sgd)
    out["twice"] = _attempt(lambda: _wrap(sgd))
    first.close()
    out["after_close"] = _attempt(lambda: _wrap(sgd))

    # After close(): state_dict() raises at once, stats() still answers.
    try:
        first.state_dict()
        out["state_dict"] = None
    except RuntimeError as e:
        out["state_dict"] = describe(e)
    out["stats_clock"] = first.stats().clock

    # A gradient of the wrong shape or dtype: step() names the parameter, the optimizer stays usable.
    torch.manual_seed(0)
    model = Net()
    opt = _wrap(SGD(model.parameters(), lr=0.1), policy="bsp", named_parameters=model.named_parameters())
    for t, bad in enumerate(("shape", "dtype", None)):
        with opt.no_sync():  # no early encode: the bad gradient meets step()'s checks first (see below)
            train_step_grads(model, rank, t)
        if other and bad == "shape":
            model.fc1.weight.grad.data = torch.zeros(3)  # .grad = ... would refuse it; .data does not
        if other and bad == "dtype":
            model.fc2.bias.grad.data = model.fc2.bias.grad.double()
        try:
            opt.step()
            out[f"grad_{bad}"] = None
        except (TypeError, ValueError) as e:
            out[f"grad_{bad}"] = describe(e)
            if bad == "shape":  # fix it in place of the bad one
                model.fc1.weight.grad = torch.zeros_like(model.fc1.weight)
            else:  # or compute the gradients again
                train_step_grads(model, rank, t)
            opt.step()
    opt.close()
    out["grad_params"] = [p.detach().clone() for p in model.parameters()]
    out["grad_clock"] = opt.stats().clock
    return out


def train_step_grads(model, rank: int, t: int) -> None:
    """Gradients of step ``t`` on this rank, as train_step computes them, without the step."""
    g = torch.Generator().manual_seed(1000 * rank + t)
    for p in model.parameters():
        p.grad = None
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()


def test_startup_checks_and_misuse():
    world = 2
    res = run_workers(_misuse, world, timeout=HARNESS_S)
    for key, needle in [("lr", "lr=0.2"), ("momentum", "momentum=0.8"), ("betas", "betas=(0.9, 0.99)"),
                        ("weight_decay", "weight_decay=0.02")]:
        errs = [r[key] for r in res]
        assert all(e is not None for e in errs), f"{key}: ranks that differ were accepted"
        assert {e["msg"] for e in errs} == {errs[0]["msg"]}, f"{key}: ranks raised different errors"
        e = errs[0]
        assert e["type"] == "AgreementError" and "param_groups" in e["msg"] and needle in e["msg"], e
        assert f"rank {world - 1}" in e["msg"], e
    for r, o in enumerate(res):
        assert o["same"] is None, o["same"]
        e = o["sparse"]
        assert e is not None and e["type"] == "TypeError", e
        assert "sparse" in e["msg"] and "contiguous" not in e["msg"], e
        e = o["twice"]
        assert e is not None and e["type"] == "TypeError" and "already wrapped" in e["msg"], e
        assert o["after_close"] is None, o["after_close"]
        e = o["state_dict"]
        assert e is not None and "close" in e["msg"], e
        assert o["stats_clock"] == 0
        assert o["grad_None"] is None and o["grad_clock"] == 3, r
        assert torch.equal(torch.cat([p.reshape(-1) for p in o["grad_params"]]),
                           torch.cat([p.reshape(-1) for p in res[0]["grad_params"]]))
    good, bad = res[0], res[world - 1]
    assert good["grad_shape"] is None and good["grad_dtype"] is None
    e = bad["grad_shape"]
    assert e is not None and e["type"] == "ValueError" and "fc1.weight" in e["msg"] and "shape" in e["msg"], e
    assert "tensors[" not in e["msg"], e
    e = bad["grad_dtype"]
    assert e is not None and e["type"] == "TypeError" and "fc2.bias" in e["msg"] and "float64" in e["msg"], e


def _bad_grad_early(rank, world, bad, policy):
    """As the gradient checks of _misuse, but the bad gradient is what the hooks hand to the push thread
    while backward runs: a hook registered before the optimizer's swaps ``.data`` at step 1."""
    torch.manual_seed(0)
    model = Net()
    target = model.fc1.weight if bad == "shape" else model.fc2.bias
    swap = [False]

    def spoil(p):
        if swap[0]:
            p.grad.data = torch.zeros(3) if bad == "shape" else p.grad.double()

    target.register_post_accumulate_grad_hook(spoil)  # runs before the optimizer's own hook
    opt = _wrap(torch.optim.SGD(model.parameters(), lr=0.1), policy=policy,
                named_parameters=model.named_parameters())
    rec: dict = {"error": None, "retry": None}
    for t in range(3):
        swap[0] = rank == world - 1 and t == 1
        train_step_grads(model, rank, t)
        swap[0] = False
        try:
            opt.step()
        except Exception as e:
            rec["error"] = rec["error"] or describe(e)
            train_step_grads(model, rank, t)
            try:
                opt.step()
            except Exception as e2:
                rec["retry"] = describe(e2)
                break
    _close(rec, opt)
    return rec


@pytest.mark.parametrize("policy", ["bsp", "bsp:p2p", "asp"])
@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_bad_gradient_encoded_early_is_named_and_leaves_the_optimizer_usable(bad, policy):
    world = 2
    res = run_workers(_bad_grad_early, world, args=(bad, policy), timeout=HARNESS_S)
    rec = res[world - 1]
    name = "fc1.weight" if bad == "shape" else "fc2.bias"
    e = rec["error"]
    assert e is not None and e["type"] in ("TypeError", "ValueError") and name in e["msg"], e
    assert rec["retry"] is None and rec["close"] is None, rec
