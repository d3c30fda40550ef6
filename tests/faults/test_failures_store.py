"""The job's store hosted by a worker (rank 0, as with ``init_method="tcp://..."`` or plain env://)
under ``elastic=True``: rank 0 stopped (SIGSTOP) or killed (SIGKILL). Every survivor must raise a
PeerFailure that names the store's host and says that an elastic job needs its store outside the
workers, bounded by the timeout (Note [A bounded store] in pyasync/session/meet.py), never hang on a
store call. Real processes over loopback, real signals; every wait bounded, no duration asserted."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
from _dist import multiproc, run_workers
from _faults import ctx, describe, engine_threads, make, train_step, value_of, wait_state

pytestmark = multiproc

TIMEOUT = datetime.timedelta(seconds=5)
HARNESS_S = 150
WORLD, STOP_AT = 4, 3
LIMIT_S = 120.0  # survivors step until something raises, at most this long (never reached when it works)


def _store_host_lost(rank, world, sig, pid, seen, at, ready):
    model, opt = make("asp", world, TIMEOUT, elastic=True)
    rec: dict = {"error": None, "close": None}
    for t in range(STOP_AT):
        train_step(model, opt, rank, t)
    ready.wait(HARNESS_S)  # everyone trains: the store host goes during training, not construction
    if rank == 0:
        pid.value = os.getpid()
        at.value = time.time()
        os.kill(os.getpid(), sig)  # SIGSTOP: the survivors end it once they all have their answer
        return rec
    t, end = STOP_AT, time.monotonic() + LIMIT_S
    try:
        while time.monotonic() < end:
            train_step(model, opt, rank, t)
            t += 1
    except Exception as e:
        rec["error"] = describe(e)
        rec["after_s"] = time.time() - at.value if at.value else None
    try:
        opt.close()
    except Exception as e:
        rec["close"] = describe(e)
    rec["threads"] = engine_threads()
    seen.wait(HARNESS_S)  # every survivor has its answer
    if rank == 1 and sig == signal.SIGSTOP:
        assert wait_state(value_of(pid), "T", 60) == "T", "rank 0 is not stopped"
        os.kill(pid.value, signal.SIGKILL)
    return rec


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["sigstop", "sigkill"])
def test_a_lost_store_host_is_named_with_what_to_do(sig):
    seen, pid, at = ctx().Barrier(WORLD - 1), ctx().Value("i", 0), ctx().Value("d", 0.0)
    ready = ctx().Barrier(WORLD)
    codes: list = []
    args = (sig, pid, seen, at, ready)
    res = run_workers(_store_host_lost, WORLD, args=args, timeout=HARNESS_S, may_die=(0,), exitcodes=codes)
    for r in range(1, WORLD):
        rec = res[r]
        err = rec["error"]
        print(f"{sig.name}: rank {r} raised {rec.get('after_s')} s after the signal: {err and err['msg']}")
        assert err is not None and err["type"] == "PeerFailure", rec
        assert err["ranks"] == (0,), rec
        assert "store" in err["msg"] and "rank 0" in err["msg"], err
        assert "outside the workers" in err["msg"] and "python -m pyasync.store" in err["msg"], err
        assert rec["close"] is None, rec  # close() after the failure stops quietly (no internal error)
        assert rec["threads"] == [], rec
    assert codes[1:] == [0] * (WORLD - 1), codes
    assert codes[0] == -signal.SIGKILL, codes

