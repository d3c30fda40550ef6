"""A rank that dies inside the DistributedOptimizer's constructor, after the first meeting: while the
private group is built, while the transport is set up, in the agreement, in the initial broadcast.
Every survivor must raise PeerFailure naming the dead rank (within the timeout plus a roll call), and no
survivor's constructor may return while another's failed (Note [Failing together at construction] in
pyasync/session/meet.py). Real processes over loopback, a real SIGKILL; every wait bounded, no duration
asserted (the times are recorded for docs/reliability.md)."""

from __future__ import annotations

import datetime
import signal
import time

import pytest
import torch
from _dist import multiproc, run_workers
from _faults import describe, die, engine_threads, make, train_step

pytestmark = multiproc

TIMEOUT = datetime.timedelta(seconds=5)
HARNESS_S = 120
WORLD, VICTIM = 3, 2  # rank 0 is the broadcast's source: its broadcast returns before the victim's death


def _arm(point: str) -> None:
    """Make this process SIGKILL itself at ``point`` of the constructor (the tests' usual way: replace
    the function that runs there, in this process only)."""
    import pyasync.session.bootstrap as bootstrap_mod
    import pyasync.transport.tcp as tcp_mod

    if point == "after_meet":  # the meeting passed; the private gloo group is next
        bootstrap_mod.control_group = lambda *a, **k: die()
    elif point == "transport":  # inside the transport's set-up: after the address all-gather
        tcp_mod.Deadline = lambda *a, **k: die()
    elif point == "agreement":
        bootstrap_mod.check_agreement = lambda *a, **k: die()
    elif point == "broadcast":  # rank 0 sends to everyone; the victim dies instead of receiving
        bootstrap_mod.broadcast_initial = lambda *a, **k: die()
    else:
        raise ValueError(point)


def _die_in_constructor(rank, world, point):
    if rank == VICTIM:
        _arm(point)
    rec: dict = {"error": None, "built": False}
    t0 = time.monotonic()
    try:
        model, opt = make("asp", world, TIMEOUT)
        rec["built"] = True  # must not happen: the victim never finished its constructor
        try:
            train_step(model, opt, rank, 0)
        except Exception as e:
            rec["step_error"] = describe(e)
        opt.close()
    except Exception as e:
        rec["error"] = describe(e)
    rec["seconds"] = time.monotonic() - t0
    rec["threads"] = engine_threads()
    return rec


@pytest.mark.parametrize("point", ["after_meet", "transport", "agreement", "broadcast"])
def test_a_rank_dead_inside_the_constructor_is_named_by_every_survivor(point):
    codes: list = []
    res = run_workers(_die_in_constructor, WORLD, args=(point,), timeout=HARNESS_S, may_die=(VICTIM,),
                      exitcodes=codes)
    assert codes[VICTIM] == -signal.SIGKILL, codes
    for r in range(WORLD):
        if r == VICTIM:
            continue
        rec = res[r]
        err = rec["error"]
        print(f"{point}: rank {r} raised after {rec['seconds']:.2f} s: {err and err['msg']}")
        assert not rec["built"], f"rank {r}'s constructor returned while rank {VICTIM} died in its own: {rec}"
        err = rec["error"]
        assert err is not None and err["type"] == "PeerFailure", rec
        assert err["ranks"] == (VICTIM,), rec
        assert rec["threads"] == [], rec
    assert codes[:VICTIM] == [0] * VICTIM, codes


def _construct_twice(rank, world):
    """Construction still works, and trains, after nothing went wrong (the extra meeting is harmless)."""
    model, opt = make("asp", world, TIMEOUT)
    for t in range(3):
        train_step(model, opt, rank, t)
    opt.close()
    model2, opt2 = make("bsp", world, TIMEOUT)
    train_step(model2, opt2, rank, 0)
    opt2.close()
    return [p.detach().clone() for p in model2.parameters()]


def test_construction_meets_once_more_and_trains():
    res = run_workers(_construct_twice, WORLD, timeout=HARNESS_S)
    for r in range(1, WORLD):
        for a, b in zip(res[0], res[r]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
